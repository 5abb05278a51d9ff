"""``PipelineModelParallelPlugin``: pipeline stages that are tensor-parallel inside (torchtitan's 3-D layout)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.parallel import DEFAULT_TIMEOUT
from trainer_core.plugins.pipeline.plugin import PipelinePlugin
from trainer_core.plugins.pipeline.split import MANUAL_SPLIT_ATTRIBUTE, declares_manual_split

if TYPE_CHECKING:
    from trainer_core.module import LightningModule


class PipelineModelParallelPlugin(PipelinePlugin):
    """``ModelParallelPlugin``'s layouts with ``pipeline_parallel_size > 1``: pipeline stages, tensor-parallel inside.

    Takes ``ModelParallelPlugin``'s arguments; ``Trainer(plugins="model_parallel")`` (and
    ``model_parallel_plugin``) build it when ``pipeline_parallel_size > 1``. The module
    declares its stages (``pipeline_manual_split = True``: its ``forward`` runs its layers as a chain)
    and applies its tensor-parallel plan in ``configure_model`` over ``self.device_mesh["tensor_parallel"]``,
    as for ``ModelParallelPlugin``; each rank then keeps the layers of its stages. Data-parallel
    replicas of a stage average their gradients after the backward, as under ``PipelinePlugin``.
    """

    name = "model_parallel"

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        pipeline_parallel_size: int = 2,
        save_distributed_checkpoint: bool = True,
        mixed_precision: Any = None,
        reshard_after_forward: bool = True,
        split_points: Sequence[str] = (),
        schedule: str = "1F1B",
        n_microbatches: Optional[int] = None,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
    ) -> None:
        from trainer_core.plugins.model_parallel import check_sizes

        check_sizes("ModelParallelPlugin", data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        if mixed_precision is not None or not reshard_after_forward:
            raise MisconfigurationException(
                f"PipelineModelParallelPlugin(pipeline_parallel_size={pipeline_parallel_size}) averages the gradients of "
                "data-parallel replicas itself instead of sharding with FSDP, so `mixed_precision` and "
                "`reshard_after_forward` (FSDP's options) do not apply; use Trainer(precision='bf16-mixed') for "
                "mixed precision."
            )
        if not split_points:
            raise MisconfigurationException(
                f"PipelineModelParallelPlugin(pipeline_parallel_size={pipeline_parallel_size}) needs `split_points`: the "
                "names of the layers that begin each stage after the first (e.g. split_points=['layers.2'])."
            )
        if save_distributed_checkpoint and checkpoint_io is None:
            from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

            checkpoint_io = DistributedCheckpointIO()
        super().__init__(
            split_points=split_points,
            schedule=schedule,
            n_microbatches=n_microbatches,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
        )
        self.requested_sizes = (data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._resolve_sizes(world_size=None)

    def _resolve_sizes(self, world_size: Optional[int]) -> None:
        from trainer_core.plugins.model_parallel import resolve_sizes

        dp, tp, pp = self.requested_sizes
        if world_size is None:
            # Until the world is known: as many ranks as the given sizes name (checked again then).
            world_size = (dp if isinstance(dp, int) else 1) * (tp if isinstance(tp, int) else 1) * pp
            self._num_devices = max(self._num_devices, world_size)
        dp, tp, pp = resolve_sizes("ModelParallelPlugin", world_size, self._num_devices, dp, tp, pp)
        self.data_parallel_size, self._tp = dp, tp
        self._dims = None

    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        super().configure_devices(device_type, num_devices, num_nodes)
        self._resolve_sizes(self.world_size)

    def connect(self, module: LightningModule) -> None:
        if self._tp > 1 and not declares_manual_split(module):
            raise MisconfigurationException(
                f"PipelineModelParallelPlugin(pipeline_parallel_size={self.pipeline_parallel_size}, tensor_parallel_size="
                f"{self._tp}) needs {type(module).__name__} to declare its stages (`{MANUAL_SPLIT_ATTRIBUTE} = True` "
                "on the class, its forward running its layers as a chain): the traced split runs the layers' "
                "tensors directly and would bypass the tensor-parallel plan of configure_model."
            )
        super().connect(module)

    @property
    def metrics_group(self) -> Optional[Any]:
        """None: every rank holds the same reported loss; user values are reduced over all ranks."""
        return None

    def configuring_model(self) -> contextlib.AbstractContextManager:
        from trainer_core.plugins.model_parallel import refuse_skipped_plan_entries

        return refuse_skipped_plan_entries(self._lightning_module)

    def _check_tensor_parallel(self, module: LightningModule) -> None:
        from trainer_core.plugins.model_parallel import check_tensor_parallel_applied

        check_tensor_parallel_applied(module, self._tp, "ModelParallelPlugin")
