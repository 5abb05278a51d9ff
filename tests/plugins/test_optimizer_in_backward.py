"""``Trainer(optimizer_in_backward=True)``: each parameter steps from its gradient hook.

What a user relies on: the same losses and weights as normal stepping (to 1e-6 over 20 steps),
schedulers driving every per-parameter optimizer, gradients never all held at once, checkpoints
in the normal format (so a run can switch modes across a resume), FSDP at 2 ranks, and a clear
refusal of what cannot work (DDP, clipping, accumulation, loss scaling, manual optimization).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from in_backward_job import LR, Net, data
from in_backward_job import main as run_job
from launch import JOBS
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, get_lr
from trainer_core.callbacks import Callback
from trainer_core.checkpoint import KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException

JOB = str(JOBS / "in_backward_job.py")
ATOL = 1e-6
N_PARAMS = 6  # three Linear layers, weight and bias each
_LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}


# ---------------------------------------------------------------------- helpers
def _single(tmp: Path, name: str, *args: str) -> dict[str, Any]:
    run_job(["--out", str(tmp / name), *args])
    return _result(tmp / name)


def _fsdp(tmp: Path, name: str, *args: str) -> dict[str, Any]:
    """Two FSDP ranks on gloo, launched the way a user runs the script; rank results averaged."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    cmd = [
        sys.executable,
        JOB,
        "--out",
        name,
        "--plugin",
        "fsdp",
        "--devices",
        "2",
        "--batch-size",
        "4",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(
            f"job {args} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    ranks = [_result(tmp / name, rank) for rank in (0, 1)]
    assert ranks[0]["lrs"] == ranks[1]["lrs"]
    # Each rank's loss is over its half of the batch: their mean is the loss on the whole batch.
    losses = {k: (ranks[0]["losses"][k] + ranks[1]["losses"][k]) / 2 for k in ranks[0]["losses"]}
    return {**ranks[0], "losses": losses}


def _result(out: Path, rank: int = 0) -> dict[str, Any]:
    result = json.loads((out / f"rank{rank}.json").read_text())
    result["weights"] = torch.load(out / "final.ckpt", weights_only=True)[KEY_STATE_DICT]
    return result


def _assert_same_run(got: dict[str, Any], expected: dict[str, Any], steps: range) -> None:
    for step in map(str, steps):
        assert got["losses"][step] == pytest.approx(expected["losses"][step], abs=ATOL), (
            f"loss at step {step}"
        )
        assert got["lrs"][step] == expected["lrs"][step], f"learning rate at step {step}"
    for name, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=ATOL, rtol=0, msg=name)


