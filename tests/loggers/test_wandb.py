"""WandbLogger offline: the run wandb writes to disk, read back record by record.

An offline run is one ``run-<id>.wandb`` file under ``<save_dir>/wandb/offline-run-*``: wandb's
record log (32 KiB blocks of length-prefixed chunks, each record a ``wandb_internal_pb2.Record``
protobuf), which ``wandb sync`` uploads later. The tests parse it with wandb's own protobuf
classes: the run's project, name and id, its config (the module's hyper-parameters) and its
history rows (each logged value at its ``trainer/global_step``, equal to the CSV logger's rows of
the same run). Two DDP ranks write exactly one run, with rank 0's values only.
"""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers.csv_logger import CSVLogger
from trainer_core.loggers.wandb import WandbLogger

pytest.importorskip("wandb", reason="WandbLogger needs wandb (extra 'wandb')")
import wandb
from boring import random_data
from launch import JOBS, job_env
from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7  # b":W&B", a 2-byte magic, a version byte
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order (the chunking of LevelDB's log format, which wandb uses)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos = [], b"", HEADER
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == FULL:
            payload = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        elif kind == LAST:
            payload = pending + chunk
        else:
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def offline_runs(save_dir: Path) -> list[Path]:
    return sorted(save_dir.glob("wandb/offline-run-*/run-*.wandb"))


def finished_records(path: Path, timeout: float = 60.0) -> list[Any]:
    """The records of a run once its ``exit`` record is written (wandb's writer process flushes after ``finish``)."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def history(records: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def config(records: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = (
            record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        )
        out.update({item.key: json.loads(item.value_json) for item in updates})
    out.pop("_wandb", None)
    return out


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """wandb offline and quiet, its settings and caches in this test's folder, no run left open after it."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    yield
    wandb.finish()


class Regressor(LightningModule):
    def __init__(self, width: int = 4, lr: float = 0.1, activation: Any = torch.tanh) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _csv_rows(csv_logger: CSVLogger, key: str) -> list[tuple[int, float]]:
    with open(csv_logger.metrics_file_path, newline="") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


@pytest.mark.timeout(180)
def test_offline_run_holds_config_and_history(tmp_path: Path) -> None:
    seed_everything(0, verbose=False)
    logger = WandbLogger(name="tiny", save_dir=tmp_path / "runs", offline=True, project="proj", prefix="fit")
    csv_logger = CSVLogger(tmp_path / "csv", name="run")
    trainer = Trainer(
        max_epochs=2,
        log_every_n_steps=1,
        logger=[logger, csv_logger],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    # 12 samples in batches of 4: 3 steps an epoch.
    trainer.fit(
        Regressor(),
        DataLoader(random_data(12, 4), batch_size=4),
        DataLoader(random_data(4, 4, seed=1), batch_size=4),
    )
    run_id = logger.version
    # ModelCheckpoint's default folder is <save_dir>/<project>/<run id>/checkpoints, as in Lightning.
    checkpoint = Path(trainer.checkpoint_callback.best_model_path)
    assert checkpoint.parent == tmp_path / "runs" / "proj" / run_id / "checkpoints"
    logger.experiment.finish()

    (path,) = offline_runs(tmp_path / "runs")
    assert path.name == f"run-{run_id}.wandb"
    records = finished_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.run_id) == ("proj", "tiny", run_id)
    # Hyper-parameters in the config; a callable by its name.
    assert config(records) == {"width": 4, "lr": 0.1, "activation": "tanh"}
    # Each value at its trainer step, as the CSV logger has it; the prefix joined with "-".
    rows = history(records)
    train = [(r["trainer/global_step"], r["fit-train_loss"]) for r in rows if "fit-train_loss" in r]
    assert train == [(s, pytest.approx(v, rel=1e-6)) for s, v in _csv_rows(csv_logger, "train_loss")]
    assert [s for s, _ in train] == list(range(6))
    val = [(r["trainer/global_step"], r["fit-val_loss"]) for r in rows if "fit-val_loss" in r]
    assert val == [(s, pytest.approx(v, rel=1e-6)) for s, v in _csv_rows(csv_logger, "val_loss")]
    # Every metric is plotted against the trainer's step.
    metrics = {
        r.metric.glob_name or r.metric.name: r.metric
        for r in records
        if r.WhichOneof("record_type") == "metric"
    }
    assert metrics["*"].step_metric == "trainer/global_step"


def test_offline_with_log_model_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"offline=True, log_model=True.*cannot upload"):
        WandbLogger(offline=True, log_model=True)


def test_without_wandb_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_utilities.core.imports import RequirementCache

    import trainer_core.loggers.wandb as module

    monkeypatch.setattr(module, "_WANDB", RequirementCache("wandb-not-installed-here"))
    with pytest.raises(ModuleNotFoundError, match=r"pip install trainer-core\[wandb\]"):
        WandbLogger()


@pytest.mark.skipif(
    os.environ.get("FULL_MATRIX") != "1",
    reason="FULL_MATRIX=1 (make stress): a 2-rank run",
)
@pytest.mark.timeout(200)
def test_two_ddp_ranks_write_one_run(tmp_path: Path) -> None:
    env = {k: v for k, v in job_env().items() if not k.startswith("WANDB_")}
    env.update(WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb_home"))
    proc = subprocess.run(
        [sys.executable, str(JOBS / "experiment_logger_job.py"), "--wandb", str(tmp_path / "runs")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    (path,) = offline_runs(tmp_path / "runs")
    records = finished_records(path)
    # Rank 1 would log 100 + step; 32 samples, 2 ranks, batch 4: 4 steps, each logged by rank 0 alone.
    rows = history(records)
    assert [(r["trainer/global_step"], r["rank_tag"]) for r in rows if "rank_tag" in r] == [
        (s, float(s)) for s in range(4)
    ]
    assert config(records) == {"width": 4}
