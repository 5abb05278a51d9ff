"""The core's questions about callbacks (which ones act on metrics, which is the progress bar...).

The loops, the hooks and the Trainer ask these about a list of callbacks the user may have changed
since construction (the tuner does); answering them here keeps the core's knowledge of the callback
classes in two modules: this one and ``trainer_core.connectors``, which builds them.

A question about a built-in class never imports it: while its module is not loaded, no callback can be
an instance of it (a subclass imports the module to subclass it), so ``import trainer_core`` and a run
without, say, early stopping never load ``early_stopping``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import as_list
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
    from trainer_core.callbacks.progress import ProgressBar


def _loaded(*classes: str) -> tuple[type, ...]:
    """Those of ``classes`` (``"module.Class"`` in ``trainer_core.callbacks``) whose module is loaded."""
    found = []
    for path in classes:
        module, name = path.rsplit(".", 1)
        loaded = sys.modules.get(f"trainer_core.callbacks.{module}")
        if loaded is not None:
            found.append(getattr(loaded, name))
    return tuple(found)


def has_timer(callbacks: Any) -> bool:
    """Whether the user's callbacks include a ``Timer`` (which then bounds the run instead of ``max_epochs``)."""
    timer = _loaded("timer.Timer")
    return any(isinstance(cb, timer) for cb in as_list(callbacks))


def callback_overrides(callback: Callback, name: str) -> bool:
    """Whether ``callback`` does something in hook ``name`` (the base class's hooks do nothing)."""
    return is_overridden(name, callback, Callback)


def is_stateful(callback: Callback) -> bool:
    """Whether ``callback`` keeps state in checkpoints (it overrides ``state_dict`` or ``load_state_dict``)."""
    return is_overridden("state_dict", callback, Callback) or is_overridden(
        "load_state_dict", callback, Callback
    )


def check_state_keys(callbacks: list[Callback]) -> None:
    """Refuse two stateful callbacks with one ``state_key`` (Lightning's rule, checked before a run starts).

    Their states would be saved under one key, and on resume both would load one instance's state.
    """
    seen: dict[str, Callback] = {}
    for callback in filter(is_stateful, callbacks):
        key = callback.state_key
        if key in seen:
            name = type(callback).__name__
            other = type(seen[key]).__name__
            instances = f"two {name} callbacks" if other == name else f"{other} and {name}"
            raise MisconfigurationException(
                f"Trainer(callbacks=...): {instances} keep state under one state_key {key!r}, so on resume "
                f"both would get one instance's state. Give each instance its own key: override `state_key` "
                f"in {name} to return `self.generate_state_key(...)` of the settings that differ between "
                "the instances, or pass only one instance."
            )
        seen[key] = callback


def checkpoint_callbacks(callbacks: list[Callback]) -> list[ModelCheckpoint]:
    checkpoint = _loaded("model_checkpoint.ModelCheckpoint")
    return [cb for cb in callbacks if isinstance(cb, checkpoint)]


def monitoring_callbacks(callbacks: list[Callback]) -> list[Callback]:
    """Callbacks that act on logged metrics (Lightning's rule: early stopping and checkpointing), which run
    after the module's ``on_train_epoch_end`` so that they see what it logged."""
    monitoring = _loaded("early_stopping.EarlyStopping", "model_checkpoint.ModelCheckpoint")
    return [cb for cb in callbacks if isinstance(cb, monitoring)]


def prediction_writer_intervals(callbacks: list[Callback]) -> tuple[bool, bool]:
    """Whether any ``BasePredictionWriter`` writes per batch, and whether any writes per epoch."""
    writer = _loaded("prediction_writer.BasePredictionWriter")
    writers = [cb for cb in callbacks if isinstance(cb, writer)]
    return any(w.writes_on_batch for w in writers), any(w.writes_on_epoch for w in writers)


def has_model_summary(callbacks: list[Callback]) -> bool:
    summary = _loaded("model_summary.ModelSummary")
    return any(isinstance(cb, summary) for cb in callbacks)


def progress_bar_callback(callbacks: list[Callback]) -> Optional[ProgressBar]:
    bar = _loaded("progress.ProgressBar")
    for cb in callbacks:
        if isinstance(cb, bar):
            return cb
    return None
