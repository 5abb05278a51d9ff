"""What ``self.log`` records, and how it becomes step and epoch metrics.

``self.log`` runs on the training step, so it does the least it can: it stores the (detached)
value for the step and, when the metric is reduced over the epoch, adds it to a running
aggregate. Nothing is converted to a Python number, synchronised or copied into dicts until a
logger, the progress bar or a callback actually reads the metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import Tensor

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import extract_batch_size

if TYPE_CHECKING:
    from trainer_core.plugins import TrainingTypePlugin

# Hooks in which ``self.log`` defaults to a per-step value (Lightning's defaults); everywhere
# else a value is reduced over the epoch.
STEP_HOOKS = frozenset(
    {
        "training_step",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "optimizer_step",
        "optimizer_zero_grad",
        "backward",
        "configure_gradient_clipping",
        "lr_scheduler_step",
    }
)
NO_LOG_HOOKS = frozenset(
    {"predict_step", "on_predict_batch_start", "on_predict_batch_end", "on_predict_epoch_end"}
)

_REDUCE_FX: dict[Any, str] = {
    "mean": "mean",
    "avg": "mean",
    "sum": "sum",
    "max": "max",
    "min": "min",
    torch.mean: "mean",
    torch.sum: "sum",
    torch.max: "max",
    torch.min: "min",
}


class LoggedMetric:
    """One named metric: its latest step value and its running epoch aggregate."""

    __slots__ = (
        "batch_size_given",
        "count",
        "epoch_value",
        "fx",
        "logger",
        "name",
        "on_epoch",
        "on_step",
        "prog_bar",
        "rank_zero_only",
        "reduce_fx",
        "step_value",
        "sync_dist",
        "total",
    )

    def __init__(
        self,
        fx: str,
        name: str,
        prog_bar: bool,
        logger: bool,
        on_step: bool,
        on_epoch: bool,
        reduce_fx: str,
        sync_dist: bool,
        rank_zero_only: bool,
    ) -> None:
        self.fx = fx
        self.name = name
        self.prog_bar = prog_bar
        self.logger = logger
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.reduce_fx = reduce_fx
        self.sync_dist = sync_dist
        self.rank_zero_only = rank_zero_only
        self.step_value: Any = None
        self.total: Any = None
        self.count = 0
        self.epoch_value: Any = None
        self.batch_size_given = False

    @property
    def forked(self) -> bool:
        return self.on_step and self.on_epoch

    def accumulate(self, value: Any, batch_size: int) -> None:
        fx = self.reduce_fx
        if fx == "mean":
            weighted = value * batch_size
            self.total = weighted if self.total is None else self.total + weighted
            self.count += batch_size
        elif fx == "sum":
            self.total = value if self.total is None else self.total + value
            self.count += 1
        elif fx == "max":
            self.total = value if self.total is None else _maximum(self.total, value)
            self.count += 1
        else:
            self.total = value if self.total is None else _minimum(self.total, value)
            self.count += 1

    def compute_epoch(self, plugin: Optional[TrainingTypePlugin]) -> Any:
        if self.total is None:
            return self.epoch_value
        total, count = self.total, self.count
        if self.sync_dist and plugin is not None and plugin.world_size > 1:
            total = plugin.reduce(_as_tensor(total), reduce_op=_SYNC_OP[self.reduce_fx])
            if self.reduce_fx == "mean":
                count = plugin.reduce(torch.tensor(float(count), device=total.device), reduce_op="sum")
        value = total / count if self.reduce_fx == "mean" else total
        self.epoch_value = value
        return value


_SYNC_OP = {"mean": "sum", "sum": "sum", "max": "max", "min": "min"}


def _as_tensor(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else torch.tensor(float(value))


def _maximum(a: Any, b: Any) -> Any:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.maximum(_as_tensor(a), _as_tensor(b))
    return max(a, b)


def _minimum(a: Any, b: Any) -> Any:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.minimum(_as_tensor(a), _as_tensor(b))
    return min(a, b)


class ResultCollection:
    """The metrics logged during one stage (training, or one evaluation run)."""

    def __init__(self, training: bool) -> None:
        self.training = training
        self.metrics: dict[str, LoggedMetric] = {}
        self.batch: Any = None
        self._batch_size: Optional[int] = None
        self.plugin: Optional[TrainingTypePlugin] = None
        self.step_dirty = False
        # Set by the evaluation loop when it runs several dataloaders (Lightning's naming).
        self.name_suffix = ""

    def new_batch(self, batch: Any) -> None:
        self.batch = batch
        self._batch_size = None

    def _current_batch_size(self) -> int:
        if self._batch_size is None:
            self._batch_size = extract_batch_size(self.batch) if self.batch is not None else 1
        return self._batch_size

    def log(
        self,
        fx: str,
        name: str,
        value: Any,
        prog_bar: bool,
        logger: bool,
        on_step: Optional[bool],
        on_epoch: Optional[bool],
        reduce_fx: Union[str, Callable],
        enable_graph: bool,
        sync_dist: bool,
        batch_size: Optional[int],
        rank_zero_only: bool,
    ) -> None:
        if self.name_suffix:
            name = name + self.name_suffix
        metric = self.metrics.get(name)
        if metric is None or metric.fx != fx:
            metric = self._register(
                fx, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, rank_zero_only
            )
        if isinstance(value, Tensor):
            if not enable_graph and value.requires_grad:
                value = value.detach()
            if value.numel() != 1:
                raise MisconfigurationException(
                    f"self.log({name!r}, ...) in `{fx}` got a tensor of shape {tuple(value.shape)}; log a scalar."
                )
        if metric.on_step:
            if metric.sync_dist and self.plugin is not None and self.plugin.world_size > 1:
                value = self.plugin.reduce(_as_tensor(value), reduce_op=metric.reduce_fx)
            metric.step_value = value
            self.step_dirty = True
        if metric.on_epoch:
            metric.accumulate(value, batch_size if batch_size is not None else self._current_batch_size())

    def _register(
        self,
        fx: str,
        name: str,
        value: Any,
        prog_bar: bool,
        logger: bool,
        on_step: Optional[bool],
        on_epoch: Optional[bool],
        reduce_fx: Union[str, Callable],
        sync_dist: bool,
        rank_zero_only: bool,
    ) -> LoggedMetric:
        if fx in NO_LOG_HOOKS:
            raise MisconfigurationException(
                f"self.log({name!r}, ...) is not supported in `{fx}`: prediction logs nothing."
            )
        if not isinstance(value, (Tensor, int, float)) or isinstance(value, bool):
            raise MisconfigurationException(
                f"self.log({name!r}, value) in `{fx}` got a {type(value).__name__}; log a number or a scalar tensor."
            )
        existing = self.metrics.get(name)
        if existing is not None and existing.fx != fx:
            raise MisconfigurationException(
                f"self.log({name!r}, ...) is called from both `{existing.fx}` and `{fx}`; give each its own name."
            )
        step_default = fx in STEP_HOOKS
        on_step = step_default if on_step is None else on_step
        on_epoch = (not step_default) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise MisconfigurationException(
                f"self.log({name!r}, on_step=False, on_epoch=False) logs nothing; set one of them."
            )
        if reduce_fx not in _REDUCE_FX:
            raise MisconfigurationException(
                f"self.log({name!r}, reduce_fx={reduce_fx!r}) is not supported; use 'mean', 'sum', 'max' or 'min'."
            )
        metric = LoggedMetric(
            fx, name, prog_bar, logger, on_step, on_epoch, _REDUCE_FX[reduce_fx], sync_dist, rank_zero_only
        )
        self.metrics[name] = metric
        return metric

    # ------------------------------------------------------------------ reading
    def step_metrics(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """``(callback, logger, progress bar)`` dicts of the latest step values."""
        callback: dict[str, Any] = {}
        log: dict[str, Any] = {}
        pbar: dict[str, Any] = {}
        for name, metric in self.metrics.items():
            if not metric.on_step or metric.step_value is None:
                continue
            key = f"{name}_step" if metric.forked else name
            value = _as_tensor(metric.step_value)
            if self.training:
                callback[name] = value
                callback[key] = value
            if metric.logger:
                log[key] = value
            if metric.prog_bar:
                pbar[key] = value
        self.step_dirty = False
        return callback, log, pbar

    def epoch_metrics(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """``(callback, logger, progress bar)`` dicts of the epoch aggregates (synchronised if asked)."""
        callback: dict[str, Any] = {}
        log: dict[str, Any] = {}
        pbar: dict[str, Any] = {}
        for name, metric in self.metrics.items():
            if not metric.on_epoch:
                continue
            value = metric.compute_epoch(self.plugin)
            if value is None:
                continue
            value = _as_tensor(value)
            key = f"{name}_epoch" if metric.forked else name
            callback[name] = value
            callback[key] = value
            if metric.logger:
                log[key] = value
            if metric.prog_bar:
                pbar[key] = value
        return callback, log, pbar

    def reset(self) -> None:
        """Forget the values of the epoch; the registrations (names and options) are dropped too."""
        self.metrics.clear()
        self.batch = None
        self._batch_size = None
        self.step_dirty = False
