"""``LearningRateMonitor``: every optimizer's learning rates sent to the loggers, under stable names.

The names follow Lightning 2.x exactly, so a dashboard made for a Lightning run reads this one:

* ``lr-<OptimizerClass>`` per optimizer, or the scheduler config's ``name`` when it has one;
* ``-<i>`` after the class name for the second, third, ... optimizer of one class (the first
  has no suffix): ``lr-SGD``, ``lr-SGD-1``;
* ``/pg<i>`` (from 1) per param group when an optimizer has several, or ``/<name>`` when the
  param group has a ``"name"`` key;
* ``<name>-momentum`` and ``<name>-weight_decay`` beside each when asked for.

Optimizers with a scheduler come first (in scheduler order), then those without one. Values are
logged at the step the training metrics of the same batch use (``_batches_that_stepped`` before
the batch), every ``log_every_n_steps`` batches for ``"step"``, once per epoch for ``"epoch"``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim import Optimizer

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.optim import LRSchedulerConfig
    from trainer_core.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log the learning rate (and optionally momentum and weight decay) of every optimizer.

    Args:
        logging_interval: ``"step"`` or ``"epoch"`` to log every optimizer at that interval;
            ``None`` logs each scheduler at its own ``interval`` (optimizers without a scheduler
            at both).
        log_momentum: also log ``<name>-momentum`` (``betas[0]`` for Adam-like optimizers, 0
            when the optimizer has none).
        log_weight_decay: also log ``<name>-weight_decay``.
    """

    def __init__(
        self,
        logging_interval: Optional[str] = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationException("logging_interval should be `step` or `epoch` or `None`.")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, Optional[float]] = {}
        self.last_weight_decay_values: dict[str, Optional[float]] = {}

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger."
            )

        if self.log_momentum:

            def _check_no_key(key: str) -> bool:
                if trainer.lr_scheduler_configs:
                    return any(
                        key not in config.scheduler.optimizer.defaults
                        for config in trainer.lr_scheduler_configs
                    )
                return any(key not in optimizer.defaults for optimizer in trainer.optimizers)

            if _check_no_key("momentum") and _check_no_key("betas"):
                rank_zero_warn(
                    "You have set log_momentum=True, but some optimizers do not"
                    " have momentum. This will log a value 0 for the momentum.",
                    category=RuntimeWarning,
                )

        sched_names, seen_optimizers, seen_types = self._find_names_from_schedulers(
            trainer.lr_scheduler_configs
        )
        opt_names, _ = self._find_names_from_optimizers(trainer.optimizers, seen_optimizers, seen_types)
        names = list(itertools.chain.from_iterable([*sched_names, *opt_names]))
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Lightning's ``should_update_logs``: the batch about to run is a logging step.
        if (trainer.batches_that_stepped + 1) % trainer.log_every_n_steps != 0 and not trainer.should_stop:
            return
        if self.logging_interval != "epoch":
            interval = "step" if self.logging_interval is None else "any"
            self._log(trainer, self._extract_stats(trainer, interval))

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.logging_interval != "step":
            interval = "epoch" if self.logging_interval is None else "any"
            self._log(trainer, self._extract_stats(trainer, interval))

    @staticmethod
    def _log(trainer: Trainer, stats: dict[str, float]) -> None:
        if not stats:
            return
        # Straight to the loggers, as Lightning does: no ``epoch`` beside the rates, nothing in
        # ``trainer.logged_metrics``. The step is Lightning's ``fit_loop.epoch_loop._batches_that_stepped``,
        # the same step the training metrics of the coming batch are logged at.
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=trainer.batches_that_stepped)

    # ------------------------------------------------------------------ values
    def _extract_stats(self, trainer: Trainer, interval: str) -> dict[str, float]:
        latest: dict[str, float] = {}
        configs = trainer.lr_scheduler_configs
        sched_names, seen_optimizers, seen_types = self._find_names_from_schedulers(configs)
        self._remap_keys(sched_names)
        for names, config in zip(sched_names, configs):
            if interval in (config.interval, "any"):
                latest.update(self._get_optimizer_stats(config.scheduler.optimizer, names))

        opt_names, without_scheduler = self._find_names_from_optimizers(
            trainer.optimizers, seen_optimizers, seen_types
        )
        self._remap_keys(opt_names)
        for opt, names in zip(without_scheduler, opt_names):
            latest.update(self._get_optimizer_stats(opt, names))

        if latest:
            device = getattr(trainer.strategy, "root_device", None)
            trainer.callback_metrics.update(
                {name: torch.tensor(value, device=device) for name, value in latest.items()}
            )
        return latest

    def _get_optimizer_stats(self, optimizer: Optimizer, names: list[str]) -> dict[str, float]:
        stats: dict[str, float] = {}
        use_betas = "betas" in optimizer.defaults
        for pg, name in zip(optimizer.param_groups, names):
            lr = float(pg["lr"])
            self.lrs.setdefault(name, []).append(lr)
            stats[name] = lr
            if self.log_momentum:
                momentum = pg["betas"][0] if use_betas else pg.get("momentum", 0)
                self.last_momentum_values[f"{name}-momentum"] = momentum
                stats[f"{name}-momentum"] = momentum
            if self.log_weight_decay:
                weight_decay = pg["weight_decay"]
                self.last_weight_decay_values[f"{name}-weight_decay"] = weight_decay
                stats[f"{name}-weight_decay"] = weight_decay
        return stats

    def _remap_keys(self, names: list[list[str]], token: str = "/pg1") -> None:
        """Carry the history of ``name`` over to ``name/pg1`` when an optimizer gained param groups."""
        for group_names in names:
            for new_name in group_names:
                old_name = new_name.replace(token, "")
                if token in new_name and old_name in self.lrs:
                    self.lrs[new_name] = self.lrs.pop(old_name)
                elif new_name not in self.lrs:
                    self.lrs[new_name] = []

    # ------------------------------------------------------------------ names
    def _find_names_from_schedulers(
        self, lr_scheduler_configs: list[LRSchedulerConfig]
    ) -> tuple[list[list[str]], list[Optimizer], defaultdict[type[Optimizer], int]]:
        names: list[list[str]] = []
        seen_optimizers: list[Optimizer] = []
        seen_types: defaultdict[type[Optimizer], int] = defaultdict(int)
        for config in lr_scheduler_configs:
            optimizer = config.scheduler.optimizer
            name = config.name if config.name is not None else "lr-" + type(optimizer).__name__
            names.append(
                self._check_duplicates_and_update_name(optimizer, name, seen_optimizers, seen_types, config)
            )
        return names, seen_optimizers, seen_types

    def _find_names_from_optimizers(
        self,
        optimizers: list[Optimizer],
        seen_optimizers: list[Optimizer],
        seen_types: defaultdict[type[Optimizer], int],
    ) -> tuple[list[list[str]], list[Optimizer]]:
        names: list[list[str]] = []
        without_scheduler: list[Optimizer] = []
        for optimizer in optimizers:
            # A wrapper (DeepSpeed's, a LightningOptimizer) holds the torch optimizer.
            optimizer = getattr(optimizer, "optimizer", optimizer)
            if any(optimizer is seen for seen in seen_optimizers):
                continue
            name = "lr-" + type(optimizer).__name__
            names.append(
                self._check_duplicates_and_update_name(optimizer, name, seen_optimizers, seen_types, None)
            )
            without_scheduler.append(optimizer)
        return names, without_scheduler

    def _check_duplicates_and_update_name(
        self,
        optimizer: Optimizer,
        name: str,
        seen_optimizers: list[Optimizer],
        seen_types: defaultdict[type[Optimizer], int],
        config: Optional[LRSchedulerConfig],
    ) -> list[str]:
        seen_optimizers.append(optimizer)
        optimizer_cls = type(optimizer)
        if config is None or config.name is None:
            seen_types[optimizer_cls] += 1

        param_groups = optimizer.param_groups
        duplicates = _duplicate_param_group_names(param_groups)
        if duplicates:
            raise MisconfigurationException(
                "A single `Optimizer` cannot have multiple parameter groups with identical "
                f"`name` values. {name} has duplicated parameter group names {duplicates}"
            )
        count = seen_types.get(optimizer_cls, 0)
        if count > 1:
            name = f"{name}-{count - 1}"
        return [_add_suffix(name, param_groups, i) for i in range(len(param_groups))]


def _add_suffix(name: str, param_groups: list[dict[str, Any]], index: int) -> str:
    if len(param_groups) > 1:
        return f"{name}/{param_groups[index].get('name', f'pg{index + 1}')}"
    pg_name = param_groups[index].get("name")
    return f"{name}/{pg_name}" if pg_name else name


def _duplicate_param_group_names(param_groups: list[dict[str, Any]]) -> set[str]:
    names = [pg.get("name", f"pg{i}") for i, pg in enumerate(param_groups, start=1)]
    return {n for n in names if names.count(n) > 1}
