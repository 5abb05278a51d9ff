"""``EarlyStopping``: stop training when a monitored metric stops improving (Lightning 2.x semantics).

Every rank evaluates the metric it sees; the ranks then agree through the plugin
(``reduce_boolean_decision``, *any* rank wanting to stop stops all of them), so a metric that
differs between ranks (logged without ``sync_dist``) never leaves one rank training while another
has left the loop and the next collective hangs.
"""

from __future__ import annotations

import logging
import math
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

log = logging.getLogger("trainer_core")

_MODE_OPS: dict[str, Callable[[Tensor, Any], Tensor]] = {"min": torch.lt, "max": torch.gt}
_ORDER = {"min": "<", "max": ">"}


class EarlyStoppingReason(Enum):
    """Why ``EarlyStopping`` stopped the run (``EarlyStopping.stopping_reason``, Lightning's values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Monitor a metric and stop training when it stops improving.

    Args:
        monitor: the metric to watch (logged with ``self.log``).
        min_delta: a change of at most ``min_delta`` in the right direction is no improvement.
        patience: checks with no improvement before stopping. A check happens once per
            validation run (or per training epoch, see ``check_on_train_epoch_end``), so with
            ``check_val_every_n_epoch=10`` and ``patience=3`` at least 40 epochs run.
        verbose: log each decision.
        mode: ``"min"`` (stop when it stops decreasing) or ``"max"``.
        strict: raise if ``monitor`` is missing; otherwise skip the check (with a warning when verbose).
        check_finite: stop when the metric becomes NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of the training epoch instead of after
            validation; ``None``: at epoch end when validation runs exactly once per epoch.
        log_rank_zero_only: with ``verbose``, log from rank 0 only.

    After a stop, ``stopping_reason`` (an :class:`EarlyStoppingReason`) says why and
    ``stopping_reason_message`` says it in words; both travel in checkpoints.
    """

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: Optional[float] = None,
        divergence_threshold: Optional[float] = None,
        check_on_train_epoch_end: Optional[bool] = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in _MODE_OPS:
            raise MisconfigurationException(f"EarlyStopping(mode={mode!r}): use 'min' or 'max'.")
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationException(
                f"EarlyStopping(monitor={monitor!r}): name the metric to watch, as logged with self.log."
            )
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise MisconfigurationException(
                f"EarlyStopping(patience={patience!r}): use a non-negative integer."
            )
        self.monitor = monitor
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.log_rank_zero_only = log_rank_zero_only
        self._check_on_train_epoch_end = check_on_train_epoch_end
        # Signed so that "current - min_delta beats best" reads the same in both modes.
        self.min_delta = abs(min_delta) * (1 if mode == "max" else -1)
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: Optional[str] = None
        # The reason the last check found, kept until the ranks have agreed to stop.
        self._pending_reason = EarlyStoppingReason.NOT_STOPPED

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    @property
    def monitor_op(self) -> Callable[[Tensor, Any], Tensor]:
        return _MODE_OPS[self.mode]

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._check_on_train_epoch_end is None:
            # Validation more often than once per epoch (or not every epoch): check after each one.
            self._check_on_train_epoch_end = (
                trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
            )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._check_on_train_epoch_end and not self._skip(trainer):
            self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._check_on_train_epoch_end and not self._skip(trainer):
            self._run_early_stopping_check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self.best_score = state_dict["best_score"]
        self.patience = state_dict["patience"]
        self.stopping_reason = EarlyStoppingReason(
            state_dict.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value)
        )
        self.stopping_reason_message = state_dict.get("stopping_reason_message")

    # ------------------------------------------------------------------ the check
    @staticmethod
    def _skip(trainer: Trainer) -> bool:
        return trainer.state_stage != "fit" or trainer.sanity_checking or bool(trainer.fast_dev_run)

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        logs = trainer.callback_metrics
        value = logs.get(self.monitor)
        if value is None:
            message = (
                f"EarlyStopping(monitor={self.monitor!r}) could not find that metric (logged metrics: "
                f"{', '.join(sorted(logs)) or 'none'}). Log it with self.log({self.monitor!r}, ...) or change "
                "`monitor`."
            )
            if self.strict:
                raise RuntimeError(message)
            if self.verbose:
                rank_zero_warn(message, category=RuntimeWarning)
            return
        current = torch.as_tensor(value).detach().cpu().squeeze().to(torch.float64)
        should_stop, reason = self._evaluate_stopping_criteria(current)
        # One rank wanting to stop stops them all; otherwise the others would wait for it forever.
        should_stop = trainer.strategy.reduce_boolean_decision(should_stop, all=False)
        trainer.should_stop = trainer.should_stop or should_stop
        if should_stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason = self._pending_reason
            self.stopping_reason_message = reason
        if reason and self.verbose:
            self._log_info(trainer, reason)

    def _evaluate_stopping_criteria(self, current: Tensor) -> tuple[bool, Optional[str]]:
        best = self.best_score.to(current.dtype)
        self._pending_reason = EarlyStoppingReason.NOT_STOPPED
        if self.check_finite and not torch.isfinite(current):
            self._pending_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (
                f"Monitored metric {self.monitor} = {float(current)} is not finite. Previous best value was "
                f"{float(best):.3f}. Signaling Trainer to stop."
            )
        if self.stopping_threshold is not None and self.monitor_op(current, self.stopping_threshold):
            self._pending_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (
                f"Stopping threshold reached: {self.monitor} = {float(current)} {_ORDER[self.mode]} "
                f"{self.stopping_threshold}. Signaling Trainer to stop."
            )
        if self.divergence_threshold is not None and self.monitor_op(-current, -self.divergence_threshold):
            self._pending_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (
                f"Divergence threshold reached: {self.monitor} = {float(current)} {_ORDER[self.mode]} "
                f"{self.divergence_threshold}. Signaling Trainer to stop."
            )
        if self.monitor_op(current - self.min_delta, best):
            reason = self._improvement_message(current)
            self.best_score = current
            self.wait_count = 0
            return False, reason
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self._pending_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (
                f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records. "
                f"Best score: {float(best):.3f}. Signaling Trainer to stop."
            )
        return False, None

    def _improvement_message(self, current: Tensor) -> str:
        if torch.isfinite(self.best_score):
            return (
                f"Metric {self.monitor} improved by {abs(float(self.best_score) - float(current)):.3f} >= "
                f"min_delta = {abs(self.min_delta)}. New best score: {float(current):.3f}"
            )
        return f"Metric {self.monitor} improved. New best score: {float(current):.3f}"

    def _log_info(self, trainer: Trainer, message: str) -> None:
        if trainer.world_size > 1:
            if self.log_rank_zero_only and not trainer.is_global_zero:
                return
            message = f"[rank: {trainer.global_rank}] {message}"
        log.info(message)
