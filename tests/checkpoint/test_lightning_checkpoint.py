"""Coming from Lightning: a checkpoint written by ``pytorch_lightning.Trainer`` resumes in trainer-core.

One small program (``Steps`` in tests/jobs/lightning_resume_job.py) runs under real PyTorch
Lightning, which writes checkpoints at every kind of moment (mid-epoch, the last batch before its
validation, after the validation, ``on_train_epoch_end``, after ``fit`` stopped at ``max_steps``)
and goes on to ``MAX_STEPS``. trainer-core resumes each checkpoint with the same program, changed
only in its imports, and must end where Lightning ended: the same weights and optimizer state bit
for bit, the same step, epoch and batches trained on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, job_env
from lightning_resume_job import CoreNet, Steps, train_loader, val_loader

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.early_stopping import EarlyStopping
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.callbacks.timer import Timer
from trainer_core.checkpoint.cli import main as checkpoint_cli
from trainer_core.checkpoint.format import (
    KEY_DATAMODULE,
    KEY_LIGHTNING_OPTIMIZER_STATES,
    KEY_OPTIMIZER_STATES,
    KEY_PRECISION,
    validate_checkpoint,
)
from trainer_core.checkpoint.lightning import from_lightning, is_lightning_checkpoint, loop_position
from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import CheckpointError

pl = pytest.importorskip("pytorch_lightning")

MAX_STEPS = 12  # 2 epochs of 5 batches and 2 batches of a third
#: FULL_MATRIX=1 also resumes under FSDP on 2 ranks (like DDP, 45 s on 2 busy cores).
FULL = os.environ.get("FULL_MATRIX") == "1"
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


class LitNet(Steps, pl.LightningModule):
    pass


class LitSaveAt(pl.Callback):
    """``trainer.save_checkpoint`` from the hooks a user saves in, named after the hook and the step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _save(self, trainer: Any, hook: str, when: int) -> None:
        trainer.save_checkpoint(self.folder / f"{hook}-{when}.ckpt")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 5:  # the epoch's last batch, before the validation it is due
            self._save(trainer, "batch_end", 5)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step == 5:
            self._save(trainer, "validation_end", 5)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            self._save(trainer, "train_epoch_end", trainer.global_step)


@dataclass
class LightningRun:
    folder: Path
    model: LitNet
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any]
    current_epoch: int


def _lit_trainer(**kwargs: Any) -> Any:
    return pl.Trainer(**{**QUIET, "enable_checkpointing": False, **kwargs})


def _lightning_runs(folder: Path, optim: str, hidden: int) -> LightningRun:
    """The run that writes the checkpoints and goes on to MAX_STEPS, and a run stopped at step 7."""
    torch.manual_seed(0)
    model = LitNet(hidden=hidden, optim=optim)
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=folder / "mc", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    trainer = _lit_trainer(
        max_steps=MAX_STEPS, callbacks=[saver, LitSaveAt(folder)], enable_checkpointing=True
    )
    trainer.fit(model, train_loader(), val_loader())
    torch.manual_seed(0)
    stopped = _lit_trainer(max_steps=7)
    stopped.fit(LitNet(hidden=hidden, optim=optim), train_loader(), val_loader())
    stopped.save_checkpoint(folder / "after_fit-7.ckpt")
    stopped.save_checkpoint(folder / "weights_only-7.ckpt", weights_only=True)
    return LightningRun(
        folder,
        model,
        trainer.optimizers[0].state_dict(),
        trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        trainer.current_epoch,
    )


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LightningRun]:
    runs = {}
    for optim, hidden in (("adam", 8), ("sgd", 6)):
        folder = tmp_path_factory.mktemp(f"lightning-{optim}")
        runs[optim] = _lightning_runs(folder, optim, hidden)
    return runs


def _resume(ckpt: Path, hidden: int, optim: str, **kwargs: Any) -> tuple[CoreNet, Trainer]:
    model = CoreNet(hidden=hidden, optim=optim)
    trainer = Trainer(**{**QUIET, "enable_checkpointing": False, "max_steps": MAX_STEPS, **kwargs})
    trainer.fit(model, train_loader(), val_loader(), ckpt_path=str(ckpt))
    return model, trainer


