"""``CSVLogger``: metrics to ``metrics.csv`` and hyper-parameters to ``hparams.yaml``, on any fsspec URL."""

from __future__ import annotations

import csv
import io
import os
from argparse import Namespace
from typing import Any, Optional, Union

import torch

from trainer_core import paths
from trainer_core.loggers.base import FolderLogger, as_dict, rank_zero_experiment, write_hparams_file
from trainer_core.utilities import rank_zero_only

METRICS_FILE = "metrics.csv"


class ExperimentWriter:
    """What ``CSVLogger.experiment`` is (Lightning's ``ExperimentWriter``): the rows not yet written and their files.

    A program may log through it directly (``logger.experiment.log_metrics(...)``, ``.save()``);
    the rows it takes are the logger's own, written by the same ``save``.
    """

    NAME_METRICS_FILE = METRICS_FILE

    def __init__(self, log_dir: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.log_dir = log_dir
        self.metrics_file_path = paths.join(log_dir, METRICS_FILE)
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}
        self._storage_options = storage_options or {}
        fs, folder = paths.resolve(log_dir, **self._storage_options)
        fs.makedirs(folder, exist_ok=True)
        self._target = (fs, f"{folder}/{METRICS_FILE}")

    def log_metrics(self, metrics_dict: dict[str, Any], step: Optional[int] = None) -> None:
        """Buffer one row; without ``step``, the row's number among those not yet saved (Lightning's rule)."""
        if step is None:
            step = len(self.metrics)
        row = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics_dict.items()}
        row["step"] = step
        self.metrics.append(row)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Add ``params`` to those recorded and rewrite ``hparams.yaml`` with all of them (Lightning's rule)."""
        self.hparams.update(params)
        write_hparams_file(self.log_dir, self.hparams, self._storage_options)

    def save(self) -> None:
        """Write the buffered rows to ``metrics.csv``; rows already there are kept, under the new header if it grew."""
        if not self.metrics:
            return
        fs, path = self._target
        new_keys = [k for row in self.metrics for k in row if k not in self.metrics_keys]
        # Once the header is written, the common case appends without asking the store.
        if new_keys or not self.metrics_keys:
            old_rows = _read_rows(fs, path) if fs.exists(path) else []
            for key in new_keys:
                if key not in self.metrics_keys:
                    self.metrics_keys.append(key)
            self.metrics_keys = ["step", *sorted(k for k in self.metrics_keys if k != "step")]
            _write_rows(fs, path, self.metrics_keys, old_rows + self.metrics, mode="w")
        else:
            _append_rows(fs, path, self.metrics_keys, self.metrics)
        self.metrics = []


class CSVLogger(FolderLogger):
    """Write ``<save_dir>/<name>/version_<n>/metrics.csv`` on global rank 0.

    Rows are buffered and written every ``flush_logs_every_n_steps`` logging calls and at the end
    of each epoch, so the training step never waits on the file system. ``prefix`` starts every
    metric's name, joined with ``LOGGER_JOIN_CHAR`` as in Lightning.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: Union[str, os.PathLike],
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(save_dir, name, version, storage_options)
        self._prefix = prefix
        self._flush_every = flush_logs_every_n_steps
        self._experiment: Optional[ExperimentWriter] = None
        self._calls = 0

    @property
    def metrics_file_path(self) -> str:
        return paths.join(self.log_dir, METRICS_FILE)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """The writer of this run's files, made (with the version folder) on first use."""
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir, self._storage_options)
        return self._experiment

    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace]) -> None:
        # Each call adds to what earlier calls recorded (Lightning's rule); the file holds all of it.
        self.experiment.log_hparams(as_dict(params))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if self._prefix:
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        self.experiment.log_metrics(metrics, step)
        self._calls += 1
        if self._calls % self._flush_every == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        if self._experiment is not None:  # nothing logged yet: no folder to make
            self._experiment.save()


def _read_rows(fs: Any, path: str) -> list[dict[str, Any]]:
    """The rows already in ``path``, kept when the file is rewritten with more columns."""
    try:
        with fs.open(path, "r", newline="") as f:
            return list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        from trainer_core.errors import MisconfigurationException

        # Rewriting would lose what the file holds: it is left as it is.
        raise MisconfigurationException(
            f"CSVLogger cannot add to {path}: it is not a CSV file of metrics ({type(err).__name__}: {err}). It "
            "was left as it is; move it away, or log to another version (CSVLogger(version=...))."
        ) from None


def _write_rows(fs: Any, path: str, keys: list[str], rows: list[dict[str, Any]], mode: str) -> None:
    with fs.open(path, mode, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        if mode == "w":
            writer.writeheader()
        writer.writerows(rows)


def _append_rows(fs: Any, path: str, keys: list[str], rows: list[dict[str, Any]]) -> None:
    try:
        _write_rows(fs, path, keys, rows, mode="a")
    except (NotImplementedError, ValueError, io.UnsupportedOperation):
        # Object stores cannot append: rewrite the whole file.
        _write_rows(fs, path, keys, _read_rows(fs, path) + rows, mode="w")
