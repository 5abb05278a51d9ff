"""ThroughputMonitor on a controlled clock: ``time.perf_counter`` moves only when the module's steps move it
(0.25 s a training batch, 1 s a validation batch), so every logged rate is an exact number.

The same module and callback settings run under Lightning (its own ThroughputMonitor and CSVLogger):
the two ``metrics.csv`` files hold the same throughput values at the same steps.
"""

from __future__ import annotations

import csv
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from boring import random_data
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks.throughput_monitor import Throughput, ThroughputMonitor
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger

TRAIN_SECONDS = 0.25
VAL_SECONDS = 1.0
BATCH = 2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def _module(base: type, clock: Clock) -> Any:
    class Timed(base):  # type: ignore[misc, valid-type]
        flops_per_batch = 100

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            clock.now += TRAIN_SECONDS
            return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            clock.now += VAL_SECONDS

        def test_step(self, batch: Any, batch_idx: int) -> None:
            clock.now += VAL_SECONDS

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Timed()


def _monitor(cls: type) -> Any:
    return cls(
        batch_size_fn=lambda batch: batch[0].size(0),
        length_fn=lambda batch: 3 * batch[0].size(0),
        window_size=3,
    )


def _throughput_rows(path: Path) -> list[tuple[int, str, float]]:
    """``(step, name, value)`` of every throughput value in a ``metrics.csv``, in the order logged."""
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.split("/")[0] in ("train", "validate", "test") and value not in ("", None):
                    rows.append((int(row["step"]), key, float(value)))
    return rows


def _fit_kwargs() -> dict[str, Any]:
    return dict(
        max_epochs=2,
        log_every_n_steps=2,
        num_sanity_val_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(random_data(8, 4), batch_size=BATCH), DataLoader(
        random_data(4, 4, seed=1), batch_size=BATCH
    )


def test_fit_logs_exact_rates_and_matches_lightning(tmp_path: Path, clock: Clock) -> None:
    trainer = Trainer(
        callbacks=[_monitor(ThroughputMonitor)],
        logger=CSVLogger(tmp_path / "ours", name="run"),
        **_fit_kwargs(),
    )
    trainer.fit(_module(LightningModule, clock), *_loaders())
    logged = _throughput_rows(tmp_path / "ours" / "run" / "version_0" / "metrics.csv")

    from pytorch_lightning.callbacks import ThroughputMonitor as LightningThroughputMonitor
    from pytorch_lightning.loggers import CSVLogger as LightningCSVLogger

    lightning = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[_monitor(LightningThroughputMonitor)],
        logger=LightningCSVLogger(tmp_path / "lightning", name="run"),
        **_fit_kwargs(),
    )
    with warnings.catch_warnings():  # Lightning's own advice (num_workers, ...)
        warnings.simplefilter("ignore")
        lightning.fit(_module(pl.LightningModule, clock), *_loaders())
    theirs = _throughput_rows(tmp_path / "lightning" / "run" / "version_0" / "metrics.csv")
    assert sorted(logged) == sorted(theirs)
    ours = {(step, key): value for step, key, value in logged if not key.startswith("validate/")}
    validations = [(step, key, value) for step, key, value in logged if key.startswith("validate/")]

    # Training logs at steps 1, 3, 5, 7 (every 2nd optimizer step); the window of 3 batches spans 2 batches' time.
    assert sorted({step for step, key in ours if key.startswith("train/")}) == [1, 3, 5, 7]
    assert ours[(1, "train/time")] == 2 * TRAIN_SECONDS and ours[(1, "train/batches")] == 2
    assert ours[(3, "train/device/batches_per_sec")] == 1 / TRAIN_SECONDS
    assert ours[(3, "train/device/samples_per_sec")] == BATCH / TRAIN_SECONDS
    assert ours[(3, "train/device/items_per_sec")] == 3 * BATCH / TRAIN_SECONDS
    assert ours[(3, "train/device/flops_per_sec")] == 100 / TRAIN_SECONDS
    # Epoch 1: the two validation seconds of epoch 0 (and the sanity check) are not training time.
    assert ours[(5, "train/time")] == 6 * TRAIN_SECONDS and ours[(5, "train/samples")] == 6 * BATCH
    assert ours[(7, "train/device/batches_per_sec")] == 1 / TRAIN_SECONDS
    # Validation: restarted each run (after epochs 0 and 1), logged at its 2nd batch; the sanity check
    # is not counted. The window (3) never fills in 2 batches: no rates.
    per_run = [
        ("validate/batches", 2.0),
        ("validate/lengths", 12.0),
        ("validate/samples", 4.0),
        ("validate/time", 2.0),
    ]
    assert sorted(validations) == sorted([(2, key, value) for key, value in per_run] * 2)


def test_test_stage_counts_across_calls(tmp_path: Path, clock: Clock) -> None:
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    trainer = Trainer(
        callbacks=[monitor],
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        **{
            k: v
            for k, v in _fit_kwargs().items()
            if k not in ("max_epochs", "log_every_n_steps", "num_sanity_val_steps")
        },
    )
    module = _module(LightningModule, clock)
    loader = DataLoader(random_data(6, 4), batch_size=BATCH)
    trainer.test(module, loader, verbose=False)
    trainer.test(module, loader, verbose=False)
    rows = {
        (step, key): value
        for step, key, value in _throughput_rows(tmp_path / "run" / "version_0" / "metrics.csv")
    }
    # Outside fit the counts go on across calls (Lightning's): 6 batches, steps 1..6; each call's clock
    # and window start again (no rate at the second call's first batch).
    assert [rows[(step, "test/batches")] for step in range(1, 7)] == [1, 2, 3, 4, 5, 6]
    assert [rows[(step, "test/time")] for step in range(1, 7)] == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    assert rows[(6, "test/samples")] == 6 * BATCH
    assert (
        rows[(2, "test/device/samples_per_sec")]
        == rows[(6, "test/device/samples_per_sec")]
        == BATCH / VAL_SECONDS
    )
    assert (4, "test/device/samples_per_sec") not in rows
    assert not any(key.startswith("train/") for _, key in rows)


def test_throughput_counter_rules() -> None:
    counter = Throughput(world_size=2, window_size=2, available_flops=1000)
    counter.update(time=1.0, batches=1, samples=4, lengths=8, flops=50)
    assert counter.compute() == {"time": 1.0, "batches": 1, "samples": 4, "lengths": 8}
    counter.update(time=3.0, batches=2, samples=8, lengths=16, flops=50)
    metrics = counter.compute()
    assert metrics["device/batches_per_sec"] == 0.5 and metrics["batches_per_sec"] == 1.0
    assert metrics["device/samples_per_sec"] == 2.0 and metrics["samples_per_sec"] == 4.0
    assert metrics["device/items_per_sec"] == 4.0 and metrics["items_per_sec"] == 8.0
    assert metrics["flops_per_sec"] == 50.0 and metrics["device/flops_per_sec"] == 25.0
    assert metrics["device/mfu"] == 0.025
    with pytest.raises(ValueError, match="expected the value to increase"):
        counter.update(time=3.0, batches=3, samples=12)
    with pytest.raises(ValueError, match=r"samples \(1\) >= batches \(2\)"):
        Throughput().update(time=1.0, batches=2, samples=1)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"window_size=1"):
        ThroughputMonitor(batch_size_fn=len, window_size=1)
    with pytest.raises(MisconfigurationException, match=r"ThroughputMonitor\(windows=\.\.\.\)"):
        ThroughputMonitor(batch_size_fn=len, windows=3)