def _assert_same_optimizer_state(ours: dict[str, Any], lightning: dict[str, Any]) -> None:
    assert ours["state"].keys() == lightning["state"].keys()
    for index, values in lightning["state"].items():
        assert ours["state"][index].keys() == values.keys()
        for key, value in values.items():
            assert torch.equal(ours["state"][index][key], value), (index, key)
    assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in lightning["param_groups"]]
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in lightning["param_groups"]]


# (file, global step it holds, the first (epoch, batch_idx) the resumed run trains on)
SAVE_POINTS = [
    pytest.param("mc/step=3.ckpt", 3, (0, 3), id="mid-epoch-ModelCheckpoint-every_n_train_steps"),
    pytest.param("batch_end-5.ckpt", 5, (1, 0), id="last-batch-before-its-validation"),
    pytest.param("validation_end-5.ckpt", 5, (1, 0), id="after-the-epoch-end-validation"),
    pytest.param("mc/step=6.ckpt", 6, (1, 1), id="first-batch-of-an-epoch"),
    pytest.param("train_epoch_end-10.ckpt", 10, (2, 0), id="on_train_epoch_end"),
    pytest.param("after_fit-7.ckpt", 7, (1, 2), id="after-fit-stopped-at-max_steps"),
]


@pytest.mark.parametrize(
    ("optim", "hidden"), [("adam", 8), ("sgd", 6)], ids=["adam-steplr", "sgd-two-groups"]
)
@pytest.mark.parametrize(("name", "step", "first"), SAVE_POINTS)
def test_resume_continues_the_lightning_run_exactly(
    lightning_runs: dict[str, LightningRun], optim: str, hidden: int, name: str, step: int, first: tuple
) -> None:
    run = lightning_runs[optim]
    model, trainer = _resume(run.folder / name, hidden, optim)

    # The batches the Lightning run trained on after the save, and no others.
    assert model.seen[0] == first
    assert model.seen == run.model.seen[step:]
    assert trainer.global_step == MAX_STEPS
    assert trainer.current_epoch == run.current_epoch
    for (name_ours, ours), (name_lit, theirs) in zip(model.named_parameters(), run.model.named_parameters()):
        assert name_ours == name_lit
        assert torch.equal(ours, theirs), name_ours
    _assert_same_optimizer_state(trainer.optimizers[0].state_dict(), run.optimizer_state)
    scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    assert scheduler["last_epoch"] == run.scheduler_state["last_epoch"]
    assert scheduler["_last_lr"] == run.scheduler_state["_last_lr"]


def test_loop_position_of_each_save_point(lightning_runs: dict[str, LightningRun]) -> None:
    """The position read from Lightning's loop counters, where the trainer-core run of the same program stands."""
    folder = lightning_runs["adam"].folder

    def position(name: str) -> tuple:
        loops = loop_position(torch.load(folder / name, weights_only=True))
        return (
            loops["epoch"],
            loops["batches_done_in_epoch"],
            loops["epoch_finished"],
            loops["validated_last_batch"],
            loops["total_batch_idx"],
            loops["batches_that_stepped"],
        )

    assert position("mc/step=3.ckpt") == (0, 3, False, False, 3, 3)
    assert position("batch_end-5.ckpt") == (0, 5, False, False, 5, 5)
    assert position("validation_end-5.ckpt") == (0, 5, False, True, 5, 5)
    assert position("train_epoch_end-10.ckpt") == (1, 5, True, True, 10, 10)
    assert position("after_fit-7.ckpt") == (1, 2, False, True, 7, 7)


def test_load_from_checkpoint_builds_the_module_from_its_hyper_parameters(
    lightning_runs: dict[str, LightningRun],
) -> None:
    path = lightning_runs["sgd"].folder / "mc/step=6.ckpt"
    saved = torch.load(path, weights_only=True)

    model = CoreNet.load_from_checkpoint(path)

    assert dict(model.hparams) == {"hidden": 6, "lr": 0.05, "optim": "sgd"}
    assert model.net[0].out_features == 6
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["state_dict"][name]), name
    assert CoreNet.load_from_checkpoint(path, lr=0.1).hparams.lr == 0.1
    # Saved with weights_only=True: enough to build the module, not to resume a run.
    assert torch.equal(
        CoreNet.load_from_checkpoint(lightning_runs["sgd"].folder / "weights_only-7.ckpt").net[0].weight,
        torch.load(lightning_runs["sgd"].folder / "after_fit-7.ckpt", weights_only=True)["state_dict"][
            "net.0.weight"
        ],
    )


