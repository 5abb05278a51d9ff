"""``RichProgressBar``: the progress bars drawn with ``rich`` (optional: ``pip install rich``).

The same events as ``TQDMProgressBar`` (training, validation, test and predict bars on global
rank 0), drawn by ``rich.progress``. Rich redraws only when this callback asks (no background
thread reading the trainer's metrics while a step runs), at most ``refresh_rate`` times a second
(Lightning's meaning) and never more than ten, so a fast loop pays for neither the metrics text nor
the drawing on every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from trainer_core.callbacks.model_summary import import_rich_console
from trainer_core.callbacks.progress import ProgressBar
from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

_MIN_REDRAW_SECONDS = 0.1


@dataclass
class RichProgressBarTheme:
    """The styles of the bars' parts (rich style strings or ``rich.style.Style``), Lightning's fields.

    ``metrics_format`` formats each metric that is not a string; ``metrics_text_delimiter`` joins them.
    """

    description: Any = ""
    progress_bar: Any = "#6206E0"
    progress_bar_finished: Any = "#6206E0"
    progress_bar_pulse: Any = "#6206E0"
    batch_progress: Any = ""
    time: Any = "dim"
    processing_speed: Any = "dim underline"
    metrics: Any = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


def _metric_text(name: str, value: Any, fmt: str) -> str:
    if not isinstance(value, str):
        try:
            value = f"{value:{fmt}}"
        except (TypeError, ValueError):
            value = str(value)
    return f"{name}: {value}"


def _import_rich() -> Any:
    try:
        import_rich_console()
        import rich.progress
    except ImportError as err:
        raise MisconfigurationException(
            "RichProgressBar needs the `rich` package, which is not installed: `pip install rich` "
            "(or `pip install trainer-core[test]`), or use TQDMProgressBar, the default."
        ) from err
    return rich.progress


class RichProgressBar(ProgressBar):
    """Progress bars drawn with ``rich``.

    Args:
        refresh_rate: redraws per second, as in Lightning, at most ten (``0`` disables the bar).
        leave: keep the finished training bar of each epoch on screen.
        theme: the styles of the bars' parts and how metrics are written.
        console_kwargs: arguments for ``rich.console.Console`` (e.g. ``file=``, ``width=``).
    """

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: Optional[RichProgressBarTheme] = None,
        console_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        self._rich = _import_rich()
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise MisconfigurationException(
                f"RichProgressBar(refresh_rate={refresh_rate!r}): use a non-negative integer."
            )
        super().__init__()
        self.refresh_rate = refresh_rate
        self.leave = leave
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self._min_redraw_seconds = max(_MIN_REDRAW_SECONDS, 1 / refresh_rate) if refresh_rate else 0.0
        self._console_kwargs = dict(console_kwargs or {})
        self.progress: Any = None
        self.train_progress_bar_id: Optional[int] = None
        self.val_progress_bar_id: Optional[int] = None
        self.test_progress_bar_id: Optional[int] = None
        self.predict_progress_bar_id: Optional[int] = None
        # Batches done per evaluation task: its batch_idx restarts with each dataloader.
        self._seen: dict[int, int] = {}
        self._last_redraw = 0.0

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    # ------------------------------------------------------------------ drawing
    def _start(self, trainer: Trainer) -> None:
        if self.progress is not None:
            return
        from rich.console import Console

        rp = self._rich
        bar = self

        class MetricsColumn(rp.ProgressColumn):
            """The ``prog_bar`` metrics beside the training bar only."""

            def render(self, task: Any) -> Any:
                from rich.text import Text

                if task.id != bar.train_progress_bar_id or bar._trainer is None:
                    return Text("")
                theme = bar.theme
                metrics = bar.get_metrics(bar._trainer, bar._trainer.lightning_module)
                texts = (_metric_text(k, v, theme.metrics_format) for k, v in metrics.items())
                return Text(theme.metrics_text_delimiter.join(texts), style=theme.metrics)

        self._trainer = trainer
        theme = self.theme
        self.progress = rp.Progress(
            rp.TextColumn("{task.description}", style=theme.description),
            rp.BarColumn(
                complete_style=theme.progress_bar,
                finished_style=theme.progress_bar_finished,
                pulse_style=theme.progress_bar_pulse,
            ),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            MetricsColumn(),
            console=Console(**self._console_kwargs),
            auto_refresh=False,
        )
        self.progress.start()

    def _redraw(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_redraw >= self._min_redraw_seconds:
            self._last_redraw = now
            self.progress.refresh()

    def _advance(self, task_id: Optional[int], batch_idx: int, last: bool = False) -> None:
        if task_id is None:
            return
        self.progress.update(task_id, completed=batch_idx + 1)
        self._redraw(force=last)

    def _advance_eval(self, task_id: Optional[int]) -> None:
        if task_id is not None:
            self._seen[task_id] = seen = self._seen.get(task_id, 0) + 1
            self._advance(task_id, seen - 1)

    def _add_task(self, description: str, total: Optional[int]) -> int:
        return self.progress.add_task(description, total=total)

    def _finish_task(self, task_id: Optional[int], keep: bool) -> None:
        if task_id is None or self.progress is None:
            return
        self._seen.pop(task_id, None)
        task = next((t for t in self.progress.tasks if t.id == task_id), None)
        if task is not None and task.total is not None:
            self.progress.update(task_id, completed=task.total)
        self._redraw(force=True)
        if not keep:
            self.progress.update(task_id, visible=False)  # gone at the next redraw

    def _stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.train_progress_bar_id = self.val_progress_bar_id = None
        self.test_progress_bar_id = self.predict_progress_bar_id = None
        self._seen.clear()

    # ------------------------------------------------------------------ hooks
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.is_enabled:
            return
        self._start(trainer)
        description = f"Epoch {trainer.current_epoch}"
        if self.train_progress_bar_id is not None and not self.leave:
            self.progress.reset(
                self.train_progress_bar_id, total=self.total_train_batches, description=description
            )
        else:
            self.train_progress_bar_id = self._add_task(description, self.total_train_batches)
        self._redraw(force=True)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.train_progress_bar_id is not None:
            self._advance(self.train_progress_bar_id, batch_idx)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.batch_idx + 1)
            self._redraw(force=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.is_enabled:
            return
        self._start(trainer)
        description = (
            self.sanity_check_description if trainer.sanity_checking else self.validation_description
        )
        self.val_progress_bar_id = self._add_task(description, self.total_val_batches)
        self._redraw(force=True)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance_eval(self.val_progress_bar_id)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish_task(self.val_progress_bar_id, keep=False)
        self.val_progress_bar_id = None
        if trainer.state_stage != "fit":
            self._stop()

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.is_enabled:
            self._start(trainer)
            self.test_progress_bar_id = self._add_task("Testing", self.total_test_batches)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance_eval(self.test_progress_bar_id)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish_task(self.test_progress_bar_id, keep=True)
        self._stop()

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.is_enabled:
            self._start(trainer)
            self.predict_progress_bar_id = self._add_task("Predicting", self.total_predict_batches)

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._advance_eval(self.predict_progress_bar_id)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish_task(self.predict_progress_bar_id, keep=True)
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()
