"""Experiment loggers."""

from trainer_core.loggers.base import FolderLogger, Logger
from trainer_core.loggers.csv_logger import CSVLogger
from trainer_core.loggers.mlflow import MLFlowLogger
from trainer_core.loggers.tensorboard import TensorBoardLogger, tensorboard_available
from trainer_core.loggers.wandb import WandbLogger

__all__ = [
    "CSVLogger",
    "FolderLogger",
    "Logger",
    "MLFlowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "tensorboard_available",
]