def test_weights_only_checkpoint_cannot_resume_but_validates(lightning_runs: dict[str, LightningRun]) -> None:
    path = lightning_runs["adam"].folder / "weights_only-7.ckpt"
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*only the model weights"):
        _resume(path, 8, "adam")

    model = CoreNet()
    Trainer(**QUIET).validate(model, val_loader(), ckpt_path=str(path), verbose=False)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items())


# ---------------------------------------------------------------------- callbacks
class _AtTrainStart(Callback):
    """What the restored callbacks hold before the resumed run trains."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint):
                self.seen["mc"] = (cb.best_model_path, cb.best_model_score, dict(cb.best_k_models))
            if isinstance(cb, EarlyStopping):
                self.seen["es"] = (cb.wait_count, cb.best_score)
            if isinstance(cb, Timer):
                self.seen["timer"] = cb.time_elapsed("train")


def test_model_checkpoint_and_early_stopping_resume_their_state(tmp_path: Path) -> None:
    """ModelCheckpoint, EarlyStopping and Timer continue from Lightning's state; the run ends where Lightning's did."""
    mc_dir = tmp_path / "mc"

    def lit_callbacks() -> list[Any]:
        return [
            pl.callbacks.ModelCheckpoint(
                dirpath=mc_dir, monitor="val_loss", save_top_k=2, filename="{epoch}-{step}"
            ),
            pl.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05),
            pl.callbacks.Timer(duration="00:01:00:00"),
        ]

    torch.manual_seed(0)
    lit = _lit_trainer(
        max_epochs=8, callbacks=[*lit_callbacks(), LitSaveAt(tmp_path)], enable_checkpointing=True
    )
    lit.fit(LitNet(lr=0.2), train_loader(), val_loader())
    lit_mc, lit_es = lit.checkpoint_callback, lit.early_stopping_callback
    assert 1 < lit_es.stopped_epoch < 7  # it stopped early: the resumed run must stop at the same epoch
    ckpt = tmp_path / "train_epoch_end-10.ckpt"  # after both callbacks took epoch 1's validation
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    # The folder as the run left it when it wrote the checkpoint (as if it had stopped there).
    kept = saved[lit_mc.state_key]["best_k_models"]
    for written in mc_dir.iterdir():
        if str(written) not in kept:
            written.unlink()

    probe = _AtTrainStart()
    mc = ModelCheckpoint(dirpath=str(mc_dir), monitor="val_loss", save_top_k=2, filename="{epoch}-{step}")
    es = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05)
    model = CoreNet(lr=0.2)
    trainer = Trainer(**{**QUIET, "max_epochs": 8}, callbacks=[mc, es, Timer(duration="00:01:00:00"), probe])
    trainer.fit(model, train_loader(), val_loader(), ckpt_path=str(ckpt))

    lit_mc_state = saved[lit_mc.state_key]
    lit_es_state = saved[lit_es.state_key]
    assert probe.seen["mc"] == (
        lit_mc_state["best_model_path"],
        lit_mc_state["best_model_score"],
        lit_mc_state["best_k_models"],
    )
    assert probe.seen["es"] == (lit_es_state["wait_count"], lit_es_state["best_score"])
    # The Timer goes on counting from the training time the Lightning run had used.
    assert probe.seen["timer"] >= saved["Timer"]["time_elapsed"]["train"] > 0
    # ... and end where Lightning's run ended.
    assert (trainer.global_step, trainer.current_epoch) == (lit.global_step, lit.current_epoch)
    assert es.stopped_epoch == lit_es.stopped_epoch
    assert (es.wait_count, es.best_score) == (lit_es.wait_count, lit_es.best_score)
    assert mc.best_model_path == lit_mc.best_model_path
    assert mc.best_k_models == lit_mc.best_k_models
    assert torch.equal(mc.best_model_score, lit_mc.best_model_score)


# ---------------------------------------------------------------------- what else maps
class CursorData(LightningDataModule):
    """Lightning saves a data module's ``state_dict`` under its class's ``__qualname__``."""


def test_precision_datamodule_and_extra_keys_are_carried(lightning_runs: dict[str, LightningRun]) -> None:
    """The loss scaler, the data module's state and a module's own keys reach their trainer-core places."""
    lightning = torch.load(lightning_runs["adam"].folder / "mc/step=3.ckpt", weights_only=True)
    scaler = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 3,
    }

    class Attached:
        accumulate_grad_batches = 1
        datamodule = CursorData()

    model = CoreNet()
    model._trainer = Attached()  # type: ignore[assignment]
    lightning = {**lightning, "MixedPrecision": scaler, "CursorData": {"cursor": 7}, "my_extra": [1, 2]}

    converted = from_lightning(lightning, model, "x.ckpt")

    validate_checkpoint(converted, "x.ckpt", for_resume=True)
    assert converted[KEY_PRECISION] == scaler
    assert converted[KEY_DATAMODULE] == {"cursor": 7}
    assert converted["my_extra"] == [1, 2]
    # No optimizers yet: the states wait, index-keyed, for the optimizers to name them.
    assert converted[KEY_OPTIMIZER_STATES] == []
    assert converted[KEY_LIGHTNING_OPTIMIZER_STATES] == lightning["optimizer_states"]
    assert is_lightning_checkpoint(lightning) and not is_lightning_checkpoint(converted)


def test_optimizer_state_is_named_by_the_optimizers_order(lightning_runs: dict[str, LightningRun]) -> None:
    """The SGD program puts the output layer's group first: positions map to those names, not the module's order."""
    path = lightning_runs["sgd"].folder / "mc/step=3.ckpt"
    lightning = torch.load(path, weights_only=True)
    model = CoreNet(hidden=6, optim="sgd")
    optimizer = model.configure_optimizers()["optimizer"]

    converted = from_lightning(lightning, model, str(path), optimizers=[optimizer])

    (named,) = converted[KEY_OPTIMIZER_STATES]
    assert [group["params"] for group in named["param_groups"]] == [
        ["net.2.weight", "net.2.bias"],
        ["net.0.weight", "net.0.bias"],
    ]
    assert torch.equal(
        named["state"]["net.2.weight"]["momentum_buffer"],
        lightning["optimizer_states"][0]["state"][0]["momentum_buffer"],
    )
    assert named["state"]["net.0.weight"]["momentum_buffer"].shape == (6, 4)


def test_names_torch_saved_with_the_groups_are_used_instead_of_positions(
    lightning_runs: dict[str, LightningRun],
) -> None:
    """An optimizer built from ``named_parameters()`` stores the names: they map even in another order."""
    lightning = torch.load(lightning_runs["adam"].folder / "mc/step=3.ckpt", weights_only=True)
    saving = CoreNet()
    optimizer = torch.optim.SGD(saving.named_parameters(), lr=0.1, momentum=0.9)
    saving.net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    lightning["optimizer_states"] = [optimizer.state_dict()]
    model = CoreNet()
    reordered = torch.optim.SGD(list(model.parameters())[::-1], lr=0.1, momentum=0.9)

    (named,) = from_lightning(lightning, model, "x.ckpt", optimizers=[reordered])[KEY_OPTIMIZER_STATES]

    for name, param in saving.named_parameters():
        assert torch.equal(named["state"][name]["momentum_buffer"], optimizer.state[param]["momentum_buffer"])
    # Without the names the positions decide, and the shapes tell that the order is not the saved one.
    for group in lightning["optimizer_states"][0]["param_groups"]:
        del group["param_names"]
    with pytest.raises(CheckpointError, match=r"net\.2\.bias: momentum_buffer \(8, 4\) vs parameter \(1,\)"):
        from_lightning(lightning, model, "x.ckpt", optimizers=[reordered])


# ---------------------------------------------------------------------- bad input
class LitHeadOnly(LitNet):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net[0].parameters(), lr=0.05)


class LitGroupsInModuleOrder(LitNet):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(
            [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": 0.02}],
            lr=0.05,
            momentum=0.9,
        )


def _lightning_checkpoint(tmp_path: Path, model: Any, name: str) -> Path:
    trainer = _lit_trainer(max_steps=2)
    trainer.fit(model, train_loader())
    path = tmp_path / name
    trainer.save_checkpoint(path)
    return path


def test_optimizer_over_other_parameters_is_one_clear_error(tmp_path: Path) -> None:
    path = _lightning_checkpoint(tmp_path, LitHeadOnly(), "head-only.ckpt")
    model = CoreNet()
    trainer = Trainer(**{**QUIET, "max_steps": MAX_STEPS})

    with pytest.raises(CheckpointError) as error:
        trainer.fit(model, train_loader(), ckpt_path=str(path))

    message = str(error.value)
    assert str(path) in message and "PyTorch Lightning" in message
    assert "1 param group(s) of [2] parameters" in message and "1 of [4]" in message
    # Nothing of the training state was taken: no optimizer state, no step, no position.
    assert trainer.optimizers[0].state_dict()["state"] == {}
    assert (trainer.global_step, trainer.current_epoch) == (0, 0)


def test_optimizer_state_of_another_shape_at_a_position_is_one_clear_error(tmp_path: Path) -> None:
    """Same group sizes, other parameters at each position: the shapes tell, and nothing is mapped silently."""
    path = _lightning_checkpoint(tmp_path, LitGroupsInModuleOrder(optim="sgd"), "module-order.ckpt")
    lightning = torch.load(path, weights_only=True)
    model = CoreNet(optim="sgd")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = model.configure_optimizers()["optimizer"]

    with pytest.raises(CheckpointError) as error:
        from_lightning(lightning, model, str(path), optimizers=[optimizer])

    message = str(error.value)
    assert str(path) in message
    assert "net.2.weight: momentum_buffer (8, 4) vs parameter (1, 8)" in message
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}

    # Through fit too: one CheckpointError naming the file, and no optimizer state taken.
    trainer = Trainer(**{**QUIET, "max_steps": MAX_STEPS})
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        trainer.fit(CoreNet(optim="sgd"), train_loader(), ckpt_path=str(path))
    assert trainer.optimizers[0].state_dict()["state"] == {}


# ---------------------------------------------------------------------- the command line
def test_inspect_says_it_is_a_lightning_checkpoint(
    lightning_runs: dict[str, LightningRun], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(lightning_runs["adam"].folder / "mc/step=3.ckpt")

    assert checkpoint_cli(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert checkpoint_cli(["inspect", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    assert re.search(rf"written_by\s+PyTorch Lightning {re.escape(pl.__version__)}", text)
    assert re.search(r"global_step\s+3\n", text) and re.search(r"resumable\s+yes\n", text)
    assert report["pytorch_lightning_version"] == pl.__version__
    assert report["optimizers"] == 1 and report["parameter_names"] == 4
    assert report["model"]["tensors"] == 4


# ---------------------------------------------------------------------- under a distributed plugin
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "plugin",
    [
        pytest.param("ddp", marks=pytest.mark.skipif(not FULL, reason="with FULL_MATRIX=1 (make stress)")),
        pytest.param("fsdp", marks=pytest.mark.skipif(not FULL, reason="with FULL_MATRIX=1 (45 s)")),
    ],
)
def test_resume_on_two_ranks(lightning_runs: dict[str, LightningRun], tmp_path: Path, plugin: str) -> None:
    """2 ranks read the same batches, so the run must end on the one-process Lightning run's weights.

    DDP names the optimizer states once its optimizers exist; FSDP restores after setting up, so it
    converts with its (sharded) optimizers at hand: both paths of the conversion.
    """
    run = lightning_runs["adam"]
    proc = subprocess.run(
        [
            sys.executable,
            str(JOBS / "lightning_resume_job.py"),
            "--ckpt",
            str(run.folder / "mc/step=3.ckpt"),
            "--out",
            str(tmp_path),
            "--plugin",
            plugin,
            "--max-steps",
            str(MAX_STEPS),
        ],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert record["global_step"] == MAX_STEPS
        assert [tuple(pair) for pair in record["seen"]] == run.model.seen[3:]
        for name, tensor in run.model.state_dict().items():
            assert torch.equal(record["weights"][name], tensor), (rank, name)


# ---------------------------------------------------------------------- Lightning's hyper-parameter types
class ConfigNet(LightningModule):
    """A module whose ``__init__`` takes Lightning's containers: an ``AttributeDict`` and an ``argparse.Namespace``."""

    def __init__(self, cfg: Any = None, args: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 2)


