"""``CSVLogger``: metrics to ``metrics.csv`` and hyper-parameters to ``hparams.yaml``, on any fsspec URL."""

from __future__ import annotations

import csv
import io
import os
from argparse import Namespace
from typing import Any, Optional, Union

from trainer_core import paths
from trainer_core.loggers.base import FolderLogger, as_dict
from trainer_core.utilities import rank_zero_only

METRICS_FILE = "metrics.csv"


class CSVLogger(FolderLogger):
    """Write ``<save_dir>/<name>/version_<n>/metrics.csv`` on global rank 0.

    Rows are buffered and written every ``flush_logs_every_n_steps`` logging calls and at the end
    of each epoch, so the training step never waits on the file system.
    """

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
        self._rows: list[dict[str, Any]] = []
        self._target: Optional[tuple[Any, str]] = None
        self._keys: list[str] = []
        self._calls = 0
        self._hparams: dict[str, Any] = {}

    @property
    def metrics_file_path(self) -> str:
        return paths.join(self.log_dir, METRICS_FILE)

    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace]) -> None:
        # Each call adds to what earlier calls recorded (Lightning's rule); the file holds all of it.
        self._hparams.update(as_dict(params))
        self._write_hparams_file(self._hparams)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        row = {f"{self._prefix}{k}" if self._prefix else k: v for k, v in metrics.items()}
        row["step"] = step
        self._rows.append(row)
        self._calls += 1
        if self._calls % self._flush_every == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        if not self._rows:
            return
        if self._target is None:
            fs, folder = paths.resolve(self.log_dir, **self._storage_options)
            fs.makedirs(folder, exist_ok=True)
            self._target = (fs, f"{folder}/{METRICS_FILE}")
        fs, path = self._target
        new_keys = [k for row in self._rows for k in row if k not in self._keys]
        # Once this logger has written the header, the common case appends without asking the store.
        if new_keys or not self._keys:
            old_rows = _read_rows(fs, path) if fs.exists(path) else []
            for key in new_keys:
                if key not in self._keys:
                    self._keys.append(key)
            self._keys = ["step", *sorted(k for k in self._keys if k != "step")]
            _write_rows(fs, path, self._keys, old_rows + self._rows, mode="w")
        else:
            _append_rows(fs, path, self._keys, self._rows)
        self._rows = []


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
