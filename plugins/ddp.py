"""``DDPPlugin``: data parallelism with ``DistributedDataParallel``; gloo on CPU, nccl on CUDA.

Every rank holds the whole model; DDP averages gradients during the backward. The training step
goes through the DDP wrapper (which is what makes the gradient hooks fire); validation, test and
prediction call the module directly, so they add no collective. Nothing else runs a collective
on the step: metrics are reduced only when ``self.log(..., sync_dist=True)`` asks for it.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainer_core.plugins.base import wrapper_keywords
from trainer_core.plugins.environments import ClusterEnvironment
from trainer_core.plugins.parallel import (
    DEFAULT_TIMEOUT,
    ParallelPlugin,
    UnrepeatedDistributedSampler,
    batch_norm_layers,
    is_random_sampler,
    warn_if_batch_norm,
    with_distributed_sampler,
)

if TYPE_CHECKING:
    from trainer_core.plugins.io import CheckpointIO

# The data-parallel helpers live with ParallelPlugin; they stay importable from here.
__all__ = [
    "DEFAULT_TIMEOUT",
    "DDPPlugin",
    "UnrepeatedDistributedSampler",
    "batch_norm_layers",
    "is_random_sampler",
    "warn_if_batch_norm",
    "with_distributed_sampler",
]


class _StepRouter(nn.Module):
    """Lets DDP's ``forward`` run a named step of the LightningModule (``training_step``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, step: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, step)(*args, **kwargs)


class DDPPlugin(ParallelPlugin):
    """``DistributedDataParallel`` over ``devices`` processes per node.

    Keyword arguments other than the plugin's own go to ``DistributedDataParallel``
    (``find_unused_parameters=True``, ``static_graph=True``, ``gradient_as_bucket_view=True``, ...);
    names it does not take are refused here, when the plugin is built.
    """

    name = "ddp"
    optimizer_in_backward_unsupported = (
        "a parameter's gradient hook fires before DistributedDataParallel has all-reduced that gradient, so each "
        "rank would step on its own local gradient and the replicas would drift apart. Use FSDPPlugin (its hook "
        "fires on the reduced, sharded gradient) or SingleDevicePlugin"
    )

    def __init__(
        self,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
        )
        self._ddp_kwargs = ddp_kwargs

    @classmethod
    def _wrapper_arguments(cls) -> tuple[str, list[str]]:
        # The plugin gives DDP the module and its one device per process.
        return "DistributedDataParallel", wrapper_keywords(
            DistributedDataParallel.__init__, set_by_plugin=("module", "device_ids")
        )

    def _running_stats_note(self) -> str:
        """What becomes of BatchNorm's running statistics across ranks under this plugin."""
        # Newer torch names it forward_sync_buffers (which wins); broadcast_buffers=None means True.
        synced = self._ddp_kwargs.get("forward_sync_buffers")
        if synced is None:
            synced = self._ddp_kwargs.get("broadcast_buffers")
        if synced is not None and not synced:
            return (
                "with broadcast_buffers=False every rank keeps running statistics of its own samples, and the "
                "checkpoint holds rank 0's"
            )
        return (
            "the wrapper broadcasts rank 0's buffers at every training forward, so the running statistics "
            "(and so the checkpoint's) follow rank 0's samples only"
        )

    def wrap_model(self, module: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return module
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(_StepRouter(module), device_ids=device_ids, **self._ddp_kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model
        if isinstance(model, DistributedDataParallel):
            return model("training_step", *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def _gradient_sync_pause(self) -> Optional[contextlib.AbstractContextManager]:
        model = self._model
        return model.no_sync() if isinstance(model, DistributedDataParallel) else None

    def backward(self, loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        model = self._model
        module = self._lightning_module
        if (
            isinstance(model, DistributedDataParallel)
            and module is not None
            and not module.automatic_optimization
        ):
            _prepare_for_backward(model, loss)
        return super().backward(loss, optimizer, *args, **kwargs)


def _prepare_for_backward(model: DistributedDataParallel, loss: Tensor) -> None:
    """Ready DDP's reducer for one more backward of the same forward (manual optimization).

    A manual ``training_step`` (a GAN's) runs one forward through DDP and several backwards; each
    backward needs the reducer prepared, with the loss telling it which parameters took part.
    """
    if not (torch.is_grad_enabled() and model.require_backward_grad_sync):
        model.require_forward_param_sync = False
        return
    from torch.nn.parallel.distributed import _find_tensors

    model.require_forward_param_sync = True
    used = list(_find_tensors(loss)) if model.find_unused_parameters and not model.static_graph else []
    model.reducer._rebuild_buckets()
    model.reducer.prepare_for_backward(used)
