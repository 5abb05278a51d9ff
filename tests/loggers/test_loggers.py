"""CSVLogger and TensorBoardLogger on real runs: the files they write, parsed back.

CSV rows are read with ``csv``; TensorBoard event files with TensorBoard's own
``EventAccumulator``, the reader behind the TensorBoard UI. Object-store paths go to a real S3
server (moto) on loopback; the 2-rank run checks that only global rank 0 writes.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import yaml
from boring import random_data
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.loggers import CSVLogger, TensorBoardLogger

pytest.importorskip("tensorboard", reason="TensorBoardLogger needs tensorboard (extra 'test')")
from launch import JOBS
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS = 6


class Regressor(LightningModule):
    def __init__(self, width: int = 4, lr: float = 0.1, note: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(width, 1)
        self.train_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.train_losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit(logger: Any, tmp_path: Path) -> Regressor:
    seed_everything(0, verbose=False)
    data = random_data(4 * STEPS, 4)
    model = Regressor()
    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
    return model


def _csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def _check_files(csv_text: str, hparams_csv: str, tb_folder: Path, model: Regressor) -> None:
    """What both loggers must hold after ``_fit``: every step's loss, the epoch's val_loss, the hparams."""
    rows = _csv_rows(csv_text)
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r["train_loss"]]
    assert train == list(enumerate(model.train_losses))
    (val_row,) = [r for r in rows if r["val_loss"]]
    assert int(val_row["step"]) == STEPS - 1 and float(val_row["epoch"]) == 0

    scalars = _scalars(tb_folder)
    assert [s for s, _ in scalars["train_loss"]] == list(range(STEPS))
    assert [v for _, v in scalars["train_loss"]] == pytest.approx(model.train_losses, rel=1e-6)
    assert scalars["val_loss"][0][1] == pytest.approx(float(val_row["val_loss"]), rel=1e-6)
    assert scalars["hp_metric"] == [(0, -1.0)]

    expected = {"width": 4, "lr": 0.1, "note": "tiny"}
    assert yaml.safe_load(hparams_csv) == expected
    assert yaml.safe_load((tb_folder / "hparams.yaml").read_text()) == expected
    # TensorBoard's HPARAMS tab reads the hparams plugin's summaries.
    accumulator = EventAccumulator(str(tb_folder))
    accumulator.Reload()
    assert "_hparams_/experiment" in accumulator.PluginTagToContent("hparams")


@pytest.mark.timeout(60)
def test_both_loggers_local_files_parse_back(tmp_path: Path) -> None:
    loggers = [CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")]
    model = _fit(loggers, tmp_path)
    csv_dir, tb_dir = tmp_path / "csv" / "version_0", tmp_path / "tb" / "version_0"
    assert loggers[0].log_dir == str(csv_dir) and loggers[1].log_dir == str(tb_dir)
    _check_files((csv_dir / "metrics.csv").read_text(), (csv_dir / "hparams.yaml").read_text(), tb_dir, model)
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 1


@pytest.mark.timeout(60)
def test_versions_names_and_default_logger(tmp_path: Path) -> None:
    assert [CSVLogger(tmp_path).version for _ in range(2)] == [0, 0]  # nothing written yet
    first = CSVLogger(tmp_path, name="exp")
    first.log_metrics({"a": 1.0}, step=0)
    first.save()
    second = TensorBoardLogger(tmp_path, name="exp")
    second.log_metrics({"a": 2.0}, step=0)
    second.finalize("success")
    named = TensorBoardLogger(tmp_path, name="exp", version="baseline", sub_dir="train")
    assert (first.version, second.version) == (0, 1)
    assert named.log_dir == str(tmp_path / "exp" / "baseline" / "train")
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["version_0", "version_1"]
    assert second.save_dir == str(tmp_path) and second.name == "exp"
    assert second.root_dir == str(tmp_path / "exp")

    # logger=True (and the default) picks TensorBoard when it is installed, under default_root_dir.
    trainer = Trainer(logger=True, default_root_dir=str(tmp_path / "root"), enable_progress_bar=False)
    assert isinstance(trainer.logger, TensorBoardLogger)
    assert trainer.log_dir == str(tmp_path / "root" / "lightning_logs" / "version_0")
    assert Trainer(logger=False).loggers == []


@pytest.mark.timeout(90)
def test_both_loggers_write_to_s3(s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    options = s3_server.storage_options
    loggers = [
        CSVLogger(s3_url, name="csv", storage_options=options),
        TensorBoardLogger(s3_url, name="tb", storage_options=options),
    ]
    model = _fit(loggers, tmp_path)
    fs = fsspec.filesystem("s3", **options)
    root = s3_url.removeprefix("s3://")
    local_tb = tmp_path / "tb_download"
    fs.get(f"{root}/tb/version_0/", str(local_tb) + "/", recursive=True)
    _check_files(
        fs.cat(f"{root}/csv/version_0/metrics.csv").decode(),
        fs.cat(f"{root}/csv/version_0/hparams.yaml").decode(),
        local_tb,
        model,
    )
    # The spool folder the events were written to locally is gone once the run is over.
    assert loggers[1]._spool is None
    # A second run on the same prefix gets the next version on the object store too.
    assert TensorBoardLogger(s3_url, name="tb", storage_options=options).version == 1


@pytest.mark.timeout(120)
def test_only_rank_zero_writes_under_two_ranks(s3_url: str, tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    proc = subprocess.run(
        [sys.executable, str(JOBS / "logger_job.py"), "--url", s3_url],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    fs = fsspec.filesystem("s3")
    root = s3_url.removeprefix("s3://")
    files = sorted(p.removeprefix(root + "/") for p in fs.find(root))
    events = [f for f in files if f.startswith("tb/version_0/events.out.tfevents.")]
    assert len(events) == 1, files
    assert sorted(set(files) - set(events)) == [
        "csv/version_0/hparams.yaml",
        "csv/version_0/metrics.csv",
        "tb/version_0/hparams.yaml",
    ]
    # 32 samples, 2 ranks, batch 4: 4 steps, each logged once, by rank 0 (rank 1 would log 100 + step).
    rows = _csv_rows(fs.cat(f"{root}/csv/version_0/metrics.csv").decode())
    assert [(int(r["step"]), float(r["rank_tag"])) for r in rows if r["rank_tag"]] == [
        (s, s) for s in range(4)
    ]
    local = tmp_path / "tb"
    fs.get(f"{root}/tb/version_0/", str(local) + "/", recursive=True)
    assert _scalars(local)["rank_tag"] == [(s, float(s)) for s in range(4)]


@pytest.mark.parametrize("content", [b"step,loss\n0,\xff\xfe\n", b"step,loss\n0," + b"x" * 200_000 + b"\n"])
def test_csv_logger_leaves_a_metrics_file_it_cannot_read_as_it_was(tmp_path: Path, content: bytes) -> None:
    """A damaged metrics.csv in the version folder is one clear error naming it, never rewritten or lost."""
    from trainer_core.errors import MisconfigurationException

    logger = CSVLogger(tmp_path, name="run", version=0)
    metrics = Path(logger.log_dir) / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_bytes(content)
    logger.log_metrics({"loss": 0.5}, step=1)
    with pytest.raises(MisconfigurationException, match=f"CSVLogger cannot add to {metrics}.*left as it is"):
        logger.save()
    assert metrics.read_bytes() == content
