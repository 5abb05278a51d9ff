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
import inspect
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

from trainer_core.callback_queries import callback_overrides
from trainer_core.errors import MisconfigurationException
from trainer_core.module import LightningModule, batch_transfer_hooks
from trainer_core.profilers.base import Profiler, profiled
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from trainer_core.callbacks import Callback
    from trainer_core.run_state import HookRunState

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


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a step method receives ``batch_idx``: Lightning's rule, so ``training_step(self, batch)`` works.

    It does when it names ``batch_idx``, takes ``*args``, or has a second positional parameter.
    """
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: pass everything, as before
        return True
    positional = 0
    for p in parameters:
        if p.name == "batch_idx" or p.kind is p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 2


def check_dataloader_idx(step: Callable[..., Any], name: str, loaders: int) -> None:
    """Refuse, before the first batch, a step that cannot take the loaders' ``dataloader_idx`` (or needs one)."""
    try:
        parameters = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return
    declared = parameters.get("dataloader_idx")
    varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters.values())
    if loaders > 1 and declared is None and not varargs:
        raise MisconfigurationException(
            f"{loaders} dataloaders were given but `{name}` has no `dataloader_idx` parameter: add "
            f"`dataloader_idx=0` to its signature to tell the loaders apart."
        )
    if loaders == 1 and declared is not None and declared.default is declared.empty:
        raise MisconfigurationException(
            f"One dataloader was given but `{name}` requires `dataloader_idx`: give it a default "
            "(`dataloader_idx=0`) or remove it."
        )


def declared_step(module: Any, name: str) -> Hook:
    """The step ``name`` as the module's class defines it, bound to the module.

    FSDP2's ``register_fsdp_forward_method`` replaces the instance's attribute with a wrapper of the
    bound method, whose signature drops one parameter too many: ``(batch, batch_nb)`` reads as
    ``(batch_nb)``, and the index would be dropped from a step that takes it.
    """
    declared = getattr(type(module), name, None)
    if name in vars(module) and callable(getattr(declared, "__get__", None)):
        return declared.__get__(module, type(module))
    return getattr(module, name)


def step_caller(trainer: HookRunState, name: str, call: Hook) -> Hook:
    """``call`` (the plugin's or the module's step ``name``) as the loops call it: ``(batch, batch_idx, *dataloader_idx)``.

    When the module's step does not take ``batch_idx``, the index is dropped here, once per run; the
    plugin's step passes the rest on to the module unchanged.
    """
    if takes_batch_idx(declared_step(trainer.lightning_module, name)):
        return call

    def without_batch_idx(batch: Any, batch_idx: int, *dataloader_idx: int) -> Any:
        return call(batch, *dataloader_idx)

    return without_batch_idx


def _action_name(hook: Hook) -> str:
    """Lightning's profiler name of a bound hook: ``[LightningModule]MyModule.name`` or ``[LightningDataModule]...``."""
    owner = hook.__self__  # type: ignore[attr-defined]
    kind = "LightningModule" if isinstance(owner, LightningModule) else "LightningDataModule"
    return f"[{kind}]{type(owner).__name__}.{hook.__name__}"


class BatchHooks:
    """Per-run tuples of the callables each batch-level hook must run."""

    __slots__ = (*BATCH_HOOKS, "batch_transfer", "optimizer_step", "optimizer_zero_grad")

    def __init__(self, trainer: HookRunState, module: LightningModule, callbacks: list[Callback]) -> None:
        # With a profiler on, each callable is wrapped once here under Lightning's action name.
        profiler = trainer.hook_runner.profiler
        for name in BATCH_HOOKS:
            named: list[tuple[str, Hook]] = [
                (f"[Callback]{cb.state_key}.{name}", partial(getattr(cb, name), trainer, module))
                for cb in callbacks
                if callback_overrides(cb, name)
            ]
            if is_overridden(name, module, LightningModule):
                named.append((f"[LightningModule]{type(module).__name__}.{name}", getattr(module, name)))
            fns = [fn if profiler is None else profiled(profiler, action, fn) for action, fn in named]
            setattr(self, name, tuple(fns))
        # The batch moves to the device through the user's hooks only when the module or the data
        # module changed one of them; otherwise the plugin moves it (and not at all on the CPU).
        self.batch_transfer = batch_transfer_hooks(module, trainer.datamodule)
        if profiler is not None and self.batch_transfer is not None:
            self.batch_transfer = tuple(  # type: ignore[assignment]
                profiled(profiler, _action_name(fn), fn) for fn in self.batch_transfer
            )
        self.optimizer_step = is_overridden("optimizer_step", module, LightningModule)
        self.optimizer_zero_grad = is_overridden("optimizer_zero_grad", module, LightningModule)


