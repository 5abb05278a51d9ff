"""Learning rates after a resume equal those of a run that never stopped, for each kind of scheduler,
also when the resumed run splits the model into more or fewer optimizer/scheduler pairs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import quiet_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback
from trainer_core.errors import CheckpointError


def _loader() -> DataLoader:
    return random_loader(48, 8, batch_size=8)


def _warmup_cosine(opt: torch.optim.Optimizer) -> Any:
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[3])


class Scheduled(LightningModule):
    """Automatic optimization with one scheduler of the given kind."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.kind == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.3 * step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.kind == "warmup_cosine":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _warmup_cosine(opt), "interval": "step"}}
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}


class SaveAt(Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if self.step == -1 and trainer.current_epoch == 1:
            trainer.save_checkpoint(self.path)


def _trainer(**kwargs: Any) -> Trainer:
    return quiet_trainer(max_epochs=4, **kwargs)


@pytest.mark.parametrize(("kind", "save_step"), [("lambda", 8), ("warmup_cosine", 2), ("plateau", -1)])
def test_learning_rate_after_resume_matches_an_uninterrupted_run(
    tmp_path: Path, kind: str, save_step: int
) -> None:
    path = tmp_path / "stop.ckpt"
    seed_everything(0, verbose=False)
    full = Scheduled(kind)
    _trainer(callbacks=[SaveAt(path, save_step)]).fit(full, _loader())
    seed_everything(1, verbose=False)
    resumed = Scheduled(kind)
    _trainer().fit(resumed, _loader(), ckpt_path=path)
    assert len(resumed.lrs) >= 6, "several steps are checked"
    assert resumed.lrs == full.lrs[-len(resumed.lrs) :]
    if kind == "plateau":
        assert len(set(full.lrs)) > 1, "the plateau scheduler must have reduced the rate"


class Parts(LightningModule):
    """Manual optimization with the model split into ``parts`` optimizer/scheduler pairs (1 or 2)."""

    def __init__(self, parts: int, uneven: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.parts, self.uneven = parts, uneven
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []
        self.lrs: list[list[float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedulers = self.lr_schedulers()
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        self.lrs.append([opt.param_groups[0]["lr"] for opt in optimizers])
        loss = nn.functional.mse_loss(self.net(x), y)
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        for i, sched in enumerate(schedulers):
            if not (self.uneven and i == 1 and batch_idx % 2):
                sched.step()
        self.losses.append(loss.item())

    def configure_optimizers(self) -> Any:
        groups = [list(self.net[0].parameters()), list(self.net[2].parameters())]
        if self.parts == 1:
            groups = [groups[0] + groups[1]]
        optimizers = [torch.optim.AdamW(g, lr=0.01) for g in groups]
        schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda step: math.exp(-0.1 * step)) for o in optimizers
        ]
        return optimizers, schedulers


@pytest.mark.parametrize(("saved_parts", "loaded_parts"), [(1, 2), (2, 1)])
def test_scheduler_and_optimizer_state_follow_a_different_split(
    tmp_path: Path, saved_parts: int, loaded_parts: int
) -> None:
    path = tmp_path / "parts.ckpt"
    seed_everything(0, verbose=False)
    full = Parts(saved_parts)
    _trainer(callbacks=[SaveAt(path, 7 * saved_parts)]).fit(full, _loader())
    seed_everything(1, verbose=False)
    resumed = Parts(loaded_parts)
    _trainer().fit(resumed, _loader(), ckpt_path=path)
    n = len(resumed.losses)
    assert n >= 10
    # One AdamW over all parameters and one per part compute the same update.
    torch.testing.assert_close(resumed.losses, full.losses[-n:], rtol=0, atol=1e-6)
    for got, want in zip(resumed.lrs, full.lrs[-n:]):
        assert got == pytest.approx([want[0]] * loaded_parts, rel=1e-12)


def test_disagreeing_scheduler_states_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "uneven.ckpt"
    seed_everything(0, verbose=False)
    _trainer(callbacks=[SaveAt(path, 2 * 5)]).fit(Parts(2, uneven=True), _loader())
    model = Parts(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"uneven\.ckpt.*different steps"):
        _trainer().fit(model, _loader(), ckpt_path=path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