#: Where Lightning's ``AttributeDict`` lives, as checkpoints name it: the ``lightning`` package,
#: ``lightning_fabric``/``pytorch_lightning`` (2.x, the first is what PL 2.6 writes) and the 1.x name.
ATTRIBUTE_DICT_MODULES = [
    "lightning.fabric.utilities.data",
    "lightning_fabric.utilities.data",
    "lightning.pytorch.utilities.parsing",
    "pytorch_lightning.utilities.parsing",
]
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


def _lightning_attribute_dict(monkeypatch: pytest.MonkeyPatch, module_name: str) -> type:
    """A class that pickles as Lightning's ``AttributeDict`` of ``module_name``, from fake modules."""
    import types

    parts = module_name.split(".")
    for end in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:end]), types.ModuleType(".".join(parts[:end])))
    cls = type("AttributeDict", (dict,), {"__module__": module_name})
    sys.modules[module_name].AttributeDict = cls  # type: ignore[attr-defined]
    return cls


def _lightning_file(path: Path, hyper_parameters: dict[str, Any], state_dict: dict[str, Any]) -> Path:
    torch.save(
        {
            "epoch": 0,
            "global_step": 0,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": state_dict,
            "hyper_parameters": hyper_parameters,
            "hparams_name": "kwargs",
        },
        path,
    )
    return path


