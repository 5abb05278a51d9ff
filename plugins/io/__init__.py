"""Checkpoint IO plugins: how checkpoints are written to and read from storage.

Each IO class writes and reads its own kind of checkpoint; ``readers`` says what a path holds and
hands it to the reader of that kind, registered here. ``DistributedCheckpointIO`` is imported on
first use: it brings in ``torch.distributed.checkpoint`` and DTensor, most of a second that every
process (each rank, each CLI call) would pay otherwise; ``AsyncCheckpointIO`` and
``FrozenBlobCheckpointIO`` are too (a few milliseconds of every Trainer's start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer_core.plugins.io.checkpoint_io import COMMIT_MARKER_SUFFIX, CheckpointIO, WrappingCheckpointIO
from trainer_core.plugins.io.readers import FILE, SHARDED, register_reader
from trainer_core.plugins.io.torch_io import TorchCheckpointIO
from trainer_core.utilities.lazy import lazy_attributes

if TYPE_CHECKING:
    from trainer_core.plugins.io.async_io import AsyncCheckpointIO
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
    from trainer_core.plugins.io.frozen_io import FrozenBlobCheckpointIO

__all__ = [
    "COMMIT_MARKER_SUFFIX",
    "AsyncCheckpointIO",
    "CheckpointIO",
    "DistributedCheckpointIO",
    "FrozenBlobCheckpointIO",
    "TorchCheckpointIO",
    "WrappingCheckpointIO",
]


#: Imported on first use too: a Trainer that saves with the default IO never loads them.
_LAZY = {
    "AsyncCheckpointIO": "async_io",
    "DistributedCheckpointIO": "distributed_io",
    "FrozenBlobCheckpointIO": "frozen_io",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


def _distributed_checkpoint_io(storage_options: dict[str, Any]) -> DistributedCheckpointIO:
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

    return DistributedCheckpointIO(storage_options)


register_reader(FILE, TorchCheckpointIO)
register_reader(SHARDED, _distributed_checkpoint_io)
