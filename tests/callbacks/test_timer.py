"""Timer on real runs: it stops training once its budget is spent, the checkpoint holds the state
reached, and a resumed run only gets the time that was left."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import quiet_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint, Timer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.io import TorchCheckpointIO

BATCHES = 10
STEP_SECONDS = 0.02


class Slow(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    return random_loader(BATCHES, 4)


def _trainer(callbacks: list[Any], **kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = dict(
        callbacks=callbacks,
        max_epochs=100,
        enable_checkpointing=True,  # most tests here resume from the checkpoint the Timer's stop left
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )
    return quiet_trainer(**{**defaults, **kwargs})


@pytest.mark.timeout(60)
def test_stops_mid_epoch_checkpoints_and_a_resume_gets_only_what_is_left(tmp_path: Path) -> None:
    seed_everything(0)
    timer = Timer(duration=timedelta(seconds=0.3), interval="step")
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = _trainer([timer, ckpt])
    trainer.fit(Slow(), _loader(), _loader())
    # A step takes at least 0.02 s, so at most 16 steps fit before the first check past 0.3 s.
    assert 1 <= trainer.global_step <= 16
    assert timer.time_elapsed("train") >= 0.3
    assert timer.time_remaining() <= 0
    assert timer.start_time("train") is not None and timer.end_time("train") is not None
    assert timer.time_elapsed("validate") > 0
    # The stop let the epoch end properly: its validation ran and ModelCheckpoint saved the state reached.
    saved = TorchCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))
    assert saved["global_step"] == trainer.global_step
    assert saved["callbacks"][timer.state_key]["time_elapsed"]["train"] >= 0.3

    # Resumed with the same budget: it is spent, so not one more step runs.
    resumed_timer = Timer(duration=timedelta(seconds=0.3))
    resumed = _trainer([resumed_timer, ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    resumed.fit(Slow(), _loader(), _loader(), ckpt_path="last")
    assert resumed.global_step == trainer.global_step
    assert resumed_timer.time_elapsed("train") >= 0.3

    # With a larger budget it continues for roughly the difference.
    more = Timer(duration={"seconds": 1.0})
    longer = _trainer([more, ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    longer.fit(Slow(), _loader(), _loader(), ckpt_path="last")
    assert trainer.global_step < longer.global_step


@pytest.mark.timeout(60)
def test_interval_epoch_stops_at_an_epoch_boundary() -> None:
    seed_everything(0)
    timer = Timer(duration=timedelta(seconds=0.1), interval="epoch")
    trainer = _trainer([timer], enable_checkpointing=False)
    trainer.fit(Slow(), _loader())
    assert trainer.global_step == BATCHES  # 0.2 s per epoch: the first epoch's end is past the budget
    assert trainer.current_epoch == 1


def test_duration_formats_and_errors() -> None:
    assert Timer("01:02:03:04")._duration == timedelta(days=1, hours=2, minutes=3, seconds=4).total_seconds()
    assert Timer({"hours": 2})._duration == 7200
    assert Timer().time_remaining() is None
    with pytest.raises(MisconfigurationException, match="DD:HH:MM:SS"):
        Timer("12 hours")
    with pytest.raises(MisconfigurationException, match="interval='batch'"):
        Timer("00:00:00:01", interval="batch")
    with pytest.raises(MisconfigurationException, match=r"fortnights.*days, hours"):
        Timer({"fortnights": 1})
