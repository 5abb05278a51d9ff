"""``TensorBoardLogger``: event files through ``torch.utils.tensorboard`` (needs ``tensorboard``)."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from lightning_utilities.core.imports import RequirementCache

from trainer_core import paths
from trainer_core.loggers.base import Logger, next_version
from trainer_core.utilities import rank_zero_only

_TENSORBOARD = RequirementCache("tensorboard")


def tensorboard_available() -> bool:
    return bool(_TENSORBOARD)


class TensorBoardLogger(Logger):
    """Write ``<save_dir>/<name>/version_<n>/events.*`` on global rank 0."""

    def __init__(
        self,
        save_dir: Union[str, os.PathLike],
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        **writer_kwargs: Any,
    ) -> None:
        if not _TENSORBOARD:
            raise ModuleNotFoundError(
                f"TensorBoardLogger needs the `tensorboard` package ({_TENSORBOARD.message}); "
                "`pip install tensorboard`, or use CSVLogger."
            )
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._version = version
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def version(self) -> Union[int, str]:
        if self._version is None:
            root = paths.join(self._save_dir, self._name) if self._name else self._save_dir
            self._version = next_version(root)
        return self._version

    @property
    def log_dir(self) -> str:
        version = self.version
        folder = version if isinstance(version, str) else f"version_{version}"
        parts = [self._name, folder] if self._name else [folder]
        return paths.join(self._save_dir, *parts)

    @property
    def experiment(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, **self._writer_kwargs)
        return self._writer

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            if key == "epoch":
                continue
            self.experiment.add_scalar(key, value, step)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        text = "\n".join(f"{k}: {v!r}" for k, v in sorted(params.items()))
        self.experiment.add_text("hparams", text)

    @rank_zero_only
    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
