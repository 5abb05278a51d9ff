"""``DDPShardedPlugin``: optimizer state sharded across ranks with fairscale ``OSS``.

Each rank keeps the optimizer state of its part of the parameters only; ``ShardedDataParallel``
reduces each gradient to the rank that owns it, which steps and broadcasts the new values. The
checkpoint still holds the full, name-keyed state: the base plugin's consolidation rule gathers
it to rank 0 when a checkpoint is written.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from trainer_core.imports import require_fairscale
from trainer_core.plugins.base import optimizer_defaults, wrapper_keywords
from trainer_core.plugins.ddp import DDPPlugin, _StepRouter


class DDPShardedPlugin(DDPPlugin):
    """DDP with fairscale ``OSS`` around the user's optimizers and ``ShardedDataParallel`` around the model.

    Keyword arguments other than ``DDPPlugin``'s own go to ``ShardedDataParallel``
    (``reduce_buffer_size``, ``broadcast_buffers``, ...).
    """

    name = "ddp_sharded"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_fairscale("DDPShardedPlugin")
        super().__init__(*args, **kwargs)

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

    def grad_scaler(self) -> Any:
        # Each gradient is reduced to the rank that owns it: only that rank can see its inf.
        return self.sharded_grad_scaler()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        from fairscale.nn.data_parallel import ShardedDataParallel

        model = self._model
        if isinstance(model, ShardedDataParallel):
            return model("training_step", *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def no_backward_sync(self) -> Any:
        from fairscale.nn.data_parallel import ShardedDataParallel

        model = self._model
        if isinstance(model, ShardedDataParallel):
            return model.no_sync()
        return super().no_backward_sync()

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: str) -> None:
        """The norm is global: ``OSS.clip_grad_norm`` adds up every rank's shard of it."""
        if algorithm == "norm" and hasattr(optimizer, "clip_grad_norm"):
            self.precision.unscale_gradients(optimizer)
            optimizer.clip_grad_norm(clip_val)
            return
        super().clip_gradients(optimizer, clip_val, algorithm)


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
