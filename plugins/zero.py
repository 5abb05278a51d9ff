"""``ZeroPlugin``: DDP with torch's ``ZeroRedundancyOptimizer`` sharding the optimizer state."""

from __future__ import annotations

from typing import Any

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from trainer_core.plugins.base import optimizer_defaults
from trainer_core.plugins.ddp import DDPPlugin


class ZeroPlugin(DDPPlugin):
    """Every rank keeps the optimizer state of its share of the parameters; DDP reduces gradients.

    Other keyword arguments are ``DDPPlugin``'s, with those it passes on to ``DistributedDataParallel``.
    """

    name = "zero"

    def __init__(self, *args: Any, parameters_as_bucket_view: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parameters_as_bucket_view = parameters_as_bucket_view

    def wrap_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if isinstance(optimizer, ZeroRedundancyOptimizer) or self.world_size == 1:
            return optimizer
        return ZeroRedundancyOptimizer(
            optimizer.param_groups,
            optimizer_class=type(optimizer),
            parameters_as_bucket_view=self.parameters_as_bucket_view,
            **optimizer_defaults(optimizer),
        )
