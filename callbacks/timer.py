"""``Timer``: measure the time spent in each loop and stop training once a time budget is spent.

It stops the way every stop happens (``trainer.should_stop``), so the epoch ends properly: the
epoch-end hooks run and ``ModelCheckpoint`` writes the state reached. The training time spent so
far travels in the checkpoint, so a resumed run with the same budget only gets what is left.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

log = logging.getLogger("trainer_core")

_STAGES = ("train", "sanity_check", "validate", "test", "predict")
_INTERVALS = ("step", "epoch")
_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


def _parse_duration(duration: Union[str, timedelta, dict[str, int], None]) -> Optional[float]:
    if duration is None:
        return None
    if isinstance(duration, str):
        match = _DURATION.fullmatch(duration.strip())
        if not match:
            raise MisconfigurationException(
                f"Timer(duration={duration!r}): write it as DD:HH:MM:SS, e.g. '00:12:00:00' for 12 hours."
            )
        days, hours, minutes, seconds = (int(g) for g in match.groups())
        duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(duration, dict):
        try:
            duration = timedelta(**duration)
        except TypeError as err:
            raise MisconfigurationException(
                f"Timer(duration={duration!r}): the keys must be datetime.timedelta's (days, hours, minutes, ...)."
            ) from err
    if not isinstance(duration, timedelta):
        raise MisconfigurationException(
            f"Timer(duration={duration!r}): use 'DD:HH:MM:SS', a datetime.timedelta or a dict of its arguments."
        )
    return duration.total_seconds()


class Timer(Callback):
    """Track the time of the training, validation and test loops; stop training after ``duration``.

    Args:
        duration: ``"DD:HH:MM:SS"``, a ``datetime.timedelta`` or a dict of its arguments; ``None``
            only measures.
        interval: check after every training batch (``"step"``) or every epoch (``"epoch"``).
        verbose: log when the time limit stops training.
    """

    def __init__(
        self,
        duration: Optional[Union[str, timedelta, dict[str, int]]] = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in _INTERVALS:
            raise MisconfigurationException(f"Timer(interval={interval!r}): use 'step' or 'epoch'.")
        self._duration = _parse_duration(duration)
        self._interval = interval
        self._verbose = verbose
        self._start_time: dict[str, Optional[float]] = dict.fromkeys(_STAGES)
        self._end_time: dict[str, Optional[float]] = dict.fromkeys(_STAGES)
        self._offset = 0.0

    # ------------------------------------------------------------------ queries
    def start_time(self, stage: str = "train") -> Optional[float]:
        """When ``stage`` last started (``time.monotonic()`` seconds), or ``None``."""
        return self._start_time[_stage(stage)]

    def end_time(self, stage: str = "train") -> Optional[float]:
        """When ``stage`` last ended (``time.monotonic()`` seconds), or ``None``."""
        return self._end_time[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage``; for training, including the runs this one resumed."""
        stage = _stage(stage)
        start, end = self._start_time[stage], self._end_time[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        if end is None:
            return time.monotonic() - start + offset
        return end - start + offset

    def time_remaining(self, stage: str = "train") -> Optional[float]:
        """Seconds left of ``duration``, or ``None`` without one."""
        if self._duration is None:
            return None
        return self._duration - self.time_elapsed(stage)

    # ------------------------------------------------------------------ hooks
    def _begin(self, stage: str) -> None:
        self._start_time[stage] = time.monotonic()
        self._end_time[stage] = None

    def _finish(self, stage: str) -> None:
        self._end_time[stage] = time.monotonic()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin("train")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("train")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin("sanity_check" if trainer.sanity_checking else "validate")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("sanity_check" if trainer.sanity_checking else "validate")

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin("test")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("test")

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._begin("predict")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("predict")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After a restore: a budget already spent stops the run before its first batch.
        if self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._interval == "step" and self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._interval == "epoch" and self._duration is not None:
            self._check_time_remaining(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in _STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = float(state_dict.get("time_elapsed", {}).get("train", 0.0))

    def _check_time_remaining(self, trainer: Trainer) -> None:
        assert self._duration is not None
        # Clocks differ across ranks: the first rank out of time stops all, or it would stop alone
        # (one small all-reduce, only when there are several ranks).
        should_stop = trainer.strategy.reduce_boolean_decision(
            self.time_elapsed("train") >= self._duration, all=False
        )
        trainer.should_stop = trainer.should_stop or should_stop
        if should_stop and self._verbose and trainer.is_global_zero:
            elapsed = timedelta(seconds=int(self.time_elapsed("train")))
            log.info(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.")


def _stage(stage: str) -> str:
    aliases = {"training": "train", "fit": "train", "validating": "validate", "validation": "validate"}
    stage = aliases.get(stage, stage)
    if stage not in _STAGES:
        raise MisconfigurationException(f"Timer: unknown stage {stage!r}; use one of {', '.join(_STAGES)}.")
    return stage