@pytest.mark.parametrize("module_name", ATTRIBUTE_DICT_MODULES)
def test_lightning_attribute_dict_and_namespace_load_without_lightning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module_name: str
) -> None:
    """No ``register_safe_globals`` needed, and no Lightning: its containers load as trainer-core's own."""
    import argparse

    from trainer_core.utilities import AttributeDict

    state_dict = ConfigNet().state_dict()
    with monkeypatch.context() as writing:  # Lightning's modules exist only while the file is written
        lightning_dict = _lightning_attribute_dict(writing, module_name)
        inner = lightning_dict(depth=2)
        cfg = lightning_dict(width=3, inner=inner, again=inner)
        hparams = {"cfg": cfg, "args": argparse.Namespace(lr=0.3, layers=[4, 4])}
        path = _lightning_file(tmp_path / "lightning.ckpt", hparams, state_dict)
    for package in LIGHTNING_PACKAGES:  # `import lightning` fails, as where it is not installed
        monkeypatch.setitem(sys.modules, package, None)

    model = ConfigNet.load_from_checkpoint(path)

    cfg = model.hparams.cfg
    assert type(cfg) is AttributeDict and type(cfg.inner) is AttributeDict
    assert (cfg.width, cfg.inner.depth) == (3, 2) and cfg.inner is cfg.again
    assert type(model.hparams.args) is argparse.Namespace and vars(model.hparams.args) == {
        "lr": 0.3,
        "layers": [4, 4],
    }
    assert all(torch.equal(tensor, state_dict[name]) for name, tensor in model.state_dict().items())


