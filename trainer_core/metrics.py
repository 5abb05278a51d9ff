"""Where logged values go once ``self.log`` has recorded them: callbacks, the progress bar, the loggers.

The running stage logs into one :class:`~trainer_core.results.ResultCollection` (``results``); the
training collection lives for the whole fit, each evaluation gets its own. What callbacks read
(``trainer.callback_metrics``), what the progress bar shows and what the loggers were last sent
are plain dicts, filled only when someone reads them or a logging interval is due.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from trainer_core.results import ResultCollection
from trainer_core.utilities import to_float

if TYPE_CHECKING:
    from trainer_core.run_state import MetricsRunState


class Metrics:
    """The Trainer's metric dicts, the collection being logged into, and the way out to the loggers."""

    __slots__ = ("_trainer", "callback", "eval_step", "logged", "progress_bar", "results", "train_results")

    def __init__(self, trainer: MetricsRunState) -> None:
        self._trainer = trainer
        self.callback: dict[str, Any] = {}
        self.logged: dict[str, Any] = {}
        self.progress_bar: dict[str, float] = {}
        # The collection ``self.log`` writes into now; None outside a stage.
        self.results: Optional[ResultCollection] = None
        self.train_results = ResultCollection(training=True)
        # The step evaluation batches are logged at (Lightning's separate counter for them).
        self.eval_step = 0

    def take_step_values(self) -> None:
        """Bring the training step's latest values into ``callback`` and ``progress_bar``."""
        results = self.results
        if results is not None and results.training and results.step_dirty:
            callback, _, pbar = results.step_metrics()
            self.callback.update(callback)
            self.progress_bar.update({k: to_float(v) for k, v in pbar.items()})

    def log_train_step(self) -> None:
        """At a logging interval of training: the step values to callbacks, the bar and the loggers."""
        callback, logged, pbar = self.train_results.step_metrics()
        self.callback.update(callback)
        self.progress_bar.update({k: to_float(v) for k, v in pbar.items()})
        if logged:
            self.log(logged, self._trainer.progress.batches_that_stepped - 1)

    def publish_epoch(
        self, results: ResultCollection, log: bool, step: Optional[int] = None
    ) -> dict[str, Any]:
        """Compute a stage's epoch aggregates, expose them to callbacks and send them to the loggers.

        Returns the values for the loggers, under their logged names (``val_loss_epoch`` for a metric
        logged per step and per epoch): what ``validate()``/``test()`` return, as in Lightning.
        """
        callback, logged, pbar = results.epoch_metrics()
        self.callback.update(callback)
        self.progress_bar.update({k: to_float(v) for k, v in pbar.items()})
        if log and logged:
            self.log(logged, self._trainer.progress.batches_that_stepped if step is None else step)
        return logged

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Send ``metrics`` to every logger at ``step`` (with the epoch), and record them as logged."""
        trainer = self._trainer
        if not trainer.loggers:
            return
        scalars = {k: to_float(v) for k, v in metrics.items()}
        self.logged.update(scalars)
        scalars.setdefault("epoch", trainer.current_epoch)
        for lg in trainer.loggers:
            lg.log_metrics(scalars, step=step)

    def clear(self) -> None:
        """Forget every value (what a sanity check logged must not reach callbacks or loggers).

        ``callback`` and ``progress_bar`` become new dicts, as in Lightning: a program that kept
        ``trainer.callback_metrics`` after ``fit`` still reads fit's values after ``test``."""
        self.callback = {}
        self.progress_bar = {}
        self.logged.clear()
