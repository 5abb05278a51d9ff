"""``torch.save`` / ``torch.load`` checkpoints on any fsspec URL, written atomically and read safely.

Why each step is there:

* **Streaming.** ``torch.save`` writes straight into the open file (on object stores through a
  writer that hands it at most one upload part at a time), never into an in-memory ``BytesIO`` first:
  that copy doubles the host memory a save needs, which is what makes large checkpoints crash hosts.
* **Atomic.** On local disk the checkpoint goes to a temporary file in the same folder, is fsynced and
  renamed over the target, then the folder is fsynced: a crash leaves the old file or the new one.
  Object stores publish an upload only when it completes, so the object is written in place (the
  upload is aborted if the save fails) and a commit marker follows (see ``trainer_core.checkpoint.files``).
* **Safe reads.** ``torch.load(weights_only=True)`` with the format's few extra types allowed; a file
  that names anything else (``os.system``, an unknown class) is refused before anything runs
  (``torch_file``, shared with the sharded folder's reader). A sharded folder given here is read
  by its own reader, through the reader table (``readers``).
* **Clear errors.** Every failure becomes one :class:`~trainer_core.errors.CheckpointError` that names
  the file, says what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any, Optional

import fsspec
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from trainer_core.checkpoint.files import (
    MAX_UPLOAD_PARTS,
    MIN_UPLOAD_PART_BYTES,
    UPLOAD_PART_BYTES,
    GuardedWriter,
    fsync_dir,
    lock_temporary,
    remove_abandoned_temporaries,
    temporary_path,
    write_commit_marker,
)
from trainer_core.checkpoint.format import decode_byte_payloads, encode_byte_payloads, validate_checkpoint
from trainer_core.checkpoint.stream import save_torch_file
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.paths import PathLike, is_local, resolve
from trainer_core.plugins.io.checkpoint_io import CheckpointIO
from trainer_core.plugins.io.object_store import (
    DEFAULT_CONCURRENCY,
    ParallelMultipartUpload,
    TransferError,
    download_to_local,
    supports_parallel_upload,
)
from trainer_core.plugins.io.readers import (
    FILE,
    SHARDED_COMMIT_FILES,
    is_sharded_file_name,
    is_sharded_folder,
    read_checkpoint,
)
from trainer_core.plugins.io.torch_file import check_record_checksums, is_zip, load_torch_file
from trainer_core.utilities import rank_zero_warn


def _checkpoint_nbytes(checkpoint: Any) -> int:
    """Bytes of tensor data in ``checkpoint``, to size upload parts before anything is written."""
    if isinstance(checkpoint, torch.Tensor):
        return checkpoint.numel() * checkpoint.element_size()
    if isinstance(checkpoint, dict):
        return sum(_checkpoint_nbytes(value) for value in checkpoint.values())
    if isinstance(checkpoint, (list, tuple)):
        return sum(_checkpoint_nbytes(value) for value in checkpoint)
    return 0


class TorchCheckpointIO(CheckpointIO):
    """Saves with ``torch.save`` and loads with ``torch.load(weights_only=True)`` on any fsspec URL.

    Args:
        storage_options: passed to fsspec for every path (credentials, ``endpoint_url``, ...);
            ``save_checkpoint``'s own ``storage_options`` are merged over them.
        verify_checksums: before loading, check every record of the file against the CRC-32 that
            ``torch.save`` stored for it, so a bit flipped on disk or in transit is an error instead of
            silently wrong weights. ``torch.load`` itself does not check them. It costs a second read
            of the file (about +50% load time from the page cache; a second download on an object
            store), so it is off by default.
        mmap: read a local file by mapping it (``torch.load(mmap=True)``) instead of reading it whole:
            the tensors stay in the page cache, which every process on the node shares, so a rank of
            a sharded run adds to its private memory only what it copies out (its own shards).
            ``False`` reads the whole file into the process's memory (the earlier behaviour); use
            it on a mount that can fail mid-read (a fault on a mapped page kills the process with
            SIGBUS instead of raising an error). Files in torch's old, non-zip format are always read
            whole.
        transfer_concurrency: requests kept in flight per file on an object store (S3 through s3fs):
            a save streams ``torch.save`` into a multipart upload whose parts go up this many at a
            time, and a load downloads the file with this many ranged reads at once into a local
            temporary file (under ``TMPDIR``), which is then read like a local file (mapped with
            ``mmap``) and removed. Memory stays at about ``transfer_concurrency`` x 8 MiB (save) or
            x 16 MiB (load) whatever the checkpoint's size. ``1`` keeps the sequential transfer
            (one part after another, a streaming read), which needs no local disk space.
    """

    reads = FILE

    def __init__(
        self,
        storage_options: Optional[dict[str, Any]] = None,
        verify_checksums: bool = False,
        mmap: bool = True,
        transfer_concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if transfer_concurrency < 1:
            raise MisconfigurationException(
                f"TorchCheckpointIO(transfer_concurrency={transfer_concurrency!r}): use 1 (sequential) or more."
            )
        self.storage_options = dict(storage_options or {})
        self.verify_checksums = verify_checksums
        self.mmap = mmap
        self.transfer_concurrency = transfer_concurrency

    def _resolve(
        self, path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> tuple[fsspec.AbstractFileSystem, str]:
        return resolve(path, **{**self.storage_options, **(storage_options or {})})

    def folder_commit_files(self) -> tuple[str, ...]:
        # Any plugin resumes from a sharded folder (load_checkpoint reads it whole), so one is a
        # complete checkpoint here too.
        return SHARDED_COMMIT_FILES

    def owns_folder_file(self, name: str) -> bool:
        return is_sharded_file_name(name)

    # ---------------------------------------------------------------- save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        """Write ``checkpoint`` atomically; on failure the previous file at ``path`` is left as it was."""
        fs, fs_path = self._resolve(path, storage_options)
        checkpoint = encode_byte_payloads(checkpoint)
        try:
            if is_local(fs):
                self._save_local(checkpoint, fs, fs_path)
            else:
                self._save_object(checkpoint, fs, fs_path, self.transfer_concurrency)
        except Exception as err:
            raise CheckpointError(
                f"Could not save the checkpoint {os.fspath(path)}: {type(err).__name__}: {err}. "
                "The previous checkpoint at this path, if any, is unchanged; fix the cause (space, "
                "permissions, credentials) and save again."
            ) from err

    @staticmethod
    def _save_local(checkpoint: dict[str, Any], fs: fsspec.AbstractFileSystem, fs_path: str) -> None:
        parent = os.path.dirname(fs_path)
        fs.makedirs(parent, exist_ok=True)  # object stores have no folders, so only local disk needs this
        remove_abandoned_temporaries(parent)  # what an earlier writer, killed mid-save, left behind
        temp = temporary_path(fs_path)
        try:
            with fs.open(temp, "wb") as f:
                lock_temporary(f.fileno())  # held until closed: a live writer's file is never cleaned up
                writer = GuardedWriter(f, max_piece=None)
                save_torch_file(checkpoint, writer)
                writer.raise_error()
                f.flush()
                os.fsync(f.fileno())
                os.replace(temp, fs_path)  # while still locked: the temporary is never seen unlocked
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temp)
            raise
        fsync_dir(parent)

    @staticmethod
    def _save_object(
        checkpoint: dict[str, Any], fs: fsspec.AbstractFileSystem, fs_path: str, concurrency: int = 1
    ) -> None:
        part = max(UPLOAD_PART_BYTES, _checkpoint_nbytes(checkpoint) // MAX_UPLOAD_PARTS + 1)
        if concurrency > 1 and supports_parallel_upload(fs):
            # s3fs's own file uploads its parts one after another; this one keeps several in flight.
            upload = ParallelMultipartUpload(fs, fs_path, part_size=part, concurrency=concurrency)
            try:
                writer = GuardedWriter(upload, max_piece=part)
                save_torch_file(checkpoint, writer)
                writer.raise_error()
                upload.commit()  # only now is the object published (or the old one replaced)
            except BaseException:
                upload.abort()  # the multipart upload is aborted; the previous object stays
                raise
            write_commit_marker(fs, fs_path, size=upload.tell())
            return
        if isinstance(fs, MemoryFileSystem):
            # memory:// publishes a file as soon as it is opened; build it aside and publish it whole.
            file: Any = MemoryFile(fs, fs._strip_protocol(fs_path))
        else:
            file = fs.open(fs_path, "wb", block_size=max(part, MIN_UPLOAD_PART_BYTES), autocommit=False)
        if not isinstance(file, (AbstractBufferedFile, MemoryFile)):
            file.close()
            raise NotImplementedError(
                f"{type(fs).__name__} cannot publish a file atomically; save to local disk, memory:// or an "
                "object store (s3://, gs://, az://)."
            )
        try:
            writer = GuardedWriter(file, max_piece=part)
            save_torch_file(checkpoint, writer)
            writer.raise_error()
            if isinstance(file, AbstractBufferedFile):
                file.close()  # uploads the last part; with autocommit=False the object is not yet published
            file.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                file.discard()  # aborts a multipart upload; the previous object stays
            if isinstance(file, AbstractBufferedFile):
                file.closed = True  # nothing left to flush; keeps __del__ from uploading a torn tail
            raise
        write_commit_marker(fs, fs_path, size=fs.size(fs_path))

    # ---------------------------------------------------------------- load

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        """Read and validate the checkpoint at ``path``; every failure is a :class:`CheckpointError`.

        A sharded folder is read whole, by its own reader (see :mod:`~trainer_core.plugins.io.readers`),
        so any plugin, at any world size, can resume from one. The file is read with ``weights_only=True`` and only the format's safe globals allowed, so a
        file that asks to run code is refused before anything executes. An explicitly named file is
        read even without a commit marker (a checkpoint copied in by hand has none); readers that
        *choose* a checkpoint use :meth:`list_complete`, which skips unmarked ones.
        """
        return read_checkpoint(self, path, map_location, self.storage_options)

    def _read(self, path: PathLike, map_location: Optional[Any]) -> dict[str, Any]:
        """The torch file at ``path``, read and validated (frozen-weight references left for the caller)."""
        display = os.fspath(path)
        fs, fs_path = self._resolve(path)
        if not fs.exists(fs_path):
            raise CheckpointError(
                f"Checkpoint not found: {display}. Check the path (and the storage credentials for a URL); "
                'ckpt_path="last" picks the newest complete checkpoint of the run instead.'
            )
        if fs.isdir(fs_path):
            raise CheckpointError(
                f"{display} is a folder, not a checkpoint file or a sharded checkpoint; pass the path of a .ckpt "
                "file inside it."
            )
        # A copy every rank of this node reads, downloaded once by ParallelPlugin.load_checkpoint.
        local_copy = _PREFETCHED.get(_prefetch_key(fs, fs_path))
        if self.verify_checksums:
            check_record_checksums(*((_local_fs(), local_copy) if local_copy else (fs, fs_path)), display)
        if local_copy is not None:
            mapped = self.mmap and is_zip(local_copy)
            checkpoint = decode_byte_payloads(
                load_torch_file(_local_fs(), local_copy, display, map_location, mapped)
            )
        elif self._downloads(fs):  # an object store: one parallel download, then read as a local file
            checkpoint = decode_byte_payloads(self._load_downloaded(fs, fs_path, display, map_location))
        else:
            mapped = self.mmap and is_local(fs) and is_zip(fs_path)
            checkpoint = decode_byte_payloads(load_torch_file(fs, fs_path, display, map_location, mapped))
        # A PyTorch Lightning checkpoint is returned as it is; loading it into a module converts it.
        validate_checkpoint(checkpoint, display, accept_lightning=True)
        return checkpoint

    def _downloads(self, fs: fsspec.AbstractFileSystem) -> bool:
        """Whether a load from ``fs`` goes through :func:`download_to_local` (object stores, concurrency > 1)."""
        return self.transfer_concurrency > 1 and not is_local(fs) and not isinstance(fs, MemoryFileSystem)

    def _load_downloaded(
        self, fs: fsspec.AbstractFileSystem, fs_path: str, display: str, map_location: Optional[Any]
    ) -> Any:
        """Download ``fs_path`` to a local temporary file with parallel ranged reads, load it, remove it.

        Why a file and not memory: a mapped file costs the process no private memory (the tensors
        live in the page cache) and the download itself holds only ``transfer_concurrency`` ranges.
        The file is removed right after loading; mapped tensors keep its pages until they are freed.
        """
        local_fs = fsspec.filesystem("file")
        handle, local_path = tempfile.mkstemp(prefix=".trainer-core-download-", suffix=".ckpt")
        os.close(handle)
        try:
            try:
                download_to_local(fs, fs_path, local_path, concurrency=self.transfer_concurrency)
            except (TransferError, OSError) as err:
                raise CheckpointError(
                    f"Could not download the checkpoint {display}: {err}. Nothing was loaded; check the "
                    "connection and credentials and load again."
                ) from err
            mapped = self.mmap and is_zip(local_path)
            return load_torch_file(local_fs, local_path, display, map_location, mapped)
        finally:
            with contextlib.suppress(OSError):
                os.remove(local_path)

    # ---------------------------------------------------------------- remove

    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the checkpoint at ``path``; its commit marker goes first, so it is never half-picked.

        A link (``save_last="link"``) is removed as a link, never what it points to. A sharded folder
        loses only the files its writer wrote (``DistributedCheckpointIO.remove_checkpoint``); any
        other folder holds nothing this IO wrote, and is kept, with a warning.
        """
        fs, fs_path = self._resolve(path)
        if is_local(fs) and os.path.islink(fs_path):
            os.remove(fs_path)
            return
        if not fs.isdir(fs_path):
            self._remove_file(fs, fs_path)
        elif is_sharded_folder(fs, fs_path):
            self._remove_folder(fs, fs_path, os.fspath(path))
        else:
            rank_zero_warn(
                f"Did not remove {os.fspath(path)}: it is a folder, not a checkpoint file or a sharded "
                "checkpoint, so trainer-core wrote nothing in it. Remove it yourself if it is not needed."
            )


#: ``(protocol, path)`` of a checkpoint on an object store -> a local copy of it (see :func:`prefetched`).
_PREFETCHED: dict[tuple[str, str], str] = {}


def _prefetch_key(fs: fsspec.AbstractFileSystem, fs_path: str) -> tuple[str, str]:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, fs_path


def _local_fs() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("file")


@contextlib.contextmanager
def prefetched(fs: fsspec.AbstractFileSystem, fs_path: str, local_path: str) -> Iterator[None]:
    """Inside: loads of ``fs_path`` on ``fs`` read the local file ``local_path`` instead of the store.

    The ranks of a node share one download this way (``ParallelPlugin.load_checkpoint``): the file is
    fetched once and every rank maps it, so its pages sit once in the node's page cache. Errors still
    name the checkpoint's URL, and references the checkpoint makes to other files (frozen blobs)
    still resolve next to the URL.
    """
    key = _prefetch_key(fs, fs_path)
    _PREFETCHED[key] = local_path
    try:
        yield
    finally:
        _PREFETCHED.pop(key, None)
