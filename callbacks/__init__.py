"""Callbacks: the base class and the built-in callbacks."""

from __future__ import annotations

from typing import Any

from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.lr_monitor import LearningRateMonitor
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.callbacks.progress import TQDMProgressBar

__all__ = ["Callback", "LearningRateMonitor", "ModelCheckpoint", "TQDMProgressBar"]

# Named in DESIGN.md's public API and built by later work.
_PLANNED = {"EarlyStopping", "Timer"}


def __getattr__(name: str) -> Any:
    if name in _PLANNED:
        raise ImportError(
            f"trainer_core.callbacks.{name} is not available in this version of trainer-core yet."
        )
    raise AttributeError(f"module 'trainer_core.callbacks' has no attribute {name!r}")
