"""EarlyStopping on real runs: the epoch training stops at for each argument, errors, and resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from boring import quiet_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import EarlyStopping, ModelCheckpoint
from trainer_core.errors import MisconfigurationException

BATCHES = 4


class Scored(LightningModule):
    """Logs ``score`` from a fixed per-epoch (or per-validation) schedule after each validation."""

    def __init__(self, scores: list[float], train_metric: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.scores = scores
        self.train_metric = train_metric
        self.validations = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        if self.train_metric:
            self.log("train_score", self.scores[self.current_epoch], on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", self.scores[self.validations])

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validations += 1

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n: int = BATCHES * 2) -> DataLoader:
    return random_loader(n, 4, batch_size=2)


def _fit(
    model: Scored, callbacks: list[Any], max_epochs: int = 10, ckpt_path: Optional[str] = None, **kwargs: Any
) -> Trainer:
    kwargs = {
        "max_epochs": max_epochs,
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1,
        **kwargs,
    }
    trainer = quiet_trainer(callbacks=callbacks, **kwargs)
    trainer.fit(model, _loader(), _loader(2), ckpt_path=ckpt_path)
    return trainer


# Each case: per-epoch scores, EarlyStopping arguments, the epoch it stops at (None: never stops).
CASES = {
    "patience": ([1.0, 0.9, 0.95, 0.93, 0.92, 0.5, 0.4], {"patience": 3}, 4),
    "an improvement resets the count": ([1.0, 1.1, 1.2, 0.8, 0.9, 1.0, 1.1], {"patience": 3}, 6),
    "min_delta": ([1.0, 0.97, 0.96, 0.5, 0.4], {"patience": 2, "min_delta": 0.05}, 2),
    "mode max": ([0.1, 0.3, 0.2, 0.25, 0.9], {"patience": 2, "mode": "max"}, 3),
    "stopping_threshold": ([1.0, 0.8, 0.6, 0.4, 0.2], {"patience": 10, "stopping_threshold": 0.5}, 3),
    "divergence_threshold": ([1.0, 0.8, 5.0, 0.4], {"patience": 10, "divergence_threshold": 2.0}, 2),
    "check_finite": ([1.0, 0.8, math.nan, 0.4], {"patience": 10}, 2),
    "check_finite off": ([1.0, 0.8, math.inf, 0.6, 0.4], {"patience": 10, "check_finite": False}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stops_at_the_right_epoch(case: str) -> None:
    scores, kwargs, stop_epoch = CASES[case]
    seed_everything(0)
    early = EarlyStopping(monitor="score", **kwargs)
    trainer = _fit(Scored(scores), [early], max_epochs=len(scores))
    if stop_epoch is None:
        assert trainer.current_epoch == len(scores) and early.stopped_epoch == 0
    else:
        assert early.stopped_epoch == stop_epoch
        # The stopping epoch finishes; no batch of the next one runs.
        assert trainer.current_epoch == stop_epoch + 1
        assert trainer.global_step == (stop_epoch + 1) * BATCHES


def test_patience_counts_validation_runs_not_epochs() -> None:
    """With two validations per epoch the check runs after each one (Lightning's default)."""
    seed_everything(0)
    early = EarlyStopping(monitor="score", patience=3)
    scores = [1.0, 0.9, 0.95, 0.96, 0.97, 0.1, 0.1, 0.1]
    trainer = _fit(Scored(scores), [early], val_check_interval=0.5)
    # Validations after batches 2 and 4 of each epoch; the 5th (epoch 2, after batch 2) is the third
    # without improvement: training stops in the middle of epoch 2.
    assert early.stopped_epoch == 2
    assert trainer.global_step == 2 * BATCHES + 2


def test_check_on_train_epoch_end_uses_training_metrics() -> None:
    seed_everything(0)
    early = EarlyStopping(monitor="train_score", patience=1, check_on_train_epoch_end=True)
    trainer = _fit(Scored([3.0, 2.0, 2.5, 1.0, 0.5, 0.5], train_metric=True), [early], limit_val_batches=0)
    assert early.stopped_epoch == 2 and trainer.current_epoch == 3


def test_min_epochs_defers_the_stop() -> None:
    seed_everything(0)
    early = EarlyStopping(monitor="score", patience=1)
    trainer = _fit(Scored([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), [early], min_epochs=4)
    assert early.stopped_epoch == 3 and trainer.current_epoch == 4


def test_missing_metric() -> None:
    seed_everything(0)
    with pytest.raises(RuntimeError, match=r"monitor='val_acc'.*score"):
        _fit(Scored([1.0] * 3), [EarlyStopping(monitor="val_acc")], max_epochs=3)
    seed_everything(0)
    trainer = _fit(Scored([1.0] * 3), [EarlyStopping(monitor="val_acc", strict=False)], max_epochs=3)
    assert trainer.current_epoch == 3


def test_bad_arguments() -> None:
    with pytest.raises(MisconfigurationException, match="mode='avg'"):
        EarlyStopping(monitor="score", mode="avg")
    with pytest.raises(MisconfigurationException, match="patience=-1"):
        EarlyStopping(monitor="score", patience=-1)


def test_state_resumes_and_stops_where_an_uninterrupted_run_stops(tmp_path: Path) -> None:
    scores = [1.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.1]
    seed_everything(0)
    full = EarlyStopping(monitor="score", patience=3)
    _fit(Scored(scores), [full])
    assert full.stopped_epoch == 4

    seed_everything(0)
    first = EarlyStopping(monitor="score", patience=3)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    _fit(Scored(scores), [first, ckpt], max_epochs=3)  # epochs 0-2: best 0.5, one check without improvement
    assert first.wait_count == 1

    resumed = EarlyStopping(monitor="score", patience=3)
    model = Scored(scores)
    model.validations = 3  # the schedule continues where the first run left it
    trainer = _fit(
        model,
        [resumed, ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
        ckpt_path=str(tmp_path / "last.ckpt"),
    )
    assert float(resumed.best_score) == 0.5
    assert resumed.stopped_epoch == 4 and trainer.current_epoch == 5
