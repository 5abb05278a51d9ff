"""What ``self.log`` records, and how it becomes step and epoch metrics.

``self.log`` runs on the training step, so it does the least it can: it stores the (detached)
value for the step and, when the metric is reduced over the epoch, adds it to a running
aggregate. Nothing is converted to a Python number, synchronised or copied into dicts until a
logger, the progress bar or a callback actually reads the metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import Tensor

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import extract_batch_size, to_float

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
#: Logged values in these dtypes are reduced in float32: a float16 epoch mean would round every partial sum.
_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})


class LoggedMetric:
    """One named metric: its latest step value and its running epoch aggregate."""

    __slots__ = (
        "batch_size_given",
        "count",
        "dataloader",
        "epoch_value",
        "fx",
        "logger",
        "name",
        "on_epoch",
        "on_step",
        "prog_bar",
        "reduce_fx",
        "step_value",
        "sync",
        "sync_group",
        "torchmetric",
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
        sync: bool,
        sync_group: Optional[Any],
        dataloader: str,
    ) -> None:
        self.fx = fx
        self.name = name
        self.prog_bar = prog_bar
        self.logger = logger
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.reduce_fx = reduce_fx
        # Reduce across processes (over ``sync_group``, or all of them when it is None).
        self.sync = sync
        self.sync_group = sync_group
        # The name suffix of the dataloader it was logged under ("" outside the loaders or with one).
        self.dataloader = dataloader
        self.step_value: Any = None
        self.total: Any = None
        self.count = 0
        self.epoch_value: Any = None
        self.batch_size_given = False
        # A torchmetrics ``Metric`` logged as the value: it accumulates and syncs itself; ``count``
        # then counts the logs since its last reset.
        self.torchmetric: Any = None

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
        if self.torchmetric is not None:
            return self._compute_torchmetric()
        if self.total is None:
            return self.epoch_value
        total, count = self.total, self.count
        if self.sync and plugin is not None and plugin.world_size > 1:
            total = _reduce(plugin, total, _SYNC_OP[self.reduce_fx], self.sync_group)
            if self.reduce_fx == "mean":
                count = _reduce(
                    plugin, torch.tensor(float(count), device=total.device), "sum", self.sync_group
                )
        value = total / count if self.reduce_fx == "mean" else total
        self.epoch_value = value
        return value

    def _compute_torchmetric(self) -> Any:
        """``metric.compute()``: the metric's own value over the epoch, synced across ranks by the metric.

        torchmetrics caches the result until the next update, so the several reads at an epoch's end
        sync once.
        """
        if self.count == 0:
            return self.epoch_value
        value = self.torchmetric.compute()
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise MisconfigurationException(
                f"self.log({self.name!r}, metric) in `{self.fx}`: `{type(self.torchmetric).__name__}.compute()` "
                f"returned {shape}, not a scalar tensor; log a metric that computes one number (e.g. "
                "average='micro'/'macro'), or log its parts with self.log_dict."
            )
        self.epoch_value = value.detach()
        return self.epoch_value


_SYNC_OP = {"mean": "sum", "sum": "sum", "max": "max", "min": "min"}


def is_torchmetric(value: Any) -> bool:
    """Whether ``value`` is a ``torchmetrics.Metric``, without importing torchmetrics (it cannot be one if unimported)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def dict_items(dictionary: Any) -> Any:
    """The ``(name, value)`` pairs ``self.log_dict`` logs: a ``MetricCollection``'s metrics by their prefixed names.

    A collection's compute groups share state between members; ``copy_state=False`` keeps that
    sharing, so every member computes from the one update (Lightning reads them the same way).
    """
    if isinstance(dictionary, Mapping):
        return dictionary.items()
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is not None and isinstance(dictionary, torchmetrics.MetricCollection):
        return dictionary.items(keep_base=False, copy_state=False)
    return dictionary.items()


#: What ``self.log`` appends to a name logged while dataloader N of several runs (Lightning's naming).
DATALOADER_SUFFIX = "/dataloader_idx_{}"


