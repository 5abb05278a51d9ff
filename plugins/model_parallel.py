"""``ModelParallelPlugin``: tensor parallel x FSDP2 (x pipeline) on one device mesh.

Lightning's ``ModelParallelStrategy`` conventions: the module's ``configure_model`` applies tensor
parallelism with ``parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)`` and may
call ``fully_shard`` itself (over ``self.device_mesh["data_parallel"]``); when it does not, the
plugin shards the root over the data-parallel dimension. The ranks of one tensor-parallel group
read the same batches; the data is split by data-parallel rank only.

With ``pipeline_parallel_size > 1`` the model is also cut into pipeline stages, each of them
tensor-parallel inside (torchtitan's 3-D layout): that is ``PipelineModelParallelPlugin``, a
``PipelinePlugin`` over the same mesh (``plugins/pipeline/model_parallel.py``), which
:func:`model_parallel_plugin` and the registry's ``"model_parallel"`` pick for those sizes.

Checkpoints keep the name-keyed format of every plugin: a sharded folder (the default, every rank
writes its own shards through ``torch.distributed.checkpoint``) or one full file
(``save_distributed_checkpoint=False``), and either loads under any other layout or plugin.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.environments import ClusterEnvironment
from trainer_core.plugins.fsdp import FSDPPlugin
from trainer_core.plugins.parallel import (
    DEFAULT_TIMEOUT,
    is_random_sampler,
    with_distributed_sampler,
)
from trainer_core.plugins.parallel_dims import DATA, TENSOR, ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trainer_core.module import LightningModule
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.plugins.parallel import ParallelPlugin
    from trainer_core.trainer import Trainer

Size = Union[int, str]


def model_parallel_plugin(pipeline_parallel_size: int = 1, **kwargs: Any) -> ParallelPlugin:
    """``ModelParallelPlugin``, or ``PipelineModelParallelPlugin`` when ``pipeline_parallel_size > 1``.

    The registry's ``"model_parallel"``: one name for every layout of tensor x data (x pipeline)
    parallelism, each class with its own real signature.
    """
    if isinstance(pipeline_parallel_size, int) and not isinstance(pipeline_parallel_size, bool):
        if pipeline_parallel_size > 1:
            from trainer_core.plugins.pipeline import PipelineModelParallelPlugin

            return PipelineModelParallelPlugin(pipeline_parallel_size=pipeline_parallel_size, **kwargs)
    return ModelParallelPlugin(pipeline_parallel_size=pipeline_parallel_size, **kwargs)


def check_sizes(owner: str, dp: Size, tp: Size, pp: int) -> None:
    """Refuse a size that is neither a positive integer nor ``"auto"``, naming the argument."""
    for name, value in (("data_parallel_size", dp), ("tensor_parallel_size", tp)):
        if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise MisconfigurationException(f"{owner}({name}={value!r}): use a positive integer or 'auto'.")
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise MisconfigurationException(f"{owner}(pipeline_parallel_size={pp!r}): use a positive integer.")


def resolve_sizes(
    owner: str, world_size: int, devices_per_node: int, dp: Size, tp: Size, pp: int
) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` with ``"auto"`` filled in as Lightning does: tensor parallel inside a node, data across."""
    check_sizes(owner, dp, tp, pp)
    if tp == "auto" and dp == "auto":
        tp = max(1, devices_per_node // pp) if devices_per_node % pp == 0 else 1
    if tp == "auto":
        tp = world_size // (int(dp) * pp) if world_size % (int(dp) * pp) == 0 else 0
    if dp == "auto":
        dp = world_size // (int(tp) * pp) if world_size % (int(tp) * pp) == 0 else 0
    if not dp or not tp or int(dp) * int(tp) * pp != world_size:
        raise MisconfigurationException(
            f"{owner}(data_parallel_size={dp or '?'}, tensor_parallel_size={tp or '?'}, "
            f"pipeline_parallel_size={pp}): the sizes must multiply to the {world_size} processes of the run "
            "(devices x num_nodes); change the sizes or the number of devices."
        )
    return int(dp), int(tp), pp


class ModelParallelPlugin(FSDPPlugin):
    """Tensor parallelism (the module's ``configure_model``) with FSDP2 over the data-parallel ranks.

    Args:
        data_parallel_size: ranks that see different batches (FSDP shards over them); ``"auto"``: the
            number of nodes, or whatever the other sizes leave.
        tensor_parallel_size: ranks that split each layer; ``"auto"``: the devices of a node (divided by
            the pipeline size), or whatever the other sizes leave.
        pipeline_parallel_size: pipeline stages: 1 here; above 1 use ``PipelineModelParallelPlugin`` (same
            arguments; ``split_points``, ``schedule`` and ``n_microbatches`` as for ``PipelinePlugin``), or
            :func:`model_parallel_plugin`, which picks the class from the sizes.
        save_distributed_checkpoint: ``True`` (default) writes a folder of shards, every rank its own;
            ``False`` one full file, gathered to rank 0.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` (parameter and reduction dtypes).
        reshard_after_forward: FSDP2's option of the same name.
        start_method, process_group_backend, timeout, cluster_environment, checkpoint_io: as for every
            multi-process plugin (``ParallelPlugin``).
    """

    name = "model_parallel"

    def __init__(
        self,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        pipeline_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        reshard_after_forward: bool = True,
        split_points: Sequence[str] = (),
        schedule: str = "1F1B",
        n_microbatches: Optional[int] = None,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
    ) -> None:
        super().__init__(
            mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward,
            state_dict_type="sharded" if save_distributed_checkpoint else "full",
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
        )
        check_sizes("ModelParallelPlugin", data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        if pipeline_parallel_size > 1:
            raise MisconfigurationException(
                f"ModelParallelPlugin(pipeline_parallel_size={pipeline_parallel_size}): pipeline stages that are "
                "tensor-parallel inside are PipelineModelParallelPlugin, which takes the same arguments: "
                "`from trainer_core.plugins import PipelineModelParallelPlugin`, or "
                f"Trainer(plugins='model_parallel', ...) with pipeline_parallel_size={pipeline_parallel_size} in the "
                "plugin's arguments (the registry picks it)."
            )
        if split_points:
            raise MisconfigurationException(
                f"ModelParallelPlugin(split_points={list(split_points)!r}) cuts pipeline stages, which needs "
                "pipeline_parallel_size > 1."
            )
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint

    # ------------------------------------------------------------------ layout
    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None or self._dims.world_size != self.world_size:
            dp, tp, pp = resolve_sizes(
                "ModelParallelPlugin",
                self.world_size,
                self._num_devices,
                self.data_parallel_size,
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
            )
            self._dims = ParallelDims(self.world_size, tp=tp, pp=pp, dp_shard=dp, owner="ModelParallelPlugin")
        return self._dims

    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        super().configure_devices(device_type, num_devices, num_nodes)
        self.parallel_dims  # noqa: B018 - sizes that do not fit the world fail here, before any process starts

    @property
    def device_mesh(self) -> DeviceMesh:
        """The whole mesh: ``("pipeline_parallel", "data_parallel", "tensor_parallel")``."""
        return self.parallel_dims.build_mesh(self.root_device.type)

    def _sharding_mesh(self) -> DeviceMesh:
        self.device_mesh  # noqa: B018
        return self.parallel_dims.sharding_mesh()

    @property
    def metrics_group(self) -> Optional[Any]:
        """The data-parallel ranks: tensor-parallel ranks share a batch, so they count once."""
        if self.world_size == 1:
            return None
        return self.parallel_dims.submesh(DATA).get_group()

    # ------------------------------------------------------------------ setup
    # FSDPPlugin.setup_environment builds the mesh (a collective) and sets it as module.device_mesh.
    def configuring_model(self) -> contextlib.AbstractContextManager:
        return refuse_skipped_plan_entries(self._lightning_module)

    def setup(self, trainer: Trainer) -> None:
        check_tensor_parallel_applied(self._lightning_module, self.parallel_dims.tp, "ModelParallelPlugin")
        super().setup(trainer)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        """Each data-parallel rank its own part; the ranks of a tensor-parallel group the same batches, in the same order."""
        from torch.utils.data import DataLoader

        if not use_distributed_sampler or self.world_size == 1 or not isinstance(dataloader, DataLoader):
            return dataloader
        split = self.distributed_sampler_kwargs
        # A shuffled order must come from a seed shared by the group, not from each rank's own RNG.
        if split["num_replicas"] > 1 or is_random_sampler(dataloader.sampler):
            return with_distributed_sampler(dataloader, kind, **split)
        return dataloader


@contextlib.contextmanager
def refuse_skipped_plan_entries(module: Optional[LightningModule]) -> Iterator[None]:
    """Around ``configure_model``: a tensor-parallel plan entry that matches no submodule is an error.

    torch's ``parallelize_module`` only warns and skips such an entry, and the run would then train
    the layer replicated, without a word. Every rank runs the same ``configure_model``, so every rank
    raises, and none is left waiting in a collective.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    skipped = [str(w.message) for w in caught if str(w.message).startswith(_SKIPPED_PLAN_ENTRY)]
    for w in caught:
        if not str(w.message).startswith(_SKIPPED_PLAN_ENTRY):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if skipped:
        # torch names the rest of the key it could not resolve and the module it looked in.
        head, _, where = skipped[0].partition(" in module ")
        where = where.split("(", 1)[0]
        raise MisconfigurationException(
            f"{type(module).__name__}.configure_model applied a tensor-parallel plan with an entry that matches no "
            f"submodule, which torch skips: {head}{f' in {where}' if where else ''}. Fix the plan's key (the names "
            "are relative to the module given to parallelize_module)."
        )


_SKIPPED_PLAN_ENTRY = "Parallelize plan key"


def check_tensor_parallel_applied(module: Optional[LightningModule], tp: int, owner: str) -> None:
    """Refuse a run whose ``configure_model`` did not apply the tensor parallelism it was given ranks for."""
    if module is None or tp == 1:
        return
    from torch.distributed.tensor import DTensor

    for param in module.parameters():
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if TENSOR in names and param.device_mesh.size(names.index(TENSOR)) > 1:
                return
    raise MisconfigurationException(
        f"{owner}(tensor_parallel_size={tp}): {type(module).__name__}.configure_model did not parallelize any "
        "parameter over the tensor-parallel mesh, so every tensor-parallel rank would hold and train the whole "
        "model on the same batch. Apply a plan in configure_model, e.g. "
        'parallelize_module(self.block, self.device_mesh["tensor_parallel"], {"w1": ColwiseParallel(), ...}), '
        "or set tensor_parallel_size=1."
    )
