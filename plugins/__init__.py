"""Training-type plugins: everything about processes, devices, wrapping and collectives."""

from __future__ import annotations

from trainer_core.plugins.base import TrainingTypePlugin
from trainer_core.plugins.ddp import DDPPlugin
from trainer_core.plugins.environments import (
    ClusterEnvironment,
    LocalEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from trainer_core.plugins.registry import available_plugins, plugin_from_name, register_plugin
from trainer_core.plugins.single_device import SingleDevicePlugin
from trainer_core.precision import Precision
from trainer_core.utilities.lazy import lazy_attributes

__all__ = [
    "AsyncCheckpointIO",
    "CheckpointIO",
    "ClusterEnvironment",
    "DDPPlugin",
    "DDPShardedPlugin",
    "DistributedCheckpointIO",
    "FSDPPlugin",
    "FaultTolerantDDPPlugin",
    "FrozenBlobCheckpointIO",
    "LocalEnvironment",
    "ModelParallelPlugin",
    "ParallelDims",
    "ParallelPlugin",
    "PipelineModelParallelPlugin",
    "PipelinePlugin",
    "Precision",
    "SLURMEnvironment",
    "SingleDevicePlugin",
    "TorchCheckpointIO",
    "TorchElasticEnvironment",
    "TrainingTypePlugin",
    "WrappingCheckpointIO",
    "ZeroPlugin",
    "available_plugins",
    "plugin_from_name",
    "register_plugin",
]

# Imported on first use: fairscale is an optional extra, and FSDP, the pipeline and
# torch.distributed.checkpoint cost most of a second to import, which every rank and CLI call would pay.
_LAZY = {
    "DDPShardedPlugin": "sharded",
    "FaultTolerantDDPPlugin": "ddp_ft",
    "FSDPPlugin": "fsdp",
    "ZeroPlugin": "zero",
    "PipelinePlugin": "pipeline",
    "PipelineModelParallelPlugin": "pipeline",
    "ModelParallelPlugin": "model_parallel",
    "ParallelPlugin": "parallel",
    "ParallelDims": "parallel_dims",
    "DistributedCheckpointIO": "io",
    "AsyncCheckpointIO": "io",
    "FrozenBlobCheckpointIO": "io",
    # The IO classes bring in fsspec (about 15 ms, most of it reading every installed package's entry
    # points); a Trainer that never saves or loads does not need them.
    "CheckpointIO": "io",
    "TorchCheckpointIO": "io",
    "WrappingCheckpointIO": "io",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
