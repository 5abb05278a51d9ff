"""``LearningRateFinder``: Lightning's learning rate range test as a callback, run at ``on_fit_start``.

The search itself (and how the run is put back after it) lives in ``trainer_core.tuner``; this
callback decides when it runs. Override ``on_fit_start`` and call :meth:`LearningRateFinder.lr_find`
from another hook (say, at given epochs while fine-tuning) to search again later in a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

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
        from trainer_core.tuner.lr_find import _lr_find

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


class _LRCallback(Callback):
    """Records, per optimizer step, the learning rate used and the smoothed loss; stops when the loss diverges.

    The loss is Lightning's running average ``avg = beta * avg + (1 - beta) * loss`` divided by
    ``1 - beta ** (global_step + 1)``; the search stops once that exceeds ``early_stop_threshold``
    times the best one seen (from the second step on).
    """

    def __init__(
        self,
        num_training: int,
        early_stop_threshold: Optional[float] = 4.0,
        show_progress: bool = False,
        beta: float = 0.98,
    ) -> None:
        self.num_training = num_training
        self.early_stop_threshold = early_stop_threshold
        self.beta = beta
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.avg_loss = 0.0
        self.best_loss = 0.0
        self.show_progress = show_progress
        self.progress_bar: Any = None
        # The optimizer steps taken before the search began.
        self.start_step = 0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return
        if self.show_progress and self.progress_bar is None:
            from tqdm.auto import tqdm

            self.progress_bar = tqdm(desc="Finding best initial lr", total=self.num_training)
        self.lrs.append(trainer.lr_scheduler_configs[0].scheduler.lr[0])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return
        if not outputs:
            # training_step skipped the batch: a NaN keeps the two lists aligned; suggestion() ignores it.
            self.losses.append(float("nan"))
            return
        if self.progress_bar is not None:
            self.progress_bar.update()
        loss = outputs if isinstance(outputs, torch.Tensor) else outputs["loss"]
        current_loss = loss.item()
        # Steps of this search: Lightning counts the run's, so a search late in a run stopped at once.
        step = trainer.global_step - self.start_step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * current_loss
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        if (
            self.early_stop_threshold is not None
            and step > 1
            and smoothed > self.early_stop_threshold * self.best_loss
        ):
            trainer.should_stop = True
            if self.progress_bar is not None:
                self.progress_bar.close()
        trainer.should_stop = trainer.plugin.broadcast(trainer.should_stop)
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)

    def close(self) -> None:
        if self.progress_bar is not None:
            self.progress_bar.close()
            self.progress_bar = None
