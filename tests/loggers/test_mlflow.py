"""MLFlowLogger against a real MLflow tracking server on loopback, read back through MLflow's own client.

The server (``mlflow server`` with a SQLite store and served artifacts in a temporary folder) runs
for the whole file. A tiny fit logs to it and to a CSVLogger at once: the run's parameters are the
module's hyper-parameters, its metric histories are the CSV rows step for step, its artifacts are
the checkpoint files byte for byte (Lightning's ``log_model`` rules: ``True`` logs what is kept at
the end, ``"all"`` logs each checkpoint as it is written), and the run ends FINISHED, or FAILED when
the fit raises. Two DDP ranks make exactly one run.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.loggers.csv_logger import CSVLogger
from trainer_core.loggers.mlflow import MLFlowLogger

pytest.importorskip("mlflow", reason="MLFlowLogger needs mlflow (extra 'mlflow')")
import warm_python
from boring import random_data
from launch import JOBS, job_env
from mlflow.tracking import MlflowClient

SERVER_START_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of an ``mlflow server`` started for this file, stopped after it."""
    root = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    mlflow_cli = Path(warm_python.REAL_EXECUTABLE).with_name("mlflow")
    command = [str(mlflow_cli)] if mlflow_cli.exists() else [sys.executable, "-m", "mlflow"]
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [
            *command,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        cwd=root,
        # No background job runner: one process less on a shared machine, and nothing here uses it.
        env={**job_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited: {(root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"mlflow server not up after {SERVER_START_S}s: {(root / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


class Regressor(LightningModule):
    def __init__(
        self, width: int = 4, lr: float = 0.1, optim: dict[str, Any] | None = None, fail_at: int = -1
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.hparams.fail_at:
            raise RuntimeError("failing on purpose")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit(tmp_path: Path, logger: MLFlowLogger, checkpoint: ModelCheckpoint, **hparams: Any) -> CSVLogger:
    seed_everything(0, verbose=False)
    csv_logger = CSVLogger(tmp_path / "csv", name="run")
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        log_every_n_steps=1,
        logger=[logger, csv_logger],
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    # 12 samples in batches of 4: 3 steps an epoch.
    trainer.fit(
        Regressor(**hparams),
        DataLoader(random_data(12, 4), batch_size=4),
        DataLoader(random_data(4, 4, seed=1), batch_size=4),
    )
    return csv_logger


def _csv_history(csv_logger: CSVLogger, key: str) -> list[tuple[int, float]]:
    with open(csv_logger.metrics_file_path, newline="") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for entry in client.list_artifacts(run_id, path):
        out.extend(_artifacts(client, run_id, entry.path) if entry.is_dir else [entry.path])
    return sorted(out)


@pytest.mark.timeout(300)
def test_params_metrics_and_kept_checkpoints_reach_the_server(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    logger = MLFlowLogger(
        experiment_name="fits",
        run_name="tiny",
        tracking_uri=tracking_uri,
        tags={"team": "core"},
        log_model=True,
    )
    checkpoint = ModelCheckpoint(monitor="val_loss", save_top_k=1, save_last=True)
    csv_logger = _fit(tmp_path, logger, checkpoint, optim={"name": "sgd", "momentum": 0.0})

    client = MlflowClient(tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tiny"
    assert run.data.tags["team"] == "core"
    assert client.get_experiment(run.info.experiment_id).name == "fits"
    # Hyper-parameters as parameters, nested ones flattened with "/".
    assert run.data.params == {
        "width": "4",
        "lr": "0.1",
        "optim/name": "sgd",
        "optim/momentum": "0.0",
        "fail_at": "-1",
    }
    # Every logged value at its step, the same as the CSV logger's rows of the same run.
    train = _history(client, logger.run_id, "train_loss")
    assert [s for s, _ in train] == list(range(9))
    assert train == [(s, pytest.approx(v, rel=1e-6)) for s, v in _csv_history(csv_logger, "train_loss")]
    val = _history(client, logger.run_id, "val_loss")
    assert val == [(s, pytest.approx(v, rel=1e-6)) for s, v in _csv_history(csv_logger, "val_loss")]
    assert [s for s, _ in val] == [2, 5, 8]
    # log_model=True: at the end, the checkpoints still kept (the best and last), byte for byte.
    best, last = Path(checkpoint.best_model_path), Path(checkpoint.last_model_path)
    assert _artifacts(client, logger.run_id) == sorted(
        f"{p.stem}/{name}" for p in (best, last) for name in (p.name, "aliases.txt", "metadata.yaml")
    )
    folder = tmp_path / "downloaded"
    client.download_artifacts(logger.run_id, best.stem, str(folder))
    assert (folder / best.stem / best.name).read_bytes() == best.read_bytes()
    assert (folder / best.stem / "aliases.txt").read_text() == "['latest', 'best']"
    # The default checkpoint folder: <working directory>/<experiment id>/<run id>/checkpoints (Lightning's).
    assert best.parent == tmp_path / run.info.experiment_id / logger.run_id / "checkpoints"


@pytest.mark.timeout(300)
def test_log_model_all_logs_each_checkpoint_as_written(tracking_uri: str, tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="fits", tracking_uri=tracking_uri, log_model="all")
    # One checkpoint kept on disk at a time; every epoch's was uploaded before it was replaced.
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", save_top_k=1)
    _fit(tmp_path, logger, checkpoint)
    client = MlflowClient(tracking_uri)
    logged = [p for p in _artifacts(client, logger.run_id) if p.endswith(".ckpt")]
    assert logged == ["epoch=0/epoch=0.ckpt", "epoch=1/epoch=1.ckpt", "epoch=2/epoch=2.ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=2.ckpt"]


@pytest.mark.timeout(300)
def test_a_failing_fit_ends_the_run_failed(tracking_uri: str, tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="fits", tracking_uri=tracking_uri, log_model=True)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", save_top_k=1)
    with pytest.raises(RuntimeError, match="failing on purpose"):
        _fit(tmp_path, logger, checkpoint, fail_at=4)
    client = MlflowClient(tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    # What was logged before the failure is there, and so is the checkpoint of the finished first epoch
    # (Lightning's MLFlowLogger uploads the kept checkpoints whatever the run's end).
    assert [s for s, _ in _history(client, logger.run_id, "train_loss")] == [0, 1, 2, 3]
    assert [p for p in _artifacts(client, logger.run_id) if p.endswith(".ckpt")] == ["epoch=0/epoch=0.ckpt"]


@pytest.mark.skipif(
    os.environ.get("FULL_MATRIX") != "1",
    reason="FULL_MATRIX=1 (make stress): a 2-rank run",
)
@pytest.mark.timeout(200)
def test_two_ddp_ranks_make_one_run(tracking_uri: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(JOBS / "experiment_logger_job.py"), "--mlflow", tracking_uri],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("ddp")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    # Rank 1 logs 100 + step; only rank 0's values arrive: 32 samples, 2 ranks, batch 4: 4 steps.
    assert _history(client, runs[0].info.run_id, "rank_tag") == [(s, float(s)) for s in range(4)]
    assert runs[0].info.status == "FINISHED"


def test_without_mlflow_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_utilities.core.imports import RequirementCache

    import trainer_core.loggers.mlflow as module

    monkeypatch.setattr(module, "_MLFLOW", RequirementCache("mlflow-not-installed-here"))
    with pytest.raises(ModuleNotFoundError, match=r"pip install trainer-core\[mlflow\]"):
        MLFlowLogger()


def test_importing_trainer_core_imports_neither_mlflow_nor_wandb() -> None:
    code = (
        "import sys, trainer_core, trainer_core.loggers; "
        "from trainer_core.loggers import MLFlowLogger, WandbLogger; "
        "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=job_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
