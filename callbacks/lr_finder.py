"""``LearningRateFinder``: Lightning's learning rate range test as a callback, run at ``on_fit_start``.

The search itself (and how the run is put back after it) lives in ``trainer_core.tuner``; this
callback decides when it runs. Override ``on_fit_start`` and call :meth:`LearningRateFinder.lr_find`
from another hook (say, at given epochs while fine-tuning) to search again later in a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException, _TunerExitException

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer


class LearningRateFinder(Callback):
    """Try ``num_training_steps`` learning rates from ``min_lr`` to ``max_lr``; optionally use the suggestion.

    Args:
        min_lr: the first learning rate tried.
        max_lr: the learning rate the schedule reaches at ``num_training_steps``.
        num_training_steps: how many steps (learning rates) to try.
        mode: ``"exponential"`` (default) or ``"linear"`` growth between steps.
        early_stop_threshold: stop once the smoothed loss exceeds this many times the best one; ``None``: never.
        update_attr: write the suggestion to the module's learning rate attribute and its optimizer.
        attr_name: that attribute; by default ``lr`` or ``learning_rate``, on the module or its ``hparams``.

    After the search, ``optimal_lr`` holds the finder (``results``, ``suggestion()``, ``plot()``); the
    weights, optimizer, loop counters and callbacks are as they were before it.
    """

    SUPPORTED_MODES = ("linear", "exponential")

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: Optional[float] = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise MisconfigurationException(
                f"LearningRateFinder(mode={mode!r}): use one of {self.SUPPORTED_MODES}."
            )
        self._min_lr = min_lr
        self._max_lr = max_lr
        self._num_training_steps = num_training_steps
        self._mode = mode
        self._early_stop_threshold = early_stop_threshold
        self._update_attr = update_attr
        self._attr_name = attr_name
        # Set by the Tuner: end the run once the search is done.
        self._early_exit = False
        self.optimal_lr: Any = None

    def lr_find(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Run the search now (from any hook of a fit run); the random generators come back as they were."""
        from trainer_core.tuner import _lr_find

        self.optimal_lr = _lr_find(
            trainer,
            pl_module,
            min_lr=self._min_lr,
            max_lr=self._max_lr,
            num_training=self._num_training_steps,
            mode=self._mode,
            early_stop_threshold=self._early_stop_threshold,
            update_attr=self._update_attr,
            attr_name=self._attr_name,
        )
        if self._early_exit:
            raise _TunerExitException()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.lr_find(trainer, pl_module)
