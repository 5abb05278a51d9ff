"""``ParallelDims``: one N-D layout of the ranks (pipeline x data x tensor) and the one mesh it builds.

Every plugin that splits the ranks along more than one axis describes its layout here and takes
its process groups from the one ``DeviceMesh`` this builds, so that "which ranks share a batch",
"which ranks hold a stage" and "which ranks average gradients" have a single answer.

Ranks are laid out pipeline-major, tensor-parallel fastest (torchtitan's order): with
``pp x dp x tp`` ranks, global rank ``r`` is pipeline rank ``r // (dp * tp)``, data-parallel rank
``(r // tp) % dp`` and tensor-parallel rank ``r % tp``. Tensor-parallel groups are therefore
neighbouring ranks (on one node, where the fast links are), as they should be.

The mesh always has the dimensions ``"pipeline_parallel"``, ``"data_parallel"`` and
``"tensor_parallel"`` (a dimension may have size 1), so a module's ``configure_model`` can index
``self.device_mesh["tensor_parallel"]`` under any layout. With hybrid sharding (``dp_replicate >
1``) the data-parallel dimension is two, ``"data_parallel_replicate"`` and ``"data_parallel_shard"``,
and ``"data_parallel"`` is their flattening, kept here (:meth:`ParallelDims.submesh`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PIPELINE = "pipeline_parallel"
DATA = "data_parallel"
DATA_REPLICATE = "data_parallel_replicate"
DATA_SHARD = "data_parallel_shard"
TENSOR = "tensor_parallel"


@dataclasses.dataclass
class ParallelDims:
    """How ``world_size`` ranks split into pipeline, data-parallel (replicated x sharded) and tensor-parallel groups.

    Args:
        world_size: the number of processes of the run.
        tp: tensor-parallel degree (ranks that split each layer's weights and see the same batch).
        pp: pipeline degree (ranks that hold different stages of the model).
        dp_replicate: data-parallel replicas (HSDP's replicate dimension; 1 for plain FSDP/DDP).
        dp_shard: ranks that shard the parameters (FSDP's dimension); ``-1``: whatever the others leave.
        owner: who asked for the layout, for error messages (``"ModelParallelPlugin"``).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    owner: str = "the plugin"
    _mesh: Optional[DeviceMesh] = dataclasses.field(default=None, repr=False, compare=False)
    _flat_dp: Optional[DeviceMesh] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp_replicate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MisconfigurationException(f"{self.owner}: {name}={value!r} must be a positive integer.")
        fixed = self.tp * self.pp * self.dp_replicate
        if self.dp_shard == -1:
            if self.world_size % fixed:
                raise MisconfigurationException(
                    f"{self.owner}: {self._sizes()} do not divide the {self.world_size} processes of the run; "
                    f"make devices x num_nodes a multiple of {fixed}, or change the sizes."
                )
            self.dp_shard = self.world_size // fixed
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise MisconfigurationException(
                f"{self.owner}: dp_shard={self.dp_shard!r} must be a positive integer or -1."
            )
        if fixed * self.dp_shard != self.world_size:
            raise MisconfigurationException(
                f"{self.owner}: {self._sizes()} make {fixed * self.dp_shard} processes, but the run has "
                f"{self.world_size} (devices x num_nodes); make the product of the sizes equal it."
            )

    def _sizes(self) -> str:
        parts = [f"pipeline {self.pp}", f"tensor {self.tp}", f"data-parallel replicas {self.dp_replicate}"]
        if self.dp_shard != -1:
            parts.append(f"data-parallel shards {self.dp_shard}")
        return "the parallel sizes (" + ", ".join(parts) + ")"

    # ------------------------------------------------------------------ degrees and ranks
    @property
    def dp(self) -> int:
        """All data-parallel ranks: replicas x shards (ranks that see different batches)."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank``: which share of the data its batches are."""
        return (rank // self.tp) % self.dp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits: its pipeline, data-parallel and tensor-parallel rank."""
        return {
            PIPELINE: rank // (self.dp * self.tp),
            DATA: self.dp_rank(rank),
            TENSOR: rank % self.tp,
        }

    def distributed_sampler_kwargs(self, rank: int) -> dict[str, int]:
        """``num_replicas``/``rank`` of global ``rank``'s ``DistributedSampler``: the data splits by data-parallel rank only.

        The ranks of a tensor-parallel group (and the stages of a pipeline) read the same batches.
        """
        return {"num_replicas": self.dp, "rank": self.dp_rank(rank)}

    @property
    def dim_names(self) -> tuple[str, ...]:
        if self.dp_replicate > 1:
            return (PIPELINE, DATA_REPLICATE, DATA_SHARD, TENSOR)
        return (PIPELINE, DATA, TENSOR)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dp_replicate > 1:
            return (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        return (self.pp, self.dp, self.tp)

    def describe(self) -> str:
        """``[pp=2, dp=2, tp=2]``, naming only the dimensions larger than 1."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        if self.dp_replicate > 1:
            sizes = {"pp": self.pp, "replicate": self.dp_replicate, "shard": self.dp_shard, "tp": self.tp}
        shown = [f"{k}={v}" for k, v in sizes.items() if v > 1]
        return "[" + (", ".join(shown) or "one process") + "]"

    # ------------------------------------------------------------------ the mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The one mesh of the run (built once; a collective the first time)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.dim_names)
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError(f"{self.owner}: the device mesh is built once the processes have started.")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh:
        """The mesh of one dimension (``"data_parallel"`` under hybrid sharding is the flattened pair)."""
        mesh = self.mesh
        if name == DATA and self.dp_replicate > 1:
            if self._flat_dp is None:
                self._flat_dp = mesh[DATA_REPLICATE, DATA_SHARD]._flatten(DATA)
            return self._flat_dp
        return mesh[name]

    def sharding_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes: the shard dimension, or (replicate, shard) under hybrid sharding."""
        if self.dp_replicate > 1:
            return self.mesh[DATA_REPLICATE, DATA_SHARD]
        return self.mesh[DATA]