def _as_tensor(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else torch.tensor(float(value))


def _reduce(plugin: TrainingTypePlugin, value: Any, reduce_op: str, group: Optional[Any]) -> Tensor:
    """``value`` reduced across processes: over ``group`` (``self.log(sync_dist_group=...)``) if given.

    Otherwise over the plugin's ``metrics_group``: the ranks that see different data (under tensor
    parallelism the ranks of a group share a batch, so a sum over all ranks would count it twice).

    The group is passed only when there is one, so that a plugin whose ``reduce`` takes no group
    (one written by a user for a single process group) still serves every ``sync_dist=True`` log.
    """
    if group is None:
        group = plugin.metrics_group
    if group is None:
        return plugin.reduce(_as_tensor(value), reduce_op=reduce_op)
    return plugin.reduce(_as_tensor(value), reduce_op=reduce_op, group=group)


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
        # Appended to each name logged while one of several dataloaders runs (Lightning's naming).
        self.name_suffix = ""

    def set_dataloader(self, idx: Optional[int]) -> None:
        """Log what follows under dataloader ``idx`` of several; ``None`` with one, or outside the loaders."""
        self.name_suffix = "" if idx is None else DATALOADER_SUFFIX.format(idx)

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
        sync_dist_group: Optional[Any],
        add_dataloader_idx: bool,
        batch_size: Optional[int],
        rank_zero_only: bool,
    ) -> None:
        """Record ``value`` under ``name``; the arguments are ``LightningModule.log``'s, in its order."""
        whole = getattr(value, "full_tensor", None)
        if whole is not None:
            # A DTensor (a loss computed under loss_parallel): metrics, reductions and loggers take the
            # whole value as a plain tensor.
            value = whole()
        dataloader = self.name_suffix
        if dataloader and add_dataloader_idx:
            name = name + dataloader
        metric = self.metrics.get(name)
        if metric is None or metric.fx != fx or metric.dataloader != dataloader:
            metric = self._register(
                fx,
                name,
                value,
                prog_bar,
                logger,
                on_step,
                on_epoch,
                reduce_fx,
                # A value logged on rank 0 alone cannot be reduced: the other ranks would never join
                # the collective. Lightning skips the reduction too.
                sync_dist and not rank_zero_only,
                sync_dist_group,
                dataloader,
            )
        if metric.torchmetric is not None:
            self._log_torchmetric(metric, value)
            return
        if isinstance(value, Tensor):
            if not enable_graph and value.requires_grad:
                value = value.detach()
            if value.numel() != 1:
                raise MisconfigurationException(
                    f"self.log({name!r}, ...) in `{fx}` got a tensor of shape {tuple(value.shape)}; log a scalar."
                )
            if value.dtype in _LOW_PRECISION:
                # Reduced and accumulated in float32 at least (bf16-true, 16-true), as in Lightning.
                value = value.float()
        elif not isinstance(value, (int, float)):
            raise MisconfigurationException(
                f"self.log({name!r}, value) in `{fx}` got a {type(value).__name__} where this epoch logged numbers "
                "under that name; give the metric object a name of its own."
            )
        if metric.on_step:
            if metric.sync and self.plugin is not None and self.plugin.world_size > 1:
                value = _reduce(self.plugin, value, metric.reduce_fx, metric.sync_group)
            metric.step_value = value
            self.step_dirty = True
        if metric.on_epoch:
            metric.accumulate(value, batch_size if batch_size is not None else self._current_batch_size())

    def _log_torchmetric(self, metric: LoggedMetric, value: Any) -> None:
        """A ``Metric`` logged: its step value is what its last ``forward`` returned; the epoch value is its ``compute()``.

        The metric holds its own state, so nothing is accumulated here; a ``metric.update()`` without
        ``forward`` leaves no step value, as in Lightning.
        """
        if value is not metric.torchmetric:
            given = "another Metric object" if is_torchmetric(value) else f"a {type(value).__name__}"
            raise MisconfigurationException(
                f"self.log({metric.name!r}, ...) in `{metric.fx}` got {given} where this epoch logged the "
                f"`{type(metric.torchmetric).__name__}` object under that name; log each metric object under a "
                "name of its own."
            )
        metric.count += 1
        if metric.on_step:
            cache = value._forward_cache
            if isinstance(cache, Tensor):
                if cache.numel() != 1:
                    raise MisconfigurationException(
                        f"self.log({metric.name!r}, metric) in `{metric.fx}`: the metric's forward returned a tensor "
                        f"of shape {tuple(cache.shape)}; log a metric that computes one number."
                    )
                metric.step_value = cache.detach()
                self.step_dirty = True

    def reset_torchmetrics(self) -> None:
        """``reset()`` every torchmetrics ``Metric`` logged: the end of its epoch (Lightning resets them there too).

        The epoch value computed before stays readable; the next epoch starts the metric afresh, and a
        metric logged ``on_step`` only does not keep growing state over the run.
        """
        for metric in self.metrics.values():
            if metric.torchmetric is not None and metric.count:
                metric.torchmetric.reset()
                metric.count = 0

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
        sync: bool,
        sync_group: Optional[Any],
        dataloader: str,
    ) -> LoggedMetric:
        if fx in NO_LOG_HOOKS:
            raise MisconfigurationException(
                f"self.log({name!r}, ...) is not supported in `{fx}`: prediction logs nothing."
            )
        torchmetric = is_torchmetric(value)
        if not torchmetric and (not isinstance(value, (Tensor, int, float)) or isinstance(value, bool)):
            hint = (
                "; log a MetricCollection with self.log_dict"
                if type(value).__name__ == "MetricCollection"
                else ""
            )
            raise MisconfigurationException(
                f"self.log({name!r}, value) in `{fx}` got a {type(value).__name__}; log a number, a scalar tensor or "
                f"a torchmetrics Metric{hint}."
            )
        existing = self.metrics.get(name)
        if existing is not None and existing.fx != fx:
            raise MisconfigurationException(
                f"self.log({name!r}, ...) is called from both `{existing.fx}` and `{fx}`; give each its own name."
            )
        if existing is not None:
            # Only a name logged with add_dataloader_idx=False comes back under another dataloader.
            raise MisconfigurationException(
                f"self.log({name!r}, ..., add_dataloader_idx=False) in `{fx}` is logged under two dataloaders "
                f"({existing.dataloader.lstrip('/')} and {dataloader.lstrip('/')}), so their values would mix "
                "into one; give each dataloader its own name, or leave add_dataloader_idx=True."
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
        if torchmetric:
            # The metric syncs its own state in ``compute()`` (torchmetrics' dist_sync); sync_dist is not used.
            sync = False
        metric = LoggedMetric(
            fx, name, prog_bar, logger, on_step, on_epoch, _REDUCE_FX[reduce_fx], sync, sync_group, dataloader
        )
        if torchmetric:
            metric.torchmetric = value
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

    def per_dataloader(self, metrics: Mapping[str, Any], count: int) -> list[dict[str, float]]:
        """``metrics`` (read from this collection) as ``validate()``/``test()`` return them: a dict per dataloader.

        A name belongs to the dataloader it was logged under, with or without ``/dataloader_idx_N``
        as ``add_dataloader_idx`` chose; a name logged outside the loaders (``on_validation_epoch_end``)
        goes into every dataloader's dict. Lightning splits them the same way.
        """
        values = {k: to_float(v) for k, v in metrics.items()}
        if count <= 1:
            return [values]
        owner: dict[str, str] = {}
        for name, metric in self.metrics.items():
            owner[name] = metric.dataloader
            if metric.forked:
                owner[f"{name}_epoch"] = metric.dataloader
        return [
            {k: v for k, v in values.items() if owner.get(k, "") in ("", DATALOADER_SUFFIX.format(idx))}
            for idx in range(count)
        ]

    def reset(self) -> None:
        """Forget the values of the epoch; the registrations (names and options) are dropped too."""
        self.metrics.clear()
        self.batch = None
        self._batch_size = None
        self.step_dirty = False
