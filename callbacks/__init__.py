"""Callbacks: the base class and the built-in callbacks."""

from __future__ import annotations

from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.early_stopping import EarlyStopping
from trainer_core.callbacks.gradient_accumulation import GradientAccumulationScheduler
from trainer_core.callbacks.lr_monitor import LearningRateMonitor
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.callbacks.progress import ProgressBar, TQDMProgressBar
from trainer_core.callbacks.rich_progress import RichProgressBar
from trainer_core.callbacks.timer import Timer

__all__ = [
    "Callback",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ProgressBar",
    "RichProgressBar",
    "TQDMProgressBar",
    "Timer",
]
