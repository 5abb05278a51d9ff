"""``TQDMProgressBar``: train, validation, test and predict bars on global rank 0.

The bar's postfix (the ``prog_bar`` metrics) is built only when tqdm redraws, at most ten times
a second, not on every step: turning metrics into text per step is what makes Lightning's bar
cost several times the training step of a small model.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO

from tqdm.auto import tqdm as _tqdm

from trainer_core.callbacks.base import Callback

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer


class _Bar(_tqdm):
    """A tqdm bar whose postfix comes from a function, called only when the bar is drawn."""

    def __init__(
        self, *args: Any, metrics: Optional[Callable[[], dict[str, Any]]] = None, **kwargs: Any
    ) -> None:
        self._metrics_fn = metrics
        self.seen = 0  # batches done, drawn or not
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if self._metrics_fn is not None:
            items = self._metrics_fn()
            if items:
                d["postfix"] = ", ".join(f"{k}={ProgressBar.format_value(v)}" for k, v in items.items())
        return d


def _bar_total(n: Any) -> Optional[int]:
    """A bar's total: ``None`` (drawn without one) for an unknown or endless count."""
    return None if n is None or (isinstance(n, float) and math.isinf(n)) else int(n)


class ProgressBar(Callback):
    """What every progress bar shares: on or off, the totals and names of the stages, and the metrics.

    The Trainer adds a ``TQDMProgressBar`` unless a ``ProgressBar`` is among the callbacks. A bar
    draws on global rank 0 only; ``setup`` turns it off on the other ranks.
    """

    def __init__(self) -> None:
        self._enabled = True
        self._trainer: Optional[Trainer] = None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a `Trainer` yet (its setup has not run)."
            )
        return self._trainer

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()

    # ------------------------------------------------------------------ what the bars show
    @property
    def validation_description(self) -> str:
        """The validation bar's name; the sanity check is a short validation with its own name."""
        return "Sanity Checking" if self.trainer.sanity_checking else "Validation"

    @property
    def total_train_batches(self) -> Optional[int]:
        """Batches in a training epoch; ``None`` when unknown (an iterable without a length)."""
        return _bar_total(self.trainer.num_training_batches)

    @property
    def total_val_batches(self) -> Optional[int]:
        """Batches of this validation over all its dataloaders (capped while sanity checking).

        A dataloader without a length adds nothing; ``None`` when there are no dataloaders.
        """
        trainer = self.trainer
        counts = trainer.num_val_batches
        if not counts:
            return None
        steps = trainer.num_sanity_val_steps
        if trainer.sanity_checking and steps >= 0:
            counts = [min(n, steps) for n in counts]
        return _bar_total(sum(n for n in counts if not math.isinf(n)))

    @property
    def total_test_batches(self) -> Optional[int]:
        return _bar_total(sum(self.trainer.num_test_batches))

    @property
    def total_predict_batches(self) -> Optional[int]:
        return _bar_total(sum(self.trainer.num_predict_batches))

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """What the bar shows: the ``prog_bar`` metrics and the logger's version as ``v_num``."""
        metrics: dict[str, Any] = {}
        logger = trainer.logger
        if logger is not None and getattr(logger, "_version", None) is not None:
            version = logger.version
            metrics["v_num"] = version[-4:] if isinstance(version, str) else version
        metrics.update(trainer.progress_bar_metrics)
        return metrics

    @staticmethod
    def format_value(value: Any) -> str:
        """A metric as the bars print it: floats to 3 significant digits."""
        return f"{value:.3g}" if isinstance(value, float) else str(value)


class TQDMProgressBar(ProgressBar):
    """Progress bars like Lightning's: ``refresh_rate`` batches per update (0 disables it)."""

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        file: Optional[TextIO] = None,
    ) -> None:
        if not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(f"TQDMProgressBar(refresh_rate={refresh_rate!r}): use a non-negative integer.")
        super().__init__()
        self.refresh_rate = refresh_rate
        self.process_position = process_position
        self.leave = leave
        self._file = file
        self.train_progress_bar: Optional[_Bar] = None
        self.val_progress_bar: Optional[_Bar] = None
        self.test_progress_bar: Optional[_Bar] = None
        self.predict_progress_bar: Optional[_Bar] = None

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    def _new_bar(
        self, desc: str, total: Optional[int], position_offset: int, leave: bool, with_metrics: bool = False
    ) -> _Bar:
        trainer = self._trainer
        show = with_metrics and trainer is not None
        return _Bar(
            desc=desc,
            total=total,
            position=2 * self.process_position + position_offset,
            leave=leave,
            dynamic_ncols=True,
            file=self._file or sys.stderr,
            smoothing=0,
            metrics=(lambda: self.get_metrics(trainer, trainer.lightning_module)) if show else None,
        )

    # ------------------------------------------------------------------ training
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.is_enabled:
            return
        if self.train_progress_bar is None:
            self.train_progress_bar = self._new_bar(
                "Training", self.total_train_batches, 0, True, with_metrics=True
            )
        else:
            self.train_progress_bar.reset(total=self.total_train_batches)
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}", refresh=False)
        self.train_progress_bar.initial = trainer.progress.resume.batch_idx

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        if bar is None:
            return
        rate = self.refresh_rate
        if rate == 1:
            bar.update(1)
        elif (batch_idx + 1) % rate == 0 or trainer.is_last_batch:
            bar.update(batch_idx + 1 - bar.n)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.train_progress_bar is not None:
            self.train_progress_bar.refresh()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.train_progress_bar is not None:
            self.train_progress_bar.close()
            self.train_progress_bar = None

    # ------------------------------------------------------------------ evaluation
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.is_enabled:
            return
        has_main = self.train_progress_bar is not None
        self.val_progress_bar = self._new_bar(
            self.validation_description, self.total_val_batches, 1 if has_main else 0, not has_main
        )

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance(self.val_progress_bar)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.val_progress_bar is not None:
            self.val_progress_bar.close()
            self.val_progress_bar = None
        if self.train_progress_bar is not None and not trainer.sanity_checking:
            self.train_progress_bar.refresh()

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.is_enabled:
            self.test_progress_bar = self._new_bar("Testing", self.total_test_batches, 0, True)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance(self.test_progress_bar)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.test_progress_bar = self._close(self.test_progress_bar)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.is_enabled:
            self.predict_progress_bar = self._new_bar("Predicting", self.total_predict_batches, 0, True)

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance(self.predict_progress_bar)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.predict_progress_bar = self._close(self.predict_progress_bar)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.train_progress_bar = self._close(self.train_progress_bar)
        self.val_progress_bar = self._close(self.val_progress_bar)
        self.test_progress_bar = self._close(self.test_progress_bar)
        self.predict_progress_bar = self._close(self.predict_progress_bar)

    def _advance(self, bar: Optional[_Bar]) -> None:
        """One more batch: drawn every ``refresh_rate`` batches and at the last one (Lightning's rule)."""
        if bar is None:
            return
        bar.seen += 1
        if bar.seen % self.refresh_rate == 0 or bar.seen == bar.total:
            bar.update(bar.seen - bar.n)

    @staticmethod
    def _close(bar: Optional[_Bar]) -> None:
        """Close ``bar`` if there is one; returns ``None`` for the attribute that held it."""
        if bar is not None:
            bar.close()
