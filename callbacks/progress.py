"""``TQDMProgressBar``: train, validation, test and predict bars on global rank 0.

The members a subclass overrides are Lightning's (``init_train_tqdm`` ... ``init_test_tqdm``,
``get_metrics``, the ``*_progress_bar`` properties, ``BAR_FORMAT``), with Lightning's meaning, so a
customised Lightning bar draws the same bars here.

What differs is the cost: the bar's postfix (the ``prog_bar`` metrics) of a ``Tqdm`` bar is built
only when tqdm redraws, at most ten times a second, and a batch moves the bar with tqdm's throttled
``update`` rather than a redraw per batch: turning metrics into text and redrawing on every step is
what makes Lightning's bar cost several times the training step of a small model. A bar of another
class (a subclass's own ``tqdm``) gets its postfix at every update, as under Lightning.
"""

from __future__ import annotations

import math
import os
import sys
from numbers import Number
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO, Union

from tqdm.auto import tqdm as _tqdm

from trainer_core.callbacks.base import Callback

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

_PAD_SIZE = 5


class Tqdm(_tqdm):
    """The bars' tqdm class: numbers padded to a fixed width (no flicker), postfix built when drawn."""

    _metrics_fn: Optional[Callable[[], dict[str, Any]]] = None

    @staticmethod
    def format_num(n: Union[int, float, str]) -> str:
        """tqdm's number, and for floats and numeric strings padded with zeros to five characters."""
        padded = isinstance(n, (float, str))
        text = n if isinstance(n, str) else _tqdm.format_num(n)
        if not padded or "e" in text:
            return text
        if "." not in text and len(text) < _PAD_SIZE:
            try:
                float(text)
            except ValueError:
                return text
            text += "."
        return text + "0" * (_PAD_SIZE - len(text))

    def _postfix_text(self, metrics: dict[str, Any]) -> str:
        """``metrics`` as ``set_postfix`` writes them: ``k=v`` pairs, numbers through ``format_num``."""
        parts = []
        for key, value in metrics.items():
            text = self.format_num(value) if isinstance(value, Number) else str(value)
            parts.append(f"{key}={text.strip()}")
        return ", ".join(parts)

    @property
    def format_dict(self) -> dict[str, Any]:
        if self._metrics_fn is not None:
            self.postfix = self._postfix_text(self._metrics_fn())
        return super().format_dict


def convert_inf(n: Optional[Union[int, float]]) -> Optional[Union[int, float]]:
    """A bar's total: ``None`` (drawn without one) for an unknown, endless or NaN count."""
    if n is None or math.isinf(n) or math.isnan(n):
        return None
    return n


def _bar_total(n: Any) -> Optional[int]:
    total = convert_inf(n)
    return None if total is None else int(total)


def _loggers_version(loggers: list[Any]) -> Union[int, str, None]:
    """One logger's version, or the distinct versions of several joined by ``_`` (Lightning's rule)."""
    if len(loggers) == 1:
        return loggers[0].version
    return "_".join(dict.fromkeys(str(lg.version) for lg in loggers))


class ProgressBar(Callback):
    """What every progress bar shares: on or off, the totals and names of the stages, and the metrics.

    The Trainer adds a ``TQDMProgressBar`` unless a ``ProgressBar`` is among the callbacks. A bar
    draws on global rank 0 only; ``setup`` turns it off on the other ranks.
    """

    def __init__(self) -> None:
        self._enabled = True
        self._trainer: Optional[Trainer] = None
        self._current_eval_dataloader_idx: Optional[int] = None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise TypeError(f"The `{type(self).__name__}._trainer` reference has not been set yet.")
        return self._trainer

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print without breaking the bars (this base prints plainly)."""
        print(*args, **kwargs)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()

    # ------------------------------------------------------------------ what the bars show
    @property
    def sanity_check_description(self) -> str:
        return "Sanity Checking"

    @property
    def train_description(self) -> str:
        return "Training"

    @property
    def validation_description(self) -> str:
        return "Validation"

    @property
    def test_description(self) -> str:
        return "Testing"

    @property
    def predict_description(self) -> str:
        return "Predicting"

    @property
    def total_train_batches(self) -> Union[int, float]:
        """Batches in this training epoch (``inf`` when unknown), capped by ``max_steps`` without ``max_epochs``."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return min(trainer.num_training_batches, trainer.max_steps - trainer.global_step)
        return trainer.num_training_batches

    def _eval_batches(self, counts: list[Union[int, float]]) -> Union[int, float]:
        assert self._current_eval_dataloader_idx is not None
        return counts[self._current_eval_dataloader_idx]

    @property
    def total_val_batches_current_dataloader(self) -> Union[int, float]:
        """Batches of the validation dataloader now running (capped while sanity checking)."""
        n = self._eval_batches(self.trainer.num_val_batches)
        steps = self.trainer.num_sanity_val_steps
        if self.trainer.sanity_checking and steps >= 0:
            return min(n, steps)
        return n

    @property
    def total_test_batches_current_dataloader(self) -> Union[int, float]:
        return self._eval_batches(self.trainer.num_test_batches)

    @property
    def total_predict_batches_current_dataloader(self) -> Union[int, float]:
        return self._eval_batches(self.trainer.num_predict_batches)

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

    def has_dataloader_changed(self, dataloader_idx: int) -> bool:
        """Whether ``dataloader_idx`` is another dataloader than the last batch's (and remember it)."""
        changed = self._current_eval_dataloader_idx != dataloader_idx
        self._current_eval_dataloader_idx = dataloader_idx
        return changed

    def reset_dataloader_idx_tracker(self) -> None:
        self._current_eval_dataloader_idx = None

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """What the bar shows: the logger's version as ``v_num``, then the ``prog_bar`` metrics.

        Override it to change the items (e.g. ``super().get_metrics(...)`` without ``"v_num"``).
        """
        metrics: dict[str, Any] = {}
        if trainer.loggers:
            version = _loggers_version(trainer.loggers)
            if version not in ("", None):
                metrics["v_num"] = version[-4:] if isinstance(version, str) else version
        metrics.update(trainer.progress_bar_metrics)
        return metrics