def test_the_attribute_dict_pytorch_lightning_writes_loads(tmp_path: Path) -> None:
    """The real classes of the installed PyTorch Lightning, pickled as it pickles them."""
    from lightning_fabric.utilities.data import AttributeDict as FabricAttributeDict
    from pytorch_lightning.utilities.parsing import AttributeDict as ParsingAttributeDict

    state_dict = ConfigNet().state_dict()
    hparams = {"cfg": FabricAttributeDict(width=3), "args": ParsingAttributeDict(lr=0.3)}
    model = ConfigNet.load_from_checkpoint(_lightning_file(tmp_path / "pl.ckpt", hparams, state_dict))
    assert model.hparams.cfg.width == 3 and model.hparams.args.lr == 0.3


# ---------------------------------------------------------------------- malformed Lightning checkpoints
def _hand_made_lightning_checkpoint() -> dict[str, Any]:
    """A checkpoint in Lightning's layout of CoreNet (Adam, StepLR) after one step, in the middle of epoch 0."""
    torch.manual_seed(0)
    model = CoreNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model.net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    one = {"ready": 1, "started": 1, "processed": 1, "completed": 1}
    return {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "loops": {
            "fit_loop": {
                "epoch_progress": {"current": {"ready": 1, "started": 1, "processed": 0, "completed": 0}},
                "epoch_loop.batch_progress": {
                    "current": dict(one),
                    "total": dict(one),
                    "is_last_batch": False,
                },
                "epoch_loop.state_dict": {"_batches_that_stepped": 1},
            }
        },
        "callbacks": {},
        "hyper_parameters": {"hidden": 8, "lr": 0.05, "optim": "adam"},
        "hparams_name": "kwargs",
    }


