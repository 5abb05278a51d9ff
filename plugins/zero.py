"""``ZeroPlugin``: DDP with torch's ``ZeroRedundancyOptimizer`` sharding the optimizer state."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from trainer_core.plugins.base import optimizer_defaults
from trainer_core.plugins.ddp import DDPPlugin
from trainer_core.plugins.parallel import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from trainer_core.plugins.environments import ClusterEnvironment
    from trainer_core.plugins.io import CheckpointIO


class ZeroPlugin(DDPPlugin):
    """Every rank keeps the optimizer state of its share of the parameters; DDP reduces gradients.

    Other keyword arguments are ``DDPPlugin``'s, with those it passes on to ``DistributedDataParallel``.
    """

    name = "zero"

    def __init__(
        self,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        parameters_as_bucket_view: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            start_method, process_group_backend, timeout, cluster_environment, checkpoint_io, **ddp_kwargs
        )
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
