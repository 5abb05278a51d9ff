"""The core's questions about callbacks (which ones act on metrics, which is the progress bar...).

The loops, the hooks and the Trainer ask these about a list of callbacks the user may have changed
since construction (the tuner does); answering them here keeps the core's import-time knowledge of
the callback classes in two modules: this one and ``trainer_core.connectors``, which builds them.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_utilities.core.overrides import is_overridden

from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.early_stopping import EarlyStopping
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.callbacks.prediction_writer import BasePredictionWriter
from trainer_core.callbacks.progress import ProgressBar
from trainer_core.callbacks.timer import Timer
from trainer_core.utilities import as_list


def has_timer(callbacks: Any) -> bool:
    """Whether the user's callbacks include a ``Timer`` (which then bounds the run instead of ``max_epochs``)."""
    return any(isinstance(cb, Timer) for cb in as_list(callbacks))


def callback_overrides(callback: Callback, name: str) -> bool:
    """Whether ``callback`` does something in hook ``name`` (the base class's hooks do nothing)."""
    return is_overridden(name, callback, Callback)


def checkpoint_callbacks(callbacks: list[Callback]) -> list[ModelCheckpoint]:
    return [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]


def monitoring_callbacks(callbacks: list[Callback]) -> list[Callback]:
    """Callbacks that act on logged metrics (Lightning's rule: early stopping and checkpointing), which run
    after the module's ``on_train_epoch_end`` so that they see what it logged."""
    return [cb for cb in callbacks if isinstance(cb, (EarlyStopping, ModelCheckpoint))]


def prediction_writer_intervals(callbacks: list[Callback]) -> tuple[bool, bool]:
    """Whether any ``BasePredictionWriter`` writes per batch, and whether any writes per epoch."""
    writers = [cb for cb in callbacks if isinstance(cb, BasePredictionWriter)]
    return any(w.writes_on_batch for w in writers), any(w.writes_on_epoch for w in writers)


def progress_bar_callback(callbacks: list[Callback]) -> Optional[ProgressBar]:
    for cb in callbacks:
        if isinstance(cb, ProgressBar):
            return cb
    return None
