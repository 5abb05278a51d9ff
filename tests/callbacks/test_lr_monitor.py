"""LearningRateMonitor on real runs: the names it logs and the values at each step, read back from metrics.csv."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from boring import random_loader
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import LearningRateMonitor
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger

BATCHES = 4  # per epoch


class _Module(LightningModule):
    def __init__(self, configure: Callable[[LightningModule], Any]) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self._configure = configure

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.body(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return self._configure(self)


class _ManualModule(_Module):
    """Three optimizers stepped by hand: two SGD with step schedulers, one Adam without."""

    def __init__(self) -> None:
        super().__init__(_three_optimizers)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.body(x)), y)
        self.log("train_loss", loss)
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        for sched in self.lr_schedulers():
            sched.step()


def _three_optimizers(m: LightningModule) -> Any:
    sgd0 = torch.optim.SGD(m.body.parameters(), lr=1.0)
    sgd1 = torch.optim.SGD([m.head.weight], lr=2.0)
    adam = torch.optim.Adam([m.head.bias], lr=0.5)
    scheds = [
        {"scheduler": StepLR(sgd0, step_size=1, gamma=0.5), "interval": "step"},
        {"scheduler": StepLR(sgd1, step_size=2, gamma=0.1), "interval": "step"},
    ]
    return [sgd0, sgd1, adam], scheds


def _loader() -> DataLoader:
    return random_loader(4 * BATCHES, 4, batch_size=4)


def _fit(
    tmp_path: Path, model: LightningModule, monitor: LearningRateMonitor, epochs: int = 2, **kwargs: Any
) -> dict[str, dict[int, float]]:
    """Fit, then return ``{column: {step: value}}`` for every non-empty cell of metrics.csv."""
    seed_everything(0)
    logger = CSVLogger(save_dir=tmp_path)
    kwargs.setdefault("log_every_n_steps", 1)
    trainer = Trainer(
        max_epochs=epochs,
        logger=logger,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    trainer.fit(model, _loader())
    with open(logger.metrics_file_path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and value != "":
                columns.setdefault(key, {})[int(row["step"])] = float(value)
    return columns


def _lr_columns(columns: dict[str, dict[int, float]]) -> set[str]:
    return {k for k in columns if k not in ("train_loss", "epoch")}


def _step_sched(
    m: LightningModule, name: Optional[str] = None, interval: str = "step", step_size: int = 2
) -> Any:
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    config: dict[str, Any] = {"scheduler": StepLR(opt, step_size=step_size, gamma=0.5), "interval": interval}
    if name is not None:
        config["name"] = name
    return {"optimizer": opt, "lr_scheduler": config}


def test_step_interval_logs_each_batch_at_the_training_metrics_step(tmp_path: Path) -> None:
    cols = _fit(tmp_path, _Module(_step_sched), LearningRateMonitor())
    assert _lr_columns(cols) == {"lr-SGD"}
    # Logged before the batch: the scheduler has stepped once per finished batch.
    assert cols["lr-SGD"] == {s: 0.5 ** (s // 2) for s in range(2 * BATCHES)}
    # The same steps the training loss of each batch is logged at.
    assert set(cols["train_loss"]) == set(cols["lr-SGD"])


def test_step_interval_follows_log_every_n_steps(tmp_path: Path) -> None:
    cols = _fit(tmp_path, _Module(_step_sched), LearningRateMonitor(), log_every_n_steps=3)
    assert cols["lr-SGD"] == {2: 0.5, 5: 0.25}
    assert set(cols["train_loss"]) == {2, 5}


def test_epoch_interval_logs_at_each_epoch_start(tmp_path: Path) -> None:
    def configure(m: LightningModule) -> Any:
        return _step_sched(m, interval="epoch", step_size=1)

    cols = _fit(tmp_path, _Module(configure), LearningRateMonitor(), epochs=3)
    assert cols["lr-SGD"] == {0: 1.0, BATCHES: 0.5, 2 * BATCHES: 0.25}


@pytest.mark.parametrize(
    ("logging_interval", "interval", "expected"),
    [
        # An epoch scheduler watched every step.
        ("step", "epoch", {s: 0.5 ** (s // BATCHES) for s in range(2 * BATCHES)}),
        # A step scheduler watched once per epoch.
        ("epoch", "step", {0: 1.0, BATCHES: 0.5**BATCHES}),
    ],
)
def test_logging_interval_overrides_the_scheduler_interval(
    tmp_path: Path, logging_interval: str, interval: str, expected: dict[int, float]
) -> None:
    def configure(m: LightningModule) -> Any:
        return _step_sched(m, interval=interval, step_size=1)

    cols = _fit(tmp_path, _Module(configure), LearningRateMonitor(logging_interval=logging_interval))
    assert cols["lr-SGD"] == pytest.approx(expected)


def test_named_scheduler(tmp_path: Path) -> None:
    def configure(m: LightningModule) -> Any:
        return _step_sched(m, name="my_lr")

    cols = _fit(tmp_path, _Module(configure), LearningRateMonitor(), epochs=1)
    assert _lr_columns(cols) == {"my_lr"}
    assert cols["my_lr"] == {0: 1.0, 1: 1.0, 2: 0.5, 3: 0.5}


def test_param_groups_with_momentum_and_weight_decay(tmp_path: Path) -> None:
    def configure(m: LightningModule) -> Any:
        opt = torch.optim.Adam(
            [
                {"params": m.body.parameters(), "lr": 0.1},
                {"params": m.head.parameters(), "lr": 0.01, "weight_decay": 0.5},
            ],
            betas=(0.8, 0.99),
        )
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": StepLR(opt, 1, gamma=0.5), "interval": "step"},
        }

    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    cols = _fit(tmp_path, _Module(configure), monitor, epochs=1)
    assert _lr_columns(cols) == {
        f"lr-Adam/pg{i}{suffix}" for i in (1, 2) for suffix in ("", "-momentum", "-weight_decay")
    }
    steps = range(BATCHES)
    assert cols["lr-Adam/pg1"] == pytest.approx({s: 0.1 * 0.5**s for s in steps})
    assert cols["lr-Adam/pg2"] == pytest.approx({s: 0.01 * 0.5**s for s in steps})
    assert cols["lr-Adam/pg1-momentum"] == {s: 0.8 for s in steps}
    assert cols["lr-Adam/pg2-weight_decay"] == {s: 0.5 for s in steps}
    assert cols["lr-Adam/pg1-weight_decay"] == {s: 0.0 for s in steps}
    assert monitor.lrs["lr-Adam/pg2"] == pytest.approx([0.01 * 0.5**s for s in steps])


def test_named_param_group(tmp_path: Path) -> None:
    def configure(m: LightningModule) -> Any:
        return torch.optim.SGD(
            [{"params": m.body.parameters()}, {"params": m.head.parameters(), "name": "head"}], lr=0.3
        )

    cols = _fit(tmp_path, _Module(configure), LearningRateMonitor(), epochs=1)
    # No scheduler: the optimizer is still monitored, at every step and at the epoch start.
    assert _lr_columns(cols) == {"lr-SGD/pg1", "lr-SGD/head"}
    assert cols["lr-SGD/head"] == {s: 0.3 for s in range(BATCHES)}


def test_several_optimizers_under_manual_optimization(tmp_path: Path) -> None:
    cols = _fit(tmp_path, _ManualModule(), LearningRateMonitor(), epochs=2)
    # Two SGD tell apart by index; the Adam without a scheduler is monitored too.
    assert _lr_columns(cols) == {"lr-SGD", "lr-SGD-1", "lr-Adam"}
    steps = range(2 * BATCHES)
    assert cols["lr-SGD"] == pytest.approx({s: 0.5**s for s in steps})
    assert cols["lr-SGD-1"] == pytest.approx({s: 2.0 * 0.1 ** (s // 2) for s in steps})
    assert cols["lr-Adam"] == {s: 0.5 for s in steps}


def test_no_logger_is_an_error(tmp_path: Path) -> None:
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        callbacks=[LearningRateMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(
        MisconfigurationException,
        match=re.escape("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger."),
    ):
        trainer.fit(_Module(_step_sched), _loader())


def test_bad_logging_interval() -> None:
    with pytest.raises(
        MisconfigurationException, match="logging_interval should be `step` or `epoch` or `None`"
    ):
        LearningRateMonitor(logging_interval="batch")
