"""What ``configure_optimizers`` returns, made into optimizers and scheduler configs.

Lightning accepts six return forms; they all end here as a list of optimizers and a flat list of
``LRSchedulerConfig``. The flat list is what the checkpoint stores, one state dict per scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException

# ``optimizer_defaults`` lives with the per-parameter copies it builds; plugins import it from here too.
from trainer_core.optimizer_in_backward import OptimizerInBackward
from trainer_core.optimizer_in_backward import optimizer_defaults as optimizer_defaults

if TYPE_CHECKING:
    from trainer_core.plugins import TrainingTypePlugin

_SCHEDULER_KEYS = {
    "scheduler",
    "name",
    "interval",
    "frequency",
    "reduce_on_plateau",
    "monitor",
    "strict",
    "opt_idx",
}


@dataclass
class LRSchedulerConfig:
    """One scheduler and when to step it, as Lightning's ``lr_scheduler`` dict describes."""

    scheduler: Any
    name: Optional[str] = None
    interval: str = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: Optional[str] = None
    strict: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _is_scheduler(obj: Any) -> bool:
    return (
        callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer") and not isinstance(obj, Optimizer)
    )


def _is_plateau(scheduler: Any) -> bool:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    return isinstance(scheduler, ReduceLROnPlateau)


def _scheduler_config(obj: Any, monitor: Optional[str] = None) -> LRSchedulerConfig:
    if isinstance(obj, Mapping):
        if "scheduler" not in obj:
            raise MisconfigurationException(
                "configure_optimizers: an `lr_scheduler` dict must hold the scheduler under the key 'scheduler'."
            )
        unknown = set(obj) - _SCHEDULER_KEYS
        if unknown:
            raise MisconfigurationException(
                f"configure_optimizers: unknown keys {sorted(unknown)} in the `lr_scheduler` dict; "
                f"the keys are {sorted(_SCHEDULER_KEYS - {'opt_idx'})}."
            )
        interval = obj.get("interval", "epoch")
        if interval not in ("step", "epoch"):
            raise MisconfigurationException(
                f"configure_optimizers: lr_scheduler interval={interval!r}; use 'step' or 'epoch'."
            )
        frequency = obj.get("frequency", 1)
        if not isinstance(frequency, int) or frequency < 1:
            raise MisconfigurationException(
                f"configure_optimizers: lr_scheduler frequency={frequency!r}; use a positive integer."
            )
        scheduler = obj["scheduler"]
        config = LRSchedulerConfig(
            scheduler=scheduler,
            name=obj.get("name"),
            interval=interval,
            frequency=frequency,
            reduce_on_plateau=obj.get("reduce_on_plateau", _is_plateau(scheduler)),
            monitor=obj.get("monitor"),
            strict=obj.get("strict", True),
        )
    else:
        config = LRSchedulerConfig(scheduler=obj, reduce_on_plateau=_is_plateau(obj))
    if config.monitor is None:
        config.monitor = monitor
    if not _is_scheduler(config.scheduler):
        raise MisconfigurationException(
            f"configure_optimizers: {type(config.scheduler).__name__} is not a learning-rate scheduler "
            "(it needs `step()` and an `optimizer` attribute)."
        )
    if config.reduce_on_plateau and config.monitor is None:
        raise MisconfigurationException(
            "configure_optimizers: a ReduceLROnPlateau scheduler needs a metric to watch; return "
            '{"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}.'
        )
    return config


def _from_dict(obj: Mapping) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    if "optimizer" not in obj:
        raise MisconfigurationException(
            "configure_optimizers: a returned dict must hold the optimizer under the key 'optimizer'."
        )
    optimizers = [obj["optimizer"]]
    schedulers: list[LRSchedulerConfig] = []
    if obj.get("lr_scheduler") is not None:
        schedulers.append(_scheduler_config(obj["lr_scheduler"], monitor=obj.get("monitor")))
    return optimizers, schedulers


