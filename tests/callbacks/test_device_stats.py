"""DeviceStatsMonitor on the CPU: psutil's stats under Lightning's names, at Lightning's steps, in the CSV.

The same fit runs under Lightning with its DeviceStatsMonitor and CSVLogger: both files name the
same metrics at the same steps (the values are the machine's, so only their range is checked).
"""

from __future__ import annotations

import csv
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
from trainer_core.callbacks.device_stats_monitor import DeviceStatsMonitor
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger

STATS = ("cpu_percent", "cpu_swap_percent", "cpu_vm_percent")


def _module(base: type) -> Any:
    class Model(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def _kwargs() -> dict[str, Any]:
    return dict(
        max_epochs=2,
        log_every_n_steps=2,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(random_data(10, 4), batch_size=2), DataLoader(random_data(4, 4), batch_size=1)


def _stats(path: Path) -> dict[tuple[int, str], float]:
    found = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.startswith("DeviceStatsMonitor.") and value:
                    found[(int(row["step"]), key)] = float(value)
    return found


def test_cpu_stats_named_and_stepped_as_lightning(tmp_path: Path) -> None:
    Trainer(
        callbacks=[DeviceStatsMonitor()], logger=CSVLogger(tmp_path / "ours", name="run"), **_kwargs()
    ).fit(_module(LightningModule), *_loaders())
    ours = _stats(tmp_path / "ours" / "run" / "version_0" / "metrics.csv")

    from pytorch_lightning.callbacks import DeviceStatsMonitor as LightningDeviceStatsMonitor
    from pytorch_lightning.loggers import CSVLogger as LightningCSVLogger

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            callbacks=[LightningDeviceStatsMonitor()],
            logger=LightningCSVLogger(tmp_path / "lightning", name="run"),
            **_kwargs(),
        ).fit(_module(pl.LightningModule), *_loaders())
    theirs = _stats(tmp_path / "lightning" / "run" / "version_0" / "metrics.csv")
    assert set(ours) == set(theirs)

    hooks = (
        "on_train_batch_start",
        "on_train_batch_end",
        "on_validation_batch_start",
        "on_validation_batch_end",
    )
    assert {key for _, key in ours} == {
        f"DeviceStatsMonitor.{hook}/{stat}" for hook in hooks for stat in STATS
    }
    # Training: the batches whose step (1-based) is a multiple of log_every_n_steps, at the step before it.
    assert sorted({step for step, key in ours if "train" in key}) == [1, 3, 5, 7, 9]
    # Validation (4 batches, every 2nd logged) at the step of the training batch that ran it.
    assert sorted({step for step, key in ours if "validation" in key}) == [4, 9]
    for (_, key), value in ours.items():
        assert 0.0 <= value <= 100.0, key


def test_cpu_stats_off_logs_nothing(tmp_path: Path) -> None:
    trainer = Trainer(
        callbacks=[DeviceStatsMonitor(cpu_stats=False)], logger=CSVLogger(tmp_path, name="run"), **_kwargs()
    )
    trainer.fit(_module(LightningModule), *_loaders())
    metrics = tmp_path / "run" / "version_0" / "metrics.csv"
    assert "loss" in metrics.read_text() and _stats(metrics) == {}


def test_needs_a_logger() -> None:
    trainer = Trainer(callbacks=[DeviceStatsMonitor()], logger=False, **_kwargs())
    with pytest.raises(MisconfigurationException, match=r"Trainer\(logger=False\)"):
        trainer.fit(_module(LightningModule), *_loaders())
    with pytest.raises(MisconfigurationException, match="cpu_stats='yes'"):
        DeviceStatsMonitor(cpu_stats="yes")  # type: ignore[arg-type]
