"""Exact resume: a run stopped anywhere and continued in a new process matches a run that never stopped.

Losses are compared with ``==`` (bit for bit) and the final parameters with ``torch.equal``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from launch import JOBS
from resume_job import ResumeModule, SaveAt, dataloader, trainer_kwargs

from trainer_core import Trainer, seed_everything
from trainer_core.checkpoint import KEY_OPTIMIZER_STATES
from trainer_core.errors import CheckpointError


def _full_run(
    tmp_path: Path, accumulate: int = 1, extra: Optional[dict] = None, **save_at: int
) -> tuple[ResumeModule, Path]:
    ckpt = tmp_path / "stop.ckpt"
    seed_everything(42)
    model = ResumeModule()
    saver = SaveAt(str(ckpt), **save_at)
    trainer = Trainer(
        **trainer_kwargs(accumulate_grad_batches=accumulate, **(extra or {})), callbacks=[saver]
    )
    trainer.fit(model, dataloader(), dataloader(shuffle=False))
    assert saver.saved
    return model, ckpt


def _resume_in_new_process(
    tmp_path: Path, ckpt: Path, accumulate: int = 1, extra: Optional[dict] = None
) -> tuple[list[float], dict]:
    out = tmp_path / "resumed.json"
    subprocess.run(
        [
            sys.executable,
            str(JOBS / "resume_job.py"),
            "--ckpt",
            str(ckpt),
            "--out",
            str(out),
            "--accumulate",
            str(accumulate),
            "--trainer-kwargs",
            json.dumps(extra or {}),
        ],
        check=True,
        timeout=120,
        cwd=tmp_path,
    )
    return json.loads(out.read_text()), torch.load(str(out) + ".pt", weights_only=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("accumulate", "extra", "save_at"),
    [
        pytest.param(1, {}, {"step": 5}, id="mid-epoch"),
        pytest.param(1, {}, {"epoch": 0}, id="epoch-end"),
        pytest.param(1, {}, {"step": 13}, id="last-batch-before-its-validation"),
        pytest.param(
            1, {"val_check_interval": 0.5}, {"after_validation_step": 6}, id="after-mid-epoch-validation"
        ),
        pytest.param(1, {"val_check_interval": 0.5}, {"step": 6}, id="before-mid-epoch-validation"),
        pytest.param(3, {}, {"batch_idx": 16}, id="mid-accumulation"),
    ],
)
def test_resume_in_new_process_is_exact(tmp_path: Path, accumulate: int, extra: dict, save_at: dict) -> None:
    full, ckpt = _full_run(tmp_path, accumulate, extra, **save_at)
    losses, state = _resume_in_new_process(tmp_path, ckpt, accumulate, extra)
    assert 0 < len(losses) < len(full.losses)
    assert losses == full.losses[-len(losses) :]
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_optimizer_state_is_keyed_by_parameter_name(tmp_path: Path) -> None:
    seed_everything(0)
    model = ResumeModule()
    trainer = Trainer(**trainer_kwargs(max_epochs=1))
    trainer.fit(model, dataloader())
    path = tmp_path / "named.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    (named,) = checkpoint[KEY_OPTIMIZER_STATES]
    names = [name for name, _ in model.named_parameters()]
    assert named["param_groups"][0]["params"] == names
    original = trainer.optimizers[0].state_dict()["state"]
    for index, name in enumerate(names):
        for key, value in original[index].items():
            assert torch.equal(named["state"][name][key], value), (name, key)


def test_checkpoint_holds_every_key(tmp_path: Path) -> None:
    seed_everything(0)
    model = ResumeModule()
    trainer = Trainer(**trainer_kwargs(max_epochs=1))
    trainer.fit(model, dataloader())
    path = tmp_path / "all.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    for key in (
        "format_version",
        "trainer_core_version",
        "epoch",
        "global_step",
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "loops",
        "callbacks",
        "rng_states",
        "hyper_parameters",
        "precision",
    ):
        assert key in checkpoint, key
    assert checkpoint["global_step"] == trainer.global_step == 13
    assert checkpoint["hyper_parameters"] == {"hidden": 16, "lr": 0.01}
    assert len(checkpoint["lr_schedulers"]) == 1 and checkpoint["lr_schedulers"][0]["last_epoch"] == 13
    for name, tensor in model.state_dict().items():
        assert torch.equal(checkpoint["state_dict"][name], tensor)

    weights = tmp_path / "weights.ckpt"
    trainer.save_checkpoint(weights, weights_only=True)
    assert "optimizer_states" not in torch.load(weights, weights_only=True)
    with pytest.raises(CheckpointError, match="weights_only"):
        Trainer(**trainer_kwargs(max_epochs=2)).fit(ResumeModule(), dataloader(), ckpt_path=weights)


def test_load_from_checkpoint_rebuilds_with_hyperparameters(tmp_path: Path) -> None:
    seed_everything(0)
    model = ResumeModule(hidden=12, lr=0.05)
    trainer = Trainer(**trainer_kwargs(max_epochs=1))
    trainer.fit(model, dataloader())
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = ResumeModule.load_from_checkpoint(path)
    assert loaded.hparams == {"hidden": 12, "lr": 0.05}
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    overridden = ResumeModule.load_from_checkpoint(path, lr=0.5)
    assert overridden.hparams.lr == 0.5
    with pytest.raises(CheckpointError, match=r"model\.ckpt"):
        ResumeModule.load_from_checkpoint(path, hidden=7)


def test_failed_resume_leaves_the_run_untouched(tmp_path: Path) -> None:
    seed_everything(0)
    trainer = Trainer(**trainer_kwargs(max_epochs=1))
    trainer.fit(ResumeModule(hidden=12), dataloader())
    path = tmp_path / "other.ckpt"
    trainer.save_checkpoint(path)

    model = ResumeModule(hidden=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = Trainer(**trainer_kwargs(max_epochs=2))
    with pytest.raises(CheckpointError) as err:
        fresh.fit(model, dataloader(), ckpt_path=path)
    message = str(err.value)
    assert "other.ckpt" in message and "net.0.weight" in message and "(12, 8)" in message
    for name, tensor in model.state_dict().items():
        assert torch.equal(before[name], tensor), name
    assert fresh.global_step == 0 and fresh.current_epoch == 0

    with pytest.raises(CheckpointError, match=r"missing\.ckpt"):
        Trainer(**trainer_kwargs()).fit(ResumeModule(), dataloader(), ckpt_path=tmp_path / "missing.ckpt")


@pytest.mark.timeout(120)
def test_stateful_dataloader_resumes_mid_epoch(tmp_path: Path) -> None:
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> torchdata.StatefulDataLoader:
        base = dataloader()
        return torchdata.StatefulDataLoader(base.dataset, batch_size=8, shuffle=True)

    ckpt = tmp_path / "stateful.ckpt"
    seed_everything(5)
    full = ResumeModule()
    Trainer(**trainer_kwargs(), callbacks=[SaveAt(str(ckpt), step=7)]).fit(full, loader())
    checkpoint = torch.load(ckpt, weights_only=True)
    assert "dataloader" in checkpoint["loops"]
    seed_everything(6)
    resumed = ResumeModule()
    Trainer(**trainer_kwargs()).fit(resumed, loader(), ckpt_path=ckpt)
    assert resumed.losses == full.losses[-len(resumed.losses) :]
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "save_at", [{"step": 13}, {"epoch": 0}, {"step": 14}], ids=["last-batch", "epoch-end", "next-epoch"]
)
def test_stateful_dataloader_trains_every_epoch_and_resumes_at_an_epoch_end(
    tmp_path: Path, save_at: dict
) -> None:
    """A stateful loader's state taken after an epoch's last batch says "all yielded", not "epoch over".

    Loaded back at the next epoch's start (the run that never stopped does the same), it must still
    give the next epoch whole: every epoch trains all its batches, and a run resumed from a save at
    that moment continues exactly.
    """
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> torchdata.StatefulDataLoader:
        return torchdata.StatefulDataLoader(dataloader().dataset, batch_size=8, shuffle=True)

    ckpt = tmp_path / "stateful.ckpt"
    seed_everything(5)
    full = ResumeModule()
    Trainer(**trainer_kwargs(max_epochs=3), callbacks=[SaveAt(str(ckpt), **save_at)]).fit(full, loader())
    per_epoch = len(loader())
    assert len(full.losses) == 3 * per_epoch, "an epoch trained fewer batches than the loader has"
    seed_everything(6)
    resumed = ResumeModule()
    Trainer(**trainer_kwargs(max_epochs=3)).fit(resumed, loader(), ckpt_path=ckpt)
    assert resumed.losses == full.losses[-len(resumed.losses) :]
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "stop",
    [
        pytest.param({"max_steps": 5}, id="max_steps-mid-epoch"),
        pytest.param({"max_epochs": 1}, id="max_epochs"),
    ],
)
def test_checkpoint_saved_after_fit_resumes_exactly_in_a_new_process(tmp_path: Path, stop: dict) -> None:
    """Train for a budget, save after ``fit`` returned, continue in the next job: the run that never stopped."""
    budget = {"max_steps": 30, "max_epochs": -1}
    seed_everything(42)
    full = ResumeModule()
    Trainer(**trainer_kwargs(**budget)).fit(full, dataloader(), dataloader(shuffle=False))
    seed_everything(42)
    part = ResumeModule()
    trainer = Trainer(**trainer_kwargs(**{"max_epochs": -1, **stop}))
    trainer.fit(part, dataloader(), dataloader(shuffle=False))
    ckpt = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(ckpt)
    losses, state = _resume_in_new_process(tmp_path, ckpt, extra=budget)
    assert len(part.losses) + len(losses) == len(full.losses) == 30
    assert losses == full.losses[len(part.losses) :]
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, state[name]), name
