"""The type names Lightning programs annotate their hooks with (``lightning.pytorch.utilities.types``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, TypedDict, Union

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from trainer_core.optim import LRSchedulerConfig

#: What ``training_step`` and the other steps return: a loss tensor, a dict with ``"loss"``, or ``None``.
STEP_OUTPUT = Optional[Union[Tensor, Mapping[str, Any]]]
#: Anything the train loader hook may return: a loader, or a collection of them.
TRAIN_DATALOADERS = Any
EVAL_DATALOADERS = Any
#: What ``validate``/``test`` return (one dict per loader) and ``predict`` returns.
_EVALUATE_OUTPUT = list[Mapping[str, float]]
_PREDICT_OUTPUT = Union[list[Any], list[list[Any]]]

LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]
LRSchedulerType = Union[type[LRScheduler], type[ReduceLROnPlateau]]
LRSchedulerPLType = Union[LRScheduler, ReduceLROnPlateau]


class LRSchedulerConfigType(TypedDict, total=False):
    scheduler: LRSchedulerTypeUnion
    name: Optional[str]
    interval: str
    frequency: int
    reduce_on_plateau: bool
    monitor: Optional[str]
    strict: bool


class OptimizerConfig(TypedDict):
    optimizer: Optimizer


class OptimizerLRSchedulerConfig(TypedDict, total=False):
    optimizer: Optimizer
    lr_scheduler: Union[LRSchedulerTypeUnion, LRSchedulerConfigType]
    monitor: str


#: What ``configure_optimizers`` may return.
OptimizerLRScheduler = Optional[
    Union[
        Optimizer,
        Sequence[Optimizer],
        tuple[Sequence[Optimizer], Sequence[Union[LRSchedulerTypeUnion, LRSchedulerConfig]]],
        OptimizerConfig,
        OptimizerLRSchedulerConfig,
        Sequence[OptimizerConfig],
        Sequence[OptimizerLRSchedulerConfig],
    ]
]

__all__ = [
    "EVAL_DATALOADERS",
    "STEP_OUTPUT",
    "TRAIN_DATALOADERS",
    "LRSchedulerConfig",
    "LRSchedulerConfigType",
    "LRSchedulerPLType",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "OptimizerConfig",
    "OptimizerLRScheduler",
    "OptimizerLRSchedulerConfig",
]
