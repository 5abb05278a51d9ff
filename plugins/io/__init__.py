"""Checkpoint IO plugins: how checkpoints are written to and read from storage."""

from __future__ import annotations

from trainer_core.plugins.io.async_io import AsyncCheckpointIO
from trainer_core.plugins.io.checkpoint_io import COMMIT_MARKER_SUFFIX, CheckpointIO
from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
from trainer_core.plugins.io.torch_io import TorchCheckpointIO

__all__ = [
    "COMMIT_MARKER_SUFFIX",
    "AsyncCheckpointIO",
    "CheckpointIO",
    "DistributedCheckpointIO",
    "TorchCheckpointIO",
]
