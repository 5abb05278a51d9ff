"""``DDPShardedPlugin``: optimizer state sharded across ranks with fairscale ``OSS``.

Each rank keeps the optimizer state of its part of the parameters only; ``ShardedDataParallel``
reduces each gradient to the rank that owns it, which steps and broadcasts the new values. The
checkpoint still holds the full, name-keyed state: the base plugin's consolidation rule gathers
it to rank 0 when a checkpoint is written.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer_core.imports import require_fairscale
from trainer_core.plugins.base import optimizer_defaults, wrapper_keywords
from trainer_core.plugins.ddp import DDPPlugin, _StepRouter
from trainer_core.plugins.parallel import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from trainer_core.plugins.environments import ClusterEnvironment
    from trainer_core.plugins.io import CheckpointIO


class DDPShardedPlugin(DDPPlugin):
    """DDP with fairscale ``OSS`` around the user's optimizers and ``ShardedDataParallel`` around the model.

    Keyword arguments other than ``DDPPlugin``'s own go to ``ShardedDataParallel``
    (``reduce_buffer_size``, ``broadcast_buffers``, ...).
    """

    name = "ddp_sharded"
    # Each gradient is reduced to the rank that owns it: only that rank can see its inf.
    holds_partial_gradients = True
    ddp_comm_hook_unsupported = (
        "ShardedDataParallel reduces each gradient to the rank that owns it and takes no communication hook; "
        "use DDPPlugin or ZeroPlugin for a hook"
    )

    def __init__(
        self,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        **sharded_kwargs: Any,
    ) -> None:
        require_fairscale("DDPShardedPlugin")
        super().__init__(
            start_method, process_group_backend, timeout, cluster_environment, checkpoint_io, **sharded_kwargs
        )

    @classmethod
    def _wrapper_arguments(cls) -> tuple[str, list[str]]:
        require_fairscale("DDPShardedPlugin")
        from fairscale.nn.data_parallel import ShardedDataParallel

        # The plugin gives it the module and the OSS optimizers it builds.
        return "ShardedDataParallel", wrapper_keywords(
            ShardedDataParallel.__init__, set_by_plugin=("module", "sharded_optimizer")
        )

    def wrap_optimizer(self, optimizer: Optimizer) -> Optimizer:
        from fairscale.optim import OSS

        if not isinstance(optimizer, OSS):
            # The same param-group dicts: a scheduler that changes the user's learning rate changes OSS's.
            optimizer = OSS(
                params=optimizer.param_groups, optim=type(optimizer), **optimizer_defaults(optimizer)
            )
            # Never float16 broadcasts (Lightning sets them under 16-mixed): OSS rounds the owner's own
            # weights through the float16 bucket too, so the float32 master weights become float16 ones.
            optimizer.broadcast_fp16 = False
        if self._ddp_kwargs.get("reduce_buffer_size", 0) > 0:
            _zero_grads_in_place(optimizer)
        return optimizer

    def wrap_model(self, module: nn.Module) -> nn.Module:
        from fairscale.nn.data_parallel import ShardedDataParallel

        if not self.optimizers:
            return module
        # Per-parameter reduction by default: fairscale's bucketed reduction reads gradients from
        # buffers that any `zero_grad(set_to_none=True)` (torch's default) silently detaches.
        kwargs = {"reduce_buffer_size": 0, **self._ddp_kwargs}
        return ShardedDataParallel(_StepRouter(module), sharded_optimizer=self.optimizers, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        from fairscale.nn.data_parallel import ShardedDataParallel

        model = self._model
        if isinstance(model, ShardedDataParallel):
            return model("training_step", *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def _gradient_sync_pause(self) -> Optional[contextlib.AbstractContextManager]:
        from fairscale.nn.data_parallel import ShardedDataParallel

        model = self._model
        if isinstance(model, ShardedDataParallel):
            return model.no_sync()
        return super()._gradient_sync_pause()

    def _grad_norm_parts(self, optimizer: Optimizer) -> tuple[list[Tensor], Optional[Any]]:
        """The gradients of the partition this rank owns; every rank owns another (OSS's rule for the norm).

        ShardedDataParallel reduces each gradient to its owner only: the other ranks' copies are stale.
        """
        owned = getattr(optimizer, "_local_params", None)
        if owned is None or not dist.is_initialized() or self.world_size == 1:
            return super()._grad_norm_parts(optimizer)
        return [p.grad for p in owned if p.grad is not None], dist.group.WORLD


def _zero_grads_in_place(optimizer: Optimizer) -> None:
    """Make ``zero_grad`` keep the gradient tensors (``set_to_none=False``) on this optimizer.

    ShardedDataParallel reduces gradients out of bucket buffers that the ``.grad`` tensors are
    views of. torch >= 2.0 zeroes by setting ``.grad`` to ``None``; the next backward then writes
    fresh tensors outside the buckets and the reduction silently sends the stale buffers, so every
    rank would step on its local gradient only.
    """
    zero_grad = optimizer.zero_grad

    def zero_grad_in_place(set_to_none: bool = False) -> None:
        zero_grad(set_to_none=False)

    optimizer.zero_grad = zero_grad_in_place  # type: ignore[method-assign]