class HookRunner:
    """Calls the hooks of the Trainer's module and callbacks, and records which one is running.

    ``batch`` (the per-run :class:`BatchHooks`) and ``after_closure`` (what runs between a backward
    and the parameter update: ``on_before_optimizer_step`` and gradient clipping, or ``None``) are
    set when a run starts.
    """

    __slots__ = ("_trainer", "after_closure", "batch", "current_fx", "profiler")

    def __init__(self, trainer: HookRunState) -> None:
        self._trainer = trainer
        self.current_fx: Optional[str] = None
        # The run's profiler when one records (``Trainer(profiler=...)``), else ``None``: set per run.
        self.profiler: Optional[Profiler] = None
        self.batch: Optional[BatchHooks] = None
        self.after_closure: Optional[Callable[[Optimizer], None]] = None

    def call_module(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The module's hook ``name``; returns what it returns."""
        module = self._trainer.lightning_module
        assert module is not None
        previous, self.current_fx = self.current_fx, name
        try:
            if self.profiler is None:
                return getattr(module, name)(*args, **kwargs)
            with self.profiler.profile(f"[LightningModule]{type(module).__name__}.{name}"):
                return getattr(module, name)(*args, **kwargs)
        finally:
            self.current_fx = previous

    def call_callbacks(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Every callback's hook ``name``, in the order the callbacks were given."""
        trainer = self._trainer
        module = trainer.lightning_module
        previous, self.current_fx = self.current_fx, name
        try:
            profiler = self.profiler
            for cb in trainer.callbacks:
                if profiler is None:
                    getattr(cb, name)(trainer, module, *args, **kwargs)
                else:
                    with profiler.profile(f"[Callback]{cb.state_key}.{name}"):
                        getattr(cb, name)(trainer, module, *args, **kwargs)
        finally:
            self.current_fx = previous

    def call_callback(self, cb: Callback, name: str, *args: Any) -> Any:
        """One callback's hook ``name``, for a loop that picks which callbacks run (it sets ``current_fx``)."""
        trainer = self._trainer
        if self.profiler is None:
            return getattr(cb, name)(trainer, trainer.lightning_module, *args)
        with self.profiler.profile(f"[Callback]{cb.state_key}.{name}"):
            return getattr(cb, name)(trainer, trainer.lightning_module, *args)

    def call_callbacks_on_checkpoint(self, name: str, checkpoint: dict[str, Any]) -> None:
        """Every callback's ``on_save_checkpoint`` / ``on_load_checkpoint`` (``name``) with the Trainer, as Lightning passes it.

        For the checkpoint code, which never holds the Trainer; named meanwhile, not profiled.
        """
        trainer = self._trainer
        module = trainer.lightning_module
        with self.running(name):
            for cb in trainer.callbacks:
                getattr(cb, name)(trainer, module, checkpoint)

    def setup_callback(self, cb: Callback, stage: str) -> None:
        """One callback's ``setup`` outside the run's setup (``ckpt_path="last"`` needs its folder early); not profiled."""
        trainer = self._trainer
        cb.setup(trainer, trainer.lightning_module, stage)

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

    def make_after_closure(self, module: LightningModule) -> Optional[Callable[[Optimizer], None]]:
        """What runs between the backward and the parameter update, or ``None`` when nothing does.

        The ``on_before_optimizer_step`` hooks of :attr:`batch`, then gradient clipping (the module's
        ``configure_gradient_clipping`` with the Trainer's ``gradient_clip_val``); built once per run,
        and again by whoever changes the callbacks (the tuner's searches).
        """
        trainer = self._trainer
        hooks = self.batch.on_before_optimizer_step  # type: ignore[union-attr]
        clip = module.automatic_optimization and (
            bool(trainer.gradient_clip_val)
            or is_overridden("configure_gradient_clipping", module, LightningModule)
        )
        if not hooks and not clip:
            return None

        def after_closure(optimizer: Optimizer) -> None:
            if hooks:
                self.run("on_before_optimizer_step", hooks, optimizer)
            if clip:
                self.current_fx = "configure_gradient_clipping"
                module.configure_gradient_clipping(
                    optimizer,
                    gradient_clip_val=trainer.gradient_clip_val,
                    gradient_clip_algorithm=trainer.gradient_clip_algorithm,
                )

        return after_closure

    @contextlib.contextmanager
    def running(self, name: str) -> Iterator[None]:
        """For code that calls a hook itself (a plugin calling each model part's): name it meanwhile."""
        previous, self.current_fx = self.current_fx, name
        try:
            yield
        finally:
            self.current_fx = previous