def _fit_loop(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return checkpoint["loops"]["fit_loop"]


LIGHTNING_EDITS = [
    # (edit, the key and value the error names)
    (lambda c: c.update(epoch=float("nan")), "'epoch': float nan"),
    (lambda c: c.update(global_step=-3), "'global_step': int -3"),
    (lambda c: c.update(state_dict=[1]), "'state_dict': a list"),
    (lambda c: c.update(optimizer_states={"state": {}}), "'optimizer_states': a dict"),
    (lambda c: c["optimizer_states"][0].update(state=[1]), "'optimizer_states[0]': its 'state' is a list"),
    (
        lambda c: c["optimizer_states"][0]["state"].update({0: 5}),
        "'optimizer_states[0]': 'state[0]' is int 5 (expected a dict)",
    ),
    (
        lambda c: c["optimizer_states"][0].update(param_groups="all"),
        "'optimizer_states[0]': its 'param_groups' is a str",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(params=[[0]]),
        "'optimizer_states[0]': 'param_groups[0].params' is a list",
    ),
    (lambda c: c.update(lr_schedulers=[1]), "'lr_schedulers': a list with an item of type int"),
    (lambda c: c.update(loops=[1]), "'loops': a list"),
    (lambda c: _fit_loop(c).update(epoch_progress=[1]), "'loops.fit_loop.epoch_progress': a list"),
    (
        lambda c: _fit_loop(c)["epoch_progress"]["current"].update(ready="1"),
        "'loops.fit_loop.epoch_progress.current.ready': '1'",
    ),
    (
        lambda c: _fit_loop(c)["epoch_loop.batch_progress"]["total"].update(processed=-1),
        "'loops.fit_loop.epoch_loop.batch_progress.total.processed': -1",
    ),
    (
        lambda c: _fit_loop(c)["epoch_loop.batch_progress"].update(is_last_batch="yes"),
        "'loops.fit_loop.epoch_loop.batch_progress.is_last_batch': a str",
    ),
    (
        lambda c: _fit_loop(c)["epoch_loop.state_dict"].update(_batches_that_stepped=float("nan")),
        "'loops.fit_loop.epoch_loop.state_dict._batches_that_stepped': nan",
    ),
    (lambda c: c.update(callbacks=["ModelCheckpoint"]), "'callbacks': a list"),
    (lambda c: c.update(MixedPrecision=torch.tensor([1.0, 2.0])), "'MixedPrecision': a Tensor"),
    (lambda c: c.update(hyper_parameters="hidden=8"), "'hyper_parameters': a str"),
]


def test_the_hand_made_lightning_checkpoint_resumes(tmp_path: Path) -> None:
    """The base of the edits below is a checkpoint trainer-core resumes (so each edit is what is refused)."""
    path = tmp_path / "base.ckpt"
    torch.save(_hand_made_lightning_checkpoint(), path)
    model, trainer = _resume(path, 8, "adam", max_steps=3)
    assert trainer.global_step == 3 and model.seen[0] == (0, 1)


@pytest.mark.parametrize(
    ("edit", "match"), LIGHTNING_EDITS, ids=[case[1].split(":")[0] for case in LIGHTNING_EDITS]
)
def test_a_lightning_value_of_the_wrong_kind_names_the_file_and_key(
    tmp_path: Path, edit: Any, match: str
) -> None:
    checkpoint = _hand_made_lightning_checkpoint()
    edit(checkpoint)
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    model = CoreNet()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = Trainer(**{**QUIET, "enable_checkpointing": False, "max_steps": 3})
    expected = re.escape(str(path)) + r".*has an invalid " + re.escape(match)

    with pytest.raises(CheckpointError, match=expected):
        trainer.fit(model, train_loader(), val_loader(), ckpt_path=str(path))
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert trainer.global_step == 0 and all(opt.state_dict()["state"] == {} for opt in trainer.optimizers)
    with pytest.raises(CheckpointError, match=expected):
        from_lightning(torch.load(path, weights_only=True), None, str(path))


def test_an_sgd_state_written_by_torch_1_loads(tmp_path: Path) -> None:
    """torch before 2.0 stored SGD's ``momentum_buffer`` as ``None`` without momentum: not a wrong kind."""
    checkpoint = _hand_made_lightning_checkpoint()
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    checkpoint["optimizer_states"] = [
        {
            "state": {index: {"momentum_buffer": None} for group in groups for index in group["params"]},
            "param_groups": [
                {
                    "lr": 0.05,
                    "momentum": 0,
                    "dampening": 0,
                    "weight_decay": 0,
                    "nesterov": False,
                    "params": g["params"],
                }
                for g in groups
            ],
        }
    ]
    converted = from_lightning(checkpoint, None, str(tmp_path / "torch1.ckpt"))
    assert converted["global_step"] == 1
