"""``BasePredictionWriter``: write predictions as ``trainer.predict`` makes them, per batch or per epoch.

A writer needs to know which samples of the data set each prediction belongs to (with a shuffled
loader, or with each rank predicting its own part under a distributed plugin). When a writer is
among the callbacks, the prediction loop records the indices the loader's batch sampler gives out;
without one it records nothing (``trainer_core.loops.evaluation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer


class WriteInterval(str, Enum):
    """When a :class:`BasePredictionWriter` writes; each member equals its string (``WriteInterval.BATCH == "batch"``)."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


WRITE_INTERVALS = tuple(interval.value for interval in WriteInterval)


class BasePredictionWriter(Callback):
    """Subclass it and override :meth:`write_on_batch_end`, :meth:`write_on_epoch_end` or both.

    Args:
        write_interval: ``"batch"`` (after each batch), ``"epoch"`` (once, with every prediction
            of the run) or ``"batch_and_epoch"``, or the :class:`WriteInterval` of that value.

    Each rank writes its own predictions; under a distributed plugin every sample is predicted on
    exactly one rank, and ``batch_indices`` say which. ``trainer.predict(..., return_predictions=False)``
    with an epoch writer still keeps the predictions until :meth:`write_on_epoch_end` has run, then
    drops them.
    """

    def __init__(
        self, write_interval: Union[WriteInterval, Literal["batch", "epoch", "batch_and_epoch"]] = "batch"
    ) -> None:
        if write_interval not in WRITE_INTERVALS:
            raise MisconfigurationException(
                f"{type(self).__name__}(write_interval={write_interval!r}): use one of {', '.join(WRITE_INTERVALS)}."
            )
        # Lightning's attribute name and type; it compares equal to the string given.
        self.interval = WriteInterval(write_interval)

    @property
    def writes_on_batch(self) -> bool:
        return self.interval.on_batch

    @property
    def writes_on_epoch(self) -> bool:
        return self.interval.on_epoch

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Optional[Sequence[int]],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's ``prediction``; ``batch_indices`` are its samples' indices in the data set
        (``None`` when the loader is not a ``DataLoader`` with a batch sampler)."""
        raise NotImplementedError(
            f"{type(self).__name__}(write_interval={self.interval.value!r}) writes per batch: override write_on_batch_end."
        )

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        """Write every prediction of the run.

        As in Lightning: ``predictions`` is the list of batch predictions (a list of such lists with
        several dataloaders), and ``batch_indices`` always has one entry per dataloader, each a list
        of the batches' index lists.
        """
        raise NotImplementedError(
            f"{type(self).__name__}(write_interval={self.interval.value!r}) writes per epoch: override write_on_epoch_end."
        )

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.writes_on_batch:
            return
        indices = trainer.predict_loop.batch_indices(dataloader_idx, batch_idx)
        self.write_on_batch_end(trainer, pl_module, outputs, indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.writes_on_epoch:
            return
        loop = trainer.predict_loop
        self.write_on_epoch_end(trainer, pl_module, loop.predictions, loop.epoch_batch_indices)
