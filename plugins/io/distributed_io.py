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

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any, Optional

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from trainer_core import paths
from trainer_core.checkpoint.files import (
    GuardedWriter,
    lock_temporary,
    remove_abandoned_temporaries,
    replace_entry,
    temporary_path,
)
from trainer_core.checkpoint.format import KEY_OPTIMIZER_STATES, KEY_STATE_DICT, validate_checkpoint
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike
from trainer_core.plugins.io.checkpoint_io import CheckpointIO
from trainer_core.plugins.io.readers import (
    METADATA_FILE,
    SHARDED,
    SHARDED_COMMIT_FILES,
    TRAINER_STATE_FILE,
    is_sharded_checkpoint,
    is_sharded_file_name,
    read_checkpoint,
)
from trainer_core.plugins.io.sharded_reader import (
    SHARD_IO_THREADS,
    SafeEmptyLoadPlanner,
    SafeLoadPlanner,
    check_complete,
    describe_failure,
    load_trainer_state,
    open_reader,
    restore_empty_containers,
    shard_error,
)

# Also imported from here, where they were first.
__all__ = [
    "METADATA_FILE",
    "SHARDED_COMMIT_FILES",
    "SHARD_IO_THREADS",
    "TRAINER_STATE_FILE",
    "DistributedCheckpointIO",
    "is_sharded_checkpoint",
    "is_sharded_file_name",
]

_SHARDED_KEYS = (KEY_STATE_DICT, KEY_OPTIMIZER_STATES)


