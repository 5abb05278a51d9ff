"""Training-type plugins: everything about processes, devices, wrapping and collectives."""

from __future__ import annotations

from typing import Any

from trainer_core.plugins.base import TrainingTypePlugin
from trainer_core.plugins.ddp import DDPPlugin
from trainer_core.plugins.environments import (
    ClusterEnvironment,
    LocalEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from trainer_core.plugins.io import (
    AsyncCheckpointIO,
    CheckpointIO,
    DistributedCheckpointIO,
    TorchCheckpointIO,
)
from trainer_core.plugins.registry import available_plugins, plugin_from_name, register_plugin
from trainer_core.plugins.single_device import SingleDevicePlugin

__all__ = [
    "AsyncCheckpointIO",
    "CheckpointIO",
    "ClusterEnvironment",
    "DDPPlugin",
    "DDPShardedPlugin",
    "DistributedCheckpointIO",
    "FSDPPlugin",
    "LocalEnvironment",
    "PipelinePlugin",
    "SLURMEnvironment",
    "SingleDevicePlugin",
    "TorchCheckpointIO",
    "TorchElasticEnvironment",
    "TrainingTypePlugin",
    "ZeroPlugin",
    "available_plugins",
    "plugin_from_name",
    "register_plugin",
]

# Named in DESIGN.md's public API and built by later work; importing it says so clearly.
_PLANNED: set[str] = set()


def __getattr__(name: str) -> Any:
    # Imported on first use: DDPShardedPlugin needs fairscale, which is an optional extra.
    if name == "DDPShardedPlugin":
        from trainer_core.plugins.sharded import DDPShardedPlugin

        return DDPShardedPlugin
    if name == "FSDPPlugin":
        from trainer_core.plugins.fsdp import FSDPPlugin

        return FSDPPlugin
    if name == "ZeroPlugin":
        from trainer_core.plugins.zero import ZeroPlugin

        return ZeroPlugin
    if name == "PipelinePlugin":
        from trainer_core.plugins.pipeline import PipelinePlugin

        return PipelinePlugin
    if name in _PLANNED:
        raise ImportError(
            f"trainer_core.plugins.{name} is not available in this version of trainer-core yet."
        )
    raise AttributeError(f"module 'trainer_core.plugins' has no attribute {name!r}")
