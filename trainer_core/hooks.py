"""Which hooks a run calls on the hot path, decided once per run.

Lightning looks up and calls every hook of every callback on every step, overridden or not,
through several layers; that is most of its per-step overhead. Here the Trainer builds, at the
start of each run, a tuple per hook holding only the callables that actually do something
(callbacks first, then the module, as in Lightning). An event nobody listens to is an empty
tuple: one truth test.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from lightning_utilities.core.overrides import is_overridden

from trainer_core.callbacks.base import Callback
from trainer_core.module import LightningModule

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer

# Hooks that run per batch or per optimizer step, shared by callbacks and the module.
BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)

Hook = Callable[..., Any]


class Hooks:
    """Per-run tuples of the callables each batch-level hook must run."""

    __slots__ = (*BATCH_HOOKS, "batch_transfer", "optimizer_step", "optimizer_zero_grad")

    def __init__(self, trainer: Trainer, module: LightningModule, callbacks: list[Callback]) -> None:
        for name in BATCH_HOOKS:
            fns: list[Hook] = [
                partial(getattr(cb, name), trainer, module)
                for cb in callbacks
                if is_overridden(name, cb, Callback)
            ]
            if is_overridden(name, module, LightningModule):
                fns.append(getattr(module, name))
            setattr(self, name, tuple(fns))
        # The batch moves to the device through the module's hooks only when the user changed
        # one of them; otherwise the plugin moves it (and not at all on the CPU).
        self.batch_transfer = any(
            is_overridden(name, module, LightningModule)
            for name in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
        )
        self.optimizer_step = is_overridden("optimizer_step", module, LightningModule)
        self.optimizer_zero_grad = is_overridden("optimizer_zero_grad", module, LightningModule)
