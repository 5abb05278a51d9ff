"""Experiment loggers.

The base classes load with the package; each logger loads on first use
(``from trainer_core.loggers import MLFlowLogger``), so that ``import trainer_core`` and a run pay only
for the loggers the run uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_core.loggers.base import FolderLogger, Logger
from trainer_core.utilities.lazy import lazy_attributes

if TYPE_CHECKING:
    from trainer_core.loggers.csv_logger import CSVLogger
    from trainer_core.loggers.mlflow import MLFlowLogger
    from trainer_core.loggers.tensorboard import TensorBoardLogger, tensorboard_available
    from trainer_core.loggers.wandb import WandbLogger

# Public name -> the module of this package that defines it.
_LAZY = {
    "CSVLogger": "csv_logger",
    "MLFlowLogger": "mlflow",
    "TensorBoardLogger": "tensorboard",
    "WandbLogger": "wandb",
    "tensorboard_available": "tensorboard",
}

__all__ = [
    "CSVLogger",
    "FolderLogger",
    "Logger",
    "MLFlowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "tensorboard_available",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