class DistributedCheckpointIO(CheckpointIO):
    """Sharded checkpoints with ``torch.distributed.checkpoint``; every rank calls ``save_checkpoint``."""

    reads = SHARDED

    def __init__(self, storage_options: Optional[dict[str, Any]] = None) -> None:
        self._storage_options = dict(storage_options or {})

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        return paths.resolve(path, **self._storage_options)

    def folder_commit_files(self) -> tuple[str, ...]:
        return SHARDED_COMMIT_FILES

    def owns_folder_file(self, name: str) -> bool:
        return is_sharded_file_name(name)

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
        target = _agree(temporary_path(fs_path)) if local else fs_path
        sharded = {key: checkpoint[key] for key in _SHARDED_KEYS if key in checkpoint}
        rest = {key: value for key, value in checkpoint.items() if key not in _SHARDED_KEYS}
        held: Optional[int] = None  # rank 0's lock on the local temporary folder
        try:
            if rank == 0:
                if not local and fs.exists(f"{fs_path}/{METADATA_FILE}"):
                    fs.rm(f"{fs_path}/{METADATA_FILE}")  # the old folder is no longer complete
                if local:
                    # What a writer killed mid-save left here; then our own folder, locked while in use.
                    remove_abandoned_temporaries(os.path.dirname(fs_path))
                fs.makedirs(target, exist_ok=True)
                if local:
                    held = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
                    lock_temporary(held)
                with fs.open(f"{target}/{TRAINER_STATE_FILE}", "wb") as f:
                    guarded = GuardedWriter(f, max_piece=None)
                    torch.save(rest, guarded)
                    guarded.raise_error()
            _barrier()
            writer = dcp.FileSystemWriter(target) if local else _fsspec_writer(url, self._storage_options)
            writer.fs = _GuardedStreams(
                writer.fs
            )  # a failed write raises its own error, not torch's "unexpected pos"
            dcp.save(sharded, storage_writer=writer, no_dist=not _distributed())
            _barrier()
            if rank == 0 and local:
                # Also over a ``save_last="link"`` symlink, which a folder cannot be renamed over.
                replace_entry(target, fs_path, is_sharded_file_name)
            _barrier()
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            if rank == 0 and local and os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            raise CheckpointError(
                f"Could not write the sharded checkpoint {url}: {describe_failure(err)}. Other "
                "checkpoints are unchanged; fix the cause (space, permissions, credentials) and save again."
            ) from err
        finally:
            if held is not None:
                os.close(held)

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove the sharded checkpoint at ``path``: the files DCP and this IO wrote there, by name.

        ``.metadata`` goes first, so a reader never picks half a folder. Any other entry (a file put
        there by hand, a symlink, a subfolder) is kept, and so is the folder then, with a warning; an
        empty folder is removed. A link at ``path`` (``save_last="link"``) is removed as a link, its
        target left as it is. A single-file checkpoint is removed as :class:`TorchCheckpointIO` does.
        """
        fs, fs_path = self._resolve(path)
        if paths.is_local(fs) and os.path.islink(fs_path):
            os.remove(fs_path)
            return
        if not fs.exists(fs_path):
            return
        if fs.isdir(fs_path):
            self._remove_folder(fs, fs_path, os.fspath(path))
        else:
            self._remove_file(fs, fs_path)

    # ------------------------------------------------------------------ reading
    def load_trainer_state(self, path: PathLike) -> dict[str, Any]:
        """The non-tensor part of a sharded checkpoint (everything but model and optimizer tensors)."""
        return load_trainer_state(path, self._storage_options)

    def stored_keys(self, path: PathLike) -> set[str]:
        """The flattened keys (``optimizer_states.0.state.net.0.weight.exp_avg``) the folder holds tensors or values for."""
        check_complete(*self._resolve(path), os.fspath(path))
        return set(open_reader(path, self._storage_options).read_metadata().state_dict_metadata)

    def load_into(self, path: PathLike, template: dict[str, Any]) -> dict[str, Any]:
        """Fill ``template`` (this run's own shards) from the folder, resharding as needed; a collective."""

        checkpoint = self.load_trainer_state(path)
        url = os.fspath(path)
        reader = open_reader(url, self._storage_options)
        try:
            planner = SafeLoadPlanner()
            planner.display = url
            dcp.load(template, storage_reader=reader, planner=planner)
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise (reader.refusal or shard_error(url, err)) from err
        checkpoint.update(template)
        validate_checkpoint(checkpoint, url)
        return checkpoint

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        """The whole checkpoint as full tensors, in this process, without a process group.

        A single-file checkpoint (written by any other plugin, or by FSDP with ``"full"``) is read
        too, by its own reader (see :mod:`~trainer_core.plugins.io.readers`), so a sharded run can
        resume from one.
        """
        return read_checkpoint(self, path, map_location, self._storage_options)

    def _read(self, path: PathLike, map_location: Optional[Any]) -> dict[str, Any]:
        """The sharded folder at ``path`` as full tensors, read and validated."""
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        checkpoint = self.load_trainer_state(path)
        url = os.fspath(path)
        reader = open_reader(url, self._storage_options)
        tensors: dict[str, Any] = {}
        try:
            planner = SafeEmptyLoadPlanner()
            planner.display = url
            _load_state_dict(tensors, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise (reader.refusal or shard_error(url, err)) from err
        checkpoint.update(tensors)
        restore_empty_containers(checkpoint)
        if map_location is not None:
            checkpoint = _map(checkpoint, map_location)
        validate_checkpoint(checkpoint, url)
        return checkpoint


class _GuardedStreams:
    """A DCP filesystem whose write streams keep the first write error and raise it once DCP is done.

    ``torch.save`` inside DCP turns an error raised by ``write`` (disk full, connection reset) into
    an unrelated ``RuntimeError("unexpected pos ...")``; the guard hands back the real cause.
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        #: Every write error, from any of DCP's writer threads: an extra thread's exception ends
        #: only that thread, so :class:`_CheckedFsspecWriter` raises the first one for the rank.
        self.errors: list[BaseException] = []

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if not any(ch in mode for ch in "wa+"):
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self._fs.create_stream(path, mode) as stream:  # an upload is sent when this closes
                guarded = _GuardedStream(stream)
                yield guarded
                guarded.raise_error()
        except BaseException as err:
            self.errors.append(err)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class _GuardedStream(GuardedWriter):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream, max_piece=None)

    def __getattr__(self, name: str) -> Any:  # tell, fileno, ...
        return getattr(self._file, name)


def _map(obj: Any, location: Any) -> Any:
    """``map_location`` applied to a folder's tensors, which DCP reads to the CPU: a device or its name moves them;
    a dict or a ``(storage, location)`` callable (``torch.load``'s forms) is asked about location ``"cpu"``."""
    if isinstance(obj, torch.Tensor):
        if isinstance(location, dict):
            target = location.get("cpu")
            return obj if target is None else obj.to(target)
        if callable(location):
            moved = location(obj, "cpu")
            return obj if moved is None else moved
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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _CheckedFsspecWriter(FsspecWriter):
    """DCP's fsspec writer, failing the rank when any of its writer threads failed.

    With ``thread_count > 1`` DCP writes files in extra threads whose exceptions it never collects:
    the rank would report success with shards missing, and ``.metadata`` (which completes the folder)
    would be written over a torn checkpoint. Raising here fails the save on every rank instead.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        errors = getattr(self.fs, "errors", None)
        if errors:
            raise errors[0]
        return written


def _fsspec_writer(url: str, storage_options: dict[str, Any]) -> Any:
    # Each rank splits its shards into SHARD_IO_THREADS files written by as many threads: every rank
    # and every thread uploads at once (one s3fs upload per file).
    return _CheckedFsspecWriter(url, thread_count=SHARD_IO_THREADS, **storage_options)
