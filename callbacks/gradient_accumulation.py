"""``GradientAccumulationScheduler``: change ``accumulate_grad_batches`` by epoch (Lightning 2.x).

The factor is set on ``trainer.accumulate_grad_batches`` at each epoch start, before the loop reads
it for that epoch, so a run resumed in the middle of an epoch accumulates with that epoch's factor
and (with the gradients the checkpoint keeps mid-cycle) continues exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_utilities.core.overrides import is_overridden

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Accumulate gradients over a number of batches that changes with the epoch.

    Args:
        scheduling: ``{epoch: factor}``, epochs counted from 0; an epoch without an entry uses the
            factor of the nearest earlier one, and epochs before the first entry use 1.
            ``{0: 1, 4: 2}`` accumulates 2 batches from the fifth epoch on.
    """

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise TypeError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}): pass a non-empty dict {{epoch: factor}}."
            )
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in scheduling):
            raise MisconfigurationException(
                f"GradientAccumulationScheduler: epochs must be integers >= 0, got {list(scheduling)}."
            )
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in scheduling.values()):
            raise MisconfigurationException(
                f"GradientAccumulationScheduler: factors must be integers >= 1, got {list(scheduling.values())}."
            )
        scheduling = dict(scheduling)
        scheduling.setdefault(0, 1)
        self.scheduling = scheduling
        self.epochs = sorted(scheduling)
        self._applied = False

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The factor that applies in ``epoch``."""
        for start in reversed(self.epochs):
            if epoch >= start:
                return self.scheduling[start]
        return 1

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Checked before the sanity check, so nothing runs with a configuration that cannot work.
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "GradientAccumulationScheduler needs automatic optimization; under manual optimization accumulate "
                "in `training_step` (step the optimizer every N batches), or remove the callback."
            )
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and GradientAccumulationScheduler "
                "both set the accumulation; remove one of them."
            )
        from trainer_core.module import LightningModule

        overridden = is_overridden("optimizer_step", pl_module, LightningModule) or is_overridden(
            "optimizer_zero_grad", pl_module, LightningModule
        )
        if overridden and self.going_to_accumulate_grad_batches():
            rank_zero_warn(
                "GradientAccumulationScheduler accumulates gradients and the module overrides "
                "`optimizer_step` or `optimizer_zero_grad`: those hooks run once per optimizer step, not per batch."
            )

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)
        self._applied = True

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(trainer)

    def _restore(self, trainer: Trainer) -> None:
        # The Trainer's own setting (1, checked at the start) again, so a later fit starts from it.
        if self._applied:
            trainer.accumulate_grad_batches = 1
            self._applied = False
