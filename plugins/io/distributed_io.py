"""``DistributedCheckpointIO``: a sharded checkpoint as a folder, every rank writing its own shards.

The tensors (model and optimizer state) go through ``torch.distributed.checkpoint`` (DCP): each
rank writes the shards it holds, in parallel, and DCP writes ``.metadata`` last, so a folder
without it is incomplete and never picked. Everything else (loops, callbacks, schedulers, every
rank's RNG, hyper-parameters) is small and is written first by rank 0 as ``trainer_state.pt``.

Loading at another world size reshards: the loading plugin hands a template of its own shards
(``load_into``) and DCP fills it. Any other plugin, or a process with no process group at all,
reads the folder as one full checkpoint (``load_checkpoint``), which is also what
``python -m trainer_core.checkpoint consolidate`` writes out.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Optional

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer_core import paths
from trainer_core.checkpoint import KEY_OPTIMIZER_STATES, KEY_STATE_DICT, safe_globals, validate_checkpoint
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike
from trainer_core.plugins.io.checkpoint_io import TEMP_INFIX, CheckpointIO

METADATA_FILE = ".metadata"
TRAINER_STATE_FILE = "trainer_state.pt"
_SHARDED_KEYS = (KEY_STATE_DICT, KEY_OPTIMIZER_STATES)


def is_sharded_checkpoint(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Whether ``path`` is a folder written by this IO (complete or not)."""
    fs, fs_path = paths.resolve(path, **(storage_options or {}))
    return fs.isdir(fs_path) and fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}")


