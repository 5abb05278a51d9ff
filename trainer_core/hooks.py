"""Calling the user's hooks: the one door through which loops, checkpoint code and plugins reach them.

Lightning looks up and calls every hook of every callback on every step, overridden or not,
through several layers; that is most of its per-step overhead. Here the Trainer builds, at the
start of each run, a tuple per batch-level hook holding only the callables that actually do
something (callbacks first, then the module, as in Lightning). An event nobody listens to is an
empty tuple: one truth test.

``HookRunner.current_fx`` names the hook running now; ``self.log`` reads it to apply that hook's
logging defaults and to refuse logging from outside any hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning_utilities.core.overrides import is_overridden

from trainer_core.connectors import callback_overrides
from trainer_core.module import LightningModule

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from trainer_core.callbacks import Callback
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


class BatchHooks:
    """Per-run tuples of the callables each batch-level hook must run."""

    __slots__ = (*BATCH_HOOKS, "batch_transfer", "optimizer_step", "optimizer_zero_grad")

    def __init__(self, trainer: Trainer, module: LightningModule, callbacks: list[Callback]) -> None:
        for name in BATCH_HOOKS:
            fns: list[Hook] = [
                partial(getattr(cb, name), trainer, module)
                for cb in callbacks
                if callback_overrides(cb, name)
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


class HookRunner:
    """Calls the hooks of the Trainer's module and callbacks, and records which one is running.

    ``batch`` (the per-run :class:`BatchHooks`) and ``after_closure`` (what runs between a backward
    and the parameter update: ``on_before_optimizer_step`` and gradient clipping, or ``None``) are
    set when a run starts.
    """

    __slots__ = ("_trainer", "after_closure", "batch", "current_fx")

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.current_fx: Optional[str] = None
        self.batch: Optional[BatchHooks] = None
        self.after_closure: Optional[Callable[[Optimizer], None]] = None

    def call_module(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The module's hook ``name``; returns what it returns."""
        module = self._trainer.lightning_module
        assert module is not None
        previous, self.current_fx = self.current_fx, name
        try:
            return getattr(module, name)(*args, **kwargs)
        finally:
            self.current_fx = previous

    def call_callbacks(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Every callback's hook ``name``, in the order the callbacks were given."""
        trainer = self._trainer
        module = trainer.lightning_module
        previous, self.current_fx = self.current_fx, name
        try:
            for cb in trainer.callbacks:
                getattr(cb, name)(trainer, module, *args, **kwargs)
        finally:
            self.current_fx = previous

    def call(self, name: str, *args: Any) -> None:
        """A non-batch hook on every callback, then on the module (Lightning's order)."""
        self.call_callbacks(name, *args)
        self.call_module(name, *args)

    def run(self, name: str, fns: tuple[Hook, ...], *args: Any) -> Any:
        """Run the pre-selected callables of a batch-level hook; returns the last result."""
        self.current_fx = name
        result = None
        for fn in fns:
            result = fn(*args)
        return result

    @contextlib.contextmanager
    def running(self, name: str) -> Iterator[None]:
        """For code that calls a hook itself (a plugin calling each model part's): name it meanwhile."""
        previous, self.current_fx = self.current_fx, name
        try:
            yield
        finally:
            self.current_fx = previous