def _resolve_refresh_rate(refresh_rate: int) -> int:
    """``TQDM_MINITERS`` in the environment raises the rate, as in Lightning."""
    if "TQDM_MINITERS" in os.environ:
        return max(int(os.environ["TQDM_MINITERS"]), refresh_rate)
    return refresh_rate


class _BarSlot:
    """``bar.train_progress_bar`` and its kin: the bar kept as ``_<name>``, a ``TypeError`` before one is set."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        bar = getattr(obj, self.attr)
        if bar is None:
            raise TypeError(f"The `{type(obj).__name__}.{self.attr}` reference has not been set yet.")
        return bar

    def __set__(self, obj: Any, bar: Any) -> None:
        setattr(obj, self.attr, bar)


class TQDMProgressBar(ProgressBar):
    """Lightning's progress bars: sanity check, training, validation, test and predict.

    Args:
        refresh_rate: batches between updates of a bar; ``0`` disables the bars.
        process_position: offset the bars by ``2 * process_position`` lines (beside bars of your own).
        leave: keep each epoch's finished training bar on screen (a new bar per epoch).
        file: where the default bars are written; ``sys.stderr`` when ``None``, so that a program's own
            output on stdout stays clean (Lightning writes to ``sys.stdout``). trainer-core only.
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        file: Optional[TextIO] = None,
    ) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(f"TQDMProgressBar(refresh_rate={refresh_rate!r}): use a non-negative integer.")
        super().__init__()
        self._refresh_rate = _resolve_refresh_rate(refresh_rate)
        self._process_position = process_position
        self._leave = leave
        self._file = file
        self._train_progress_bar: Optional[_tqdm] = None
        self._val_progress_bar: Optional[_tqdm] = None
        self._test_progress_bar: Optional[_tqdm] = None
        self._predict_progress_bar: Optional[_tqdm] = None
        self._lazy_postfix = False  # whether the training bar builds its own postfix when drawn

    def __getstate__(self) -> dict[str, Any]:
        """Pickles without the bars (tqdm objects hold a lock and a stream)."""
        return {k: None if isinstance(v, _tqdm) else v for k, v in vars(self).items()}

    # ------------------------------------------------------------------ Lightning's members
    train_progress_bar = _BarSlot()
    val_progress_bar = _BarSlot()
    test_progress_bar = _BarSlot()
    predict_progress_bar = _BarSlot()

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def process_position(self) -> int:
        return self._process_position

    @property
    def leave(self) -> bool:
        return self._leave

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    def _new_tqdm(self, desc: str, position: int, leave: bool, **kwargs: Any) -> Tqdm:
        return Tqdm(
            desc=desc,
            position=position,
            disable=self.is_disabled,
            leave=leave,
            dynamic_ncols=True,
            file=self._file or sys.stderr,
            bar_format=self.BAR_FORMAT,
            **kwargs,
        )

    def init_sanity_tqdm(self) -> Tqdm:
        """The sanity check's bar; override to customise it."""
        return self._new_tqdm(self.sanity_check_description, 2 * self.process_position, False)

    def init_train_tqdm(self) -> Tqdm:
        """The training bar; override to customise it."""
        return self._new_tqdm(self.train_description, 2 * self.process_position, True, smoothing=0)

    def init_predict_tqdm(self) -> Tqdm:
        """The predict bar; override to customise it."""
        return self._new_tqdm(self.predict_description, 2 * self.process_position, True, smoothing=0)

    def init_validation_tqdm(self) -> Tqdm:
        """The validation bar: below the training bar during ``fit``, on its own in ``validate``."""
        has_main_bar = self.trainer.state_stage != "validate"
        return self._new_tqdm(
            self.validation_description, 2 * self.process_position + has_main_bar, not has_main_bar
        )

    def init_test_tqdm(self) -> Tqdm:
        """The test bar; override to customise it."""
        return self._new_tqdm("Testing", 2 * self.process_position, True)

    # ------------------------------------------------------------------ moving the bars
    def _should_update(self, current: int, total: Optional[Union[int, float]]) -> bool:
        return self.is_enabled and (current % self.refresh_rate == 0 or current == total)

    @staticmethod
    def _move(bar: _tqdm, n: int) -> None:
        """Show ``n`` batches done: drawn when tqdm's interval allows, and always at the total."""
        if bar.disable:
            return
        if n == bar.total:
            bar.n = n
            bar.refresh()
        else:
            bar.update(n - bar.n)

    @staticmethod
    def _restart(bar: _tqdm, total: Any, desc: str) -> None:
        bar.reset()
        bar.total = convert_inf(total)
        bar.initial = 0
        bar.set_description(desc)

    # ------------------------------------------------------------------ sanity check and training
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.val_progress_bar = self.init_sanity_tqdm()
        self.train_progress_bar = Tqdm(disable=True)  # a stand-in, as in Lightning

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.val_progress_bar.close()
        self.train_progress_bar.close()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train_progress_bar = self.init_train_tqdm()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        self._restart(bar, self.total_train_batches, f"Epoch {trainer.current_epoch}")
        if isinstance(bar, Tqdm) and not bar.disable:
            bar._metrics_fn = lambda: self.get_metrics(trainer, trainer.lightning_module)
            self._lazy_postfix = True
        else:
            self._lazy_postfix = False

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = batch_idx + 1
        bar = self._train_progress_bar
        if bar is not None and self._should_update(n, bar.total):
            self._move(bar, n)
            if not self._lazy_postfix:
                bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        bar = self.train_progress_bar
        if not bar.disable:
            bar.set_postfix(self.get_metrics(trainer, pl_module))
        if self._leave:
            bar.close()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train_progress_bar.close()

    # ------------------------------------------------------------------ evaluation
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        bar = self._train_progress_bar
        if self._lazy_postfix and trainer.state_stage == "fit" and bar is not None and bar.n > 0:
            # Lightning's bar read the metrics at its last update, which puts the training values
            # before the validation ones in ``trainer.progress_bar_metrics``: read them as it did.
            self.get_metrics(trainer, pl_module)
        self.val_progress_bar = self.init_validation_tqdm()

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = self.sanity_check_description if trainer.sanity_checking else self.validation_description
            total = self.total_val_batches_current_dataloader
            self._restart(self.val_progress_bar, total, f"{desc} DataLoader {dataloader_idx}")

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batch_end(self._val_progress_bar, batch_idx)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()
        if self._train_progress_bar is not None and trainer.state_stage == "fit":
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.test_progress_bar = self.init_test_tqdm()

    def on_test_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = f"{self.test_description} DataLoader {dataloader_idx}"
            self._restart(self.test_progress_bar, self.total_test_batches_current_dataloader, desc)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batch_end(self._test_progress_bar, batch_idx)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.test_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.predict_progress_bar = self.init_predict_tqdm()

    def on_predict_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.has_dataloader_changed(dataloader_idx):
            desc = f"{self.predict_description} DataLoader {dataloader_idx}"
            self._restart(self.predict_progress_bar, self.total_predict_batches_current_dataloader, desc)

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batch_end(self._predict_progress_bar, batch_idx)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.predict_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def _eval_batch_end(self, bar: Optional[_tqdm], batch_idx: int) -> None:
        n = batch_idx + 1
        if bar is not None and self._should_update(n, bar.total):
            self._move(bar, n)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Close every open bar so the traceback is not drawn over."""
        for name in (
            "_train_progress_bar",
            "_val_progress_bar",
            "_test_progress_bar",
            "_predict_progress_bar",
        ):
            bar = getattr(self, name)
            if bar is not None:
                bar.close()

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Print through the first open bar, so the text does not break it."""
        for bar in (
            self._train_progress_bar,
            self._val_progress_bar,
            self._test_progress_bar,
            self._predict_progress_bar,
        ):
            if bar is not None and not bar.disable:
                bar.write(sep.join(map(str, args)), **kwargs)
                return
        print(*args, sep=sep, **kwargs)