def parse_optimizers(returned: Any) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
    """Turn any return form of ``configure_optimizers`` into ``(optimizers, scheduler configs)``.

    The forms: an optimizer; a list/tuple of optimizers; ``([optimizers], [schedulers])``; a dict
    ``{"optimizer": ..., "lr_scheduler": scheduler | config}``; a list/tuple of such dicts;
    ``None`` (no optimizer: only for manual optimization).
    """
    optimizers: list[Any]
    schedulers: list[LRSchedulerConfig] = []
    if returned is None:
        return [], []
    if isinstance(returned, Optimizer):
        optimizers = [returned]
    elif isinstance(returned, Mapping):
        optimizers, schedulers = _from_dict(returned)
    elif (
        isinstance(returned, (list, tuple))
        and len(returned) == 2
        and isinstance(returned[0], (list, tuple))
        and isinstance(returned[1], (list, tuple))
    ):
        optimizers = list(returned[0])
        schedulers = [_scheduler_config(s) for s in returned[1]]
    elif isinstance(returned, (list, tuple)) and returned and all(isinstance(o, Mapping) for o in returned):
        optimizers = []
        for item in returned:
            opts, scheds = _from_dict(item)
            optimizers += opts
            schedulers += scheds
    elif isinstance(returned, (list, tuple)) and returned and all(isinstance(o, Optimizer) for o in returned):
        optimizers = list(returned)
    else:
        raise MisconfigurationException(
            f"configure_optimizers returned {_describe(returned)}, which is not a form it may return: an optimizer; a "
            "list of optimizers; ([optimizers], [schedulers]); a dict with 'optimizer' and optionally "
            "'lr_scheduler'; or a list of such dicts."
        )
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise MisconfigurationException(
                f"configure_optimizers returned {_describe(opt)} where an optimizer belongs; return a torch.optim.Optimizer."
            )
    owned = {id(opt) for opt in optimizers}
    for config in schedulers:
        if id(config.scheduler.optimizer) not in owned:
            raise MisconfigurationException(
                f"configure_optimizers: the scheduler {type(config.scheduler).__name__} drives an optimizer that "
                "configure_optimizers did not return; return that optimizer too."
            )
    return optimizers, schedulers


def _describe(obj: Any) -> str:
    if isinstance(obj, (list, tuple)):
        inner = ", ".join(type(o).__name__ for o in obj[:4])
        return f"a {type(obj).__name__} of ({inner})"
    return f"a {type(obj).__name__}"


def rebase_learning_rates(scheduler: Any) -> None:
    """After loading another part's scheduler state: base and last rates from this scheduler's own optimizer."""
    for inner in getattr(scheduler, "_schedulers", None) or ():
        rebase_learning_rates(inner)
    groups = scheduler.optimizer.param_groups
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [group.get("initial_lr", group["lr"]) for group in groups]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in groups]


def get_lr(optimizer: Any) -> float:
    """The learning rate ``optimizer`` steps with, when all its parameter groups share one.

    ``optimizer`` may be a torch optimizer, what ``self.optimizers()`` returns, or the
    ``OptimizerInBackward`` of ``Trainer(optimizer_in_backward=True)`` (``trainer.plugin.
    in_backward_optimizer``), whose per-parameter optimizers are read: they are what stepped.
    """
    if isinstance(optimizer, OptimizerInBackward):
        groups = [g for opt in optimizer.per_parameter_optimizers for g in opt.param_groups]
    elif isinstance(optimizer, (Optimizer, LightningOptimizer)):
        groups = optimizer.param_groups
    else:
        raise TypeError(
            f"get_lr: expected an optimizer, got {type(optimizer).__name__}; pass a torch optimizer, "
            "`self.optimizers()` or `trainer.plugin.in_backward_optimizer`."
        )
    lrs = sorted({float(g["lr"]) for g in groups})
    if not lrs:
        raise ValueError("get_lr: the optimizer has no parameter groups.")
    if len(lrs) > 1:
        raise ValueError(
            f"get_lr: the parameter groups step with different learning rates {lrs}; read "
            "`optimizer.param_groups[i]['lr']` for the group you mean."
        )
    return lrs[0]


class LightningOptimizer:
    """What ``self.optimizers()`` returns: the optimizer, stepped through the plugin.

    Stepping through the plugin lets precision scaling, ``on_before_optimizer_step`` and sharded
    wrappers apply under manual optimization exactly as under automatic optimization.
    """

    def __init__(self, optimizer: Optimizer, plugin: TrainingTypePlugin) -> None:
        self._optimizer = optimizer
        self._plugin = plugin
        # Under manual optimization every step counts towards ``global_step`` (Lightning's rule).
        self._on_step: Optional[Callable[[], None]] = None

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:
        return self._optimizer.state

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        result = self._plugin.optimizer_step(self._optimizer, closure, **kwargs)
        if self._on_step is not None:
            self._on_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"LightningOptimizer({self._optimizer!r})"