class DistributedCheckpointIO(CheckpointIO):
    """Sharded checkpoints with ``torch.distributed.checkpoint``; every rank calls ``save_checkpoint``."""

    def __init__(self, storage_options: Optional[dict[str, Any]] = None) -> None:
        self._storage_options = dict(storage_options or {})

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        return paths.resolve(path, **self._storage_options)

    # ------------------------------------------------------------------ writing
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        """Write ``checkpoint`` as a folder; a collective: every rank calls it with its own shards."""

        url = os.fspath(path)
        fs, fs_path = self._resolve(url)
        local = paths.is_local(fs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        # A local folder is built under a temporary name and swapped in whole, so an existing
        # checkpoint of the same name stays readable until the new one is complete.
        target = (
            _agree(
                f"{os.path.dirname(fs_path)}/.{os.path.basename(fs_path)}{TEMP_INFIX}{uuid.uuid4().hex[:8]}"
            )
            if local
            else fs_path
        )
        sharded = {key: checkpoint[key] for key in _SHARDED_KEYS if key in checkpoint}
        rest = {key: value for key, value in checkpoint.items() if key not in _SHARDED_KEYS}
        try:
            if rank == 0:
                if not local and fs.exists(f"{fs_path}/{METADATA_FILE}"):
                    fs.rm(f"{fs_path}/{METADATA_FILE}")  # the old folder is no longer complete
                fs.makedirs(target, exist_ok=True)
                with fs.open(f"{target}/{TRAINER_STATE_FILE}", "wb") as f:
                    torch.save(rest, f)
            _barrier()
            writer = dcp.FileSystemWriter(target) if local else _fsspec_writer(url, self._storage_options)
            dcp.save(sharded, storage_writer=writer)
            _barrier()
            if rank == 0 and local:
                _swap_in(target, fs_path)
            _barrier()
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            if rank == 0 and local and os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            raise CheckpointError(f"could not write the sharded checkpoint {url}: {err}") from err

    def remove_checkpoint(self, path: PathLike) -> None:
        fs, fs_path = self._resolve(path)
        if not fs.exists(fs_path):
            return
        if fs.exists(f"{fs_path}/{METADATA_FILE}"):
            fs.rm(f"{fs_path}/{METADATA_FILE}")  # incomplete first, so a reader never picks half of it
        fs.rm(fs_path, recursive=True)

    # ------------------------------------------------------------------ reading
    def _check_complete(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        url = os.fspath(path)
        fs, fs_path = self._resolve(url)
        if not fs.exists(fs_path):
            raise CheckpointError(f"{url} does not exist; pass the folder of a sharded checkpoint.")
        if not fs.isdir(fs_path) or not fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}"):
            raise CheckpointError(
                f"{url} is not a sharded trainer-core checkpoint (no {TRAINER_STATE_FILE} in it)."
            )
        if not fs.exists(f"{fs_path}/{METADATA_FILE}"):
            raise CheckpointError(
                f"{url} is an incomplete sharded checkpoint: it has no {METADATA_FILE}, which is written last, so "
                "its save was interrupted. Use another checkpoint."
            )
        return fs, fs_path

    def load_trainer_state(self, path: PathLike) -> dict[str, Any]:
        """The non-tensor part of a sharded checkpoint (everything but model and optimizer tensors)."""
        fs, fs_path = self._check_complete(path)
        try:
            with (
                fs.open(f"{fs_path}/{TRAINER_STATE_FILE}", "rb") as f,
                torch.serialization.safe_globals(safe_globals()),
            ):
                state = torch.load(f, map_location="cpu", weights_only=True)
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise CheckpointError(f"{os.fspath(path)}/{TRAINER_STATE_FILE} could not be read: {err}") from err
        return state

    def load_into(self, path: PathLike, template: dict[str, Any]) -> dict[str, Any]:
        """Fill ``template`` (this run's own shards) from the folder, resharding as needed; a collective."""

        checkpoint = self.load_trainer_state(path)
        url = os.fspath(path)
        fs, fs_path = self._resolve(url)
        reader = (
            dcp.FileSystemReader(fs_path)
            if paths.is_local(fs)
            else _fsspec_reader(url, self._storage_options)
        )
        try:
            dcp.load(template, storage_reader=reader)
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise CheckpointError(f"{url}: its shards could not be loaded: {err}") from err
        checkpoint.update(template)
        validate_checkpoint(checkpoint, url)
        return checkpoint

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        """The whole checkpoint as full tensors, in this process, without a process group.

        A single-file checkpoint (written by any other plugin, or by FSDP with ``"full"``) is read
        too, so a sharded run can resume from one.
        """
        fs, fs_path = self._resolve(path)
        if fs.exists(fs_path) and not fs.isdir(fs_path):
            from trainer_core.plugins.io.torch_io import TorchCheckpointIO

            return TorchCheckpointIO(self._storage_options).load_checkpoint(path, map_location)
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        checkpoint = self.load_trainer_state(path)
        url = os.fspath(path)
        fs, fs_path = self._resolve(url)
        reader = (
            dcp.FileSystemReader(fs_path)
            if paths.is_local(fs)
            else _fsspec_reader(url, self._storage_options)
        )
        tensors: dict[str, Any] = {}
        try:
            _load_state_dict(
                tensors, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True
            )
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise CheckpointError(
                f"{url}: its shards could not be read (a shard missing or truncated?): {err}"
            ) from err
        checkpoint.update(tensors)
        if KEY_OPTIMIZER_STATES in checkpoint:
            checkpoint[KEY_OPTIMIZER_STATES] = _as_list(checkpoint[KEY_OPTIMIZER_STATES])
        if map_location is not None:
            checkpoint = _map(checkpoint, map_location)
        validate_checkpoint(checkpoint, url)
        return checkpoint


def _as_list(value: Any) -> list[Any]:
    """DCP stores a list as a dict keyed by index; give back the list."""
    if isinstance(value, dict) and all(str(k).isdigit() for k in value):
        return [value[k] for k in sorted(value, key=lambda k: int(k))]
    return list(value)


def _map(obj: Any, location: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(location)
    if isinstance(obj, dict):
        return {k: _map(v, location) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, location) for v in obj]
    return obj


def _agree(value: str) -> str:
    """Rank 0's ``value`` on every rank (a temporary folder name must be the same everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _swap_in(new: str, final: str) -> None:
    """Put the finished folder ``new`` at ``final``, replacing an older one with no gap a reader could see half of."""
    if not os.path.exists(final):
        os.replace(new, final)
        return
    old = f"{os.path.dirname(final)}/.{os.path.basename(final)}{TEMP_INFIX}old-{uuid.uuid4().hex[:8]}"
    os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _fsspec_writer(url: str, storage_options: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, **storage_options)


def _fsspec_reader(url: str, storage_options: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **storage_options)