@pytest.fixture(scope="module")
def normal_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: 20 steps of normal stepping on one process, batch 8."""
    return _single(tmp_path_factory.mktemp("normal"), "normal")


# ---------------------------------------------------------------------- numerics
def test_steps_like_normal_stepping_without_holding_every_gradient(
    tmp_path: Path, normal_run: dict[str, Any]
) -> None:
    in_backward = _single(tmp_path, "in_backward", "--in-backward")
    _assert_same_run(in_backward, normal_run, range(1, 21))
    # StepLR(step_size=4, gamma=0.5) drove the per-parameter optimizers: get_lr read theirs.
    assert [in_backward["lrs"][str(s)] for s in (1, 5, 9, 20)] == [LR, LR / 2, LR / 4, LR / 16]
    # Normal stepping holds every gradient before the step; in backward, only the one being made.
    assert normal_run["most_gradients_at_once"] == N_PARAMS
    assert in_backward["most_gradients_at_once"] == 1


def test_hooks_come_off_after_fit(tmp_path: Path) -> None:
    model = Net()
    trainer = Trainer(
        max_steps=2,
        optimizer_in_backward=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, DataLoader(data(), batch_size=8))
    assert trainer.plugin.in_backward_optimizer is None
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data()[:8]
    nn.functional.mse_loss(model.net(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_per_parameter_groups_keep_their_own_hyper_parameters(tmp_path: Path) -> None:
    """Two param groups with different learning rates, a frozen layer, and a lr set by hand mid-run."""

    class Groups(Net):
        def __init__(self) -> None:
            super().__init__()
            self.net[2].requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 3:
                self.optimizers().param_groups[1]["lr"] = 0.001
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(
                [
                    {"params": self.net[0].parameters(), "lr": 0.05},
                    {"params": self.net[4].parameters(), "lr": 0.01, "momentum": 0.9},
                ],
                lr=0.1,
            )

    weights = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = Groups()
        trainer = Trainer(
            max_steps=6,
            optimizer_in_backward=in_backward,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model, DataLoader(data(), batch_size=8))
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=ATOL, rtol=0, msg=name)


def test_get_lr_reads_one_learning_rate_and_refuses_ambiguity() -> None:
    layer = nn.Linear(2, 2)
    assert get_lr(torch.optim.SGD(layer.parameters(), lr=0.3)) == 0.3
    two = torch.optim.SGD([{"params": [layer.weight], "lr": 0.1}, {"params": [layer.bias], "lr": 0.2}])
    with pytest.raises(ValueError, match=r"different learning rates \[0.1, 0.2\]"):
        get_lr(two)
    with pytest.raises(TypeError, match="expected an optimizer"):
        get_lr(layer)


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    ("first", "second"),
    [("in_backward", "in_backward"), ("normal", "in_backward"), ("in_backward", "normal")],
)
def test_resume_continues_and_switches_modes(
    tmp_path: Path, normal_run: dict[str, Any], first: str, second: str
) -> None:
    flag = {"in_backward": ["--in-backward"], "normal": []}
    _single(tmp_path, "first", *flag[first], "--max-steps", "10", "--save-at", "10")
    saved = tmp_path / "first" / "ckpts" / "epoch=0-step=10.ckpt"
    resumed = _single(tmp_path, "second", *flag[second], "--resume", str(saved))
    _assert_same_run(resumed, normal_run, range(11, 21))


def test_checkpoint_has_the_format_of_normal_stepping(tmp_path: Path) -> None:
    states = []
    for name, args in (("normal", []), ("in_backward", ["--in-backward"])):
        _single(tmp_path, name, *args, "--max-steps", "5", "--save-at", "5")
        ckpt = torch.load(tmp_path / name / "ckpts" / "epoch=0-step=5.ckpt", weights_only=True)
        states.append(ckpt[KEY_OPTIMIZER_STATES][0])
    normal, in_backward = states
    assert in_backward["param_groups"] == normal["param_groups"]
    assert (
        sorted(in_backward["state"])
        == sorted(normal["state"])
        == sorted(n for n, _ in Net().named_parameters())
    )
    for name, entry in normal["state"].items():
        assert set(in_backward["state"][name]) == set(entry)
        for key, value in entry.items():
            torch.testing.assert_close(in_backward["state"][name][key], value, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- FSDP, 2 ranks
@pytest.mark.timeout(200)
def test_fsdp_steps_the_sharded_gradients_like_one_process(
    tmp_path: Path, normal_run: dict[str, Any]
) -> None:
    fsdp = _fsdp(tmp_path, "fsdp", "--in-backward")
    _assert_same_run(fsdp, normal_run, range(1, 21))

    # Its checkpoints resume under FSDP in backward, and on one process stepping normally.
    _fsdp(tmp_path, "fsdp_first", "--in-backward", "--max-steps", "10", "--save-at", "10")
    saved = str(tmp_path / "fsdp_first" / "ckpts" / "epoch=0-step=10.ckpt")
    _assert_same_run(
        _fsdp(tmp_path, "fsdp_resumed", "--in-backward", "--resume", saved), normal_run, range(11, 21)
    )
    _assert_same_run(_single(tmp_path, "single_resumed", "--resume", saved), normal_run, range(11, 21))


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"plugins": "ddp", "devices": 2}, r"does not work with DDPPlugin: .*before DistributedDataParallel"),
        ({"plugins": "zero", "devices": 2}, r"does not work with ZeroPlugin"),
        ({"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2: accumulation keeps gradients"),
        ({"gradient_clip_val": 1.0}, r"gradient_clip_val: clipping needs the gradients of the whole model"),
        ({"precision": "16-mixed"}, r"precision='16-mixed': a loss scaler must check every gradient"),
    ],
)
def test_trainer_refuses_what_cannot_step_in_backward(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        Trainer(optimizer_in_backward=True, logger=False, **kwargs)


class _Manual(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


class _CustomStep(Net):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


class _LBFGS(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


class _GradNorms(Callback):
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("model", "callbacks", "message"),
    [
        (_Manual, [], r"_Manual uses manual optimization"),
        (_CustomStep, [], r"_CustomStep.optimizer_step runs after backward"),
        (Net, [_GradNorms()], r"the callback _GradNorms.on_before_optimizer_step runs after backward"),
        (_LBFGS, [], r"cannot step LBFGS: it re-evaluates the whole model"),
    ],
)
def test_fit_refuses_modules_that_need_the_gradients_after_backward(
    tmp_path: Path, model: type, callbacks: list, message: str
) -> None:
    module = model()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = Trainer(
        max_steps=2,
        optimizer_in_backward=True,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(MisconfigurationException, match=message):
        trainer.fit(module, DataLoader(data(), batch_size=8))
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert not any(p._post_accumulate_grad_hooks for p in module.parameters())
