"""Experiment loggers."""

from trainer_core.loggers.base import FolderLogger, Logger
from trainer_core.loggers.csv_logger import CSVLogger
from trainer_core.loggers.tensorboard import TensorBoardLogger, tensorboard_available

__all__ = ["CSVLogger", "FolderLogger", "Logger", "TensorBoardLogger", "tensorboard_available"]
