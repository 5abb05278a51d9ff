"""``torch.save`` / ``torch.load`` checkpoints on any fsspec URL, written atomically and read safely.

Why each step is there:

* **Streaming.** ``torch.save`` writes straight into the open file (on object stores through a
  writer that hands it at most one upload part at a time), never into an in-memory ``BytesIO`` first:
  that copy doubles the host memory a save needs, which is what makes large checkpoints crash hosts.
* **Atomic.** On local disk the checkpoint goes to a temporary file in the same folder, is fsynced and
  renamed over the target, then the folder is fsynced: a crash leaves the old file or the new one.
  Object stores publish an upload only when it completes, so the object is written in place (the
  upload is aborted if the save fails) and a commit marker follows (see ``checkpoint_io``).
* **Safe reads.** ``torch.load(weights_only=True)`` with the format's few extra types allowed; a file
  that names anything else (``os.system``, an unknown class) is refused before anything runs.
* **Clear errors.** Every failure becomes one :class:`~trainer_core.errors.CheckpointError` that names
  the file, says what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import re
import tempfile
import zipfile
from collections.abc import Iterator
from typing import Any, Optional

import fsspec
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from trainer_core.checkpoint.format import (
    KEY_BLOBS,
    decode_byte_payloads,
    encode_byte_payloads,
    load_weights_only,
    validate_checkpoint,
)
from trainer_core.checkpoint.stream import GuardedWriter
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.paths import PathLike, is_local, resolve
from trainer_core.plugins.io.checkpoint_io import (
    CheckpointIO,
    commit_marker_path,
    fsync_dir,
    lock_temporary,
    remove_abandoned_temporaries,
    temporary_path,
    write_commit_marker,
)
from trainer_core.plugins.io.object_store import (
    DEFAULT_CONCURRENCY,
    ParallelMultipartUpload,
    TransferError,
    download_to_local,
    supports_parallel_upload,
)

#: Object stores receive the checkpoint in parts of this size (S3 allows 10,000 parts: 80 GiB).
UPLOAD_PART_BYTES = 8 * 2**20
_MIN_UPLOAD_PART_BYTES = 5 * 2**20  # S3's smallest allowed part
_MAX_UPLOAD_PARTS = 9_000  # below S3's 10,000, with room for the estimate below to be low


def _checkpoint_nbytes(checkpoint: Any) -> int:
    """Bytes of tensor data in ``checkpoint``, to size upload parts before anything is written."""
    if isinstance(checkpoint, torch.Tensor):
        return checkpoint.numel() * checkpoint.element_size()
    if isinstance(checkpoint, dict):
        return sum(_checkpoint_nbytes(value) for value in checkpoint.values())
    if isinstance(checkpoint, (list, tuple)):
        return sum(_checkpoint_nbytes(value) for value in checkpoint)
    return 0


def _refused_global(message: str) -> Optional[str]:
    """The global a weights-only load refused (``posix.system``), if that is why the load failed."""
    match = re.search(r"GLOBAL ([\w.]+)", message)
    return match.group(1) if match else None


# Modules whose globals a PyTorch file legitimately names; anything else in a failed pickle is suspect.
_EXPECTED_MODULES = ("torch", "collections", "numpy", "builtins", "__builtin__", "_codecs")


def _suspect_globals(file: Any, max_pickles: int = 8) -> list[str]:
    """Globals named by the raw pickle stream(s) in ``file`` outside the expected modules.

    Torch's weights-only unpickler rejects some old-style files on an opcode before it reaches a
    global, so "unsupported operand" cannot tell a corrupt file from one that would run code.
    ``pickletools`` only parses (it never imports or calls anything), which makes this scan safe.
    """
    found: list[str] = []
    strings: list[str] = []
    try:
        if zipfile.is_zipfile(file):  # torch's zip format: the object graph is the archive's data.pkl
            file.seek(0)
            archive = zipfile.ZipFile(file)
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return []
            file = archive.open(name)
        file.seek(0)
        for _ in range(max_pickles):
            for opcode, arg, _pos in pickletools.genops(file):
                if opcode.name == "GLOBAL":
                    found.append(str(arg).replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # garbage, or the end of the file: what was parsed so far is the answer
        pass
    return [name for name in found if not name.startswith(_EXPECTED_MODULES)]


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
        # complete checkpoint here too. Imported only when a folder is met: it brings in DCP.
        from trainer_core.plugins.io.distributed_io import SHARDED_COMMIT_FILES

        return SHARDED_COMMIT_FILES

    def owns_folder_file(self, name: str) -> bool:
        from trainer_core.plugins.io.distributed_io import is_sharded_file_name

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
                torch.save(checkpoint, writer)
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
        part = max(UPLOAD_PART_BYTES, _checkpoint_nbytes(checkpoint) // _MAX_UPLOAD_PARTS + 1)
        if concurrency > 1 and supports_parallel_upload(fs):
            # s3fs's own file uploads its parts one after another; this one keeps several in flight.
            upload = ParallelMultipartUpload(fs, fs_path, part_size=part, concurrency=concurrency)
            try:
                writer = GuardedWriter(upload, max_piece=part)
                torch.save(checkpoint, writer)
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
            file = fs.open(fs_path, "wb", block_size=max(part, _MIN_UPLOAD_PART_BYTES), autocommit=False)
        if not isinstance(file, (AbstractBufferedFile, MemoryFile)):
            file.close()
            raise NotImplementedError(
                f"{type(fs).__name__} cannot publish a file atomically; save to local disk, memory:// or an "
                "object store (s3://, gs://, az://)."
            )
        try:
            writer = GuardedWriter(file, max_piece=part)
            torch.save(checkpoint, writer)
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

        The file is read with ``weights_only=True`` and only the format's safe globals allowed, so a
        file that asks to run code is refused before anything executes. An explicitly named file is
        read even without a commit marker (a checkpoint copied in by hand has none); readers that
        *choose* a checkpoint use :meth:`list_complete`, which skips unmarked ones.
        """
        display = os.fspath(path)
        fs, fs_path = self._resolve(path)
        if not fs.exists(fs_path):
            raise CheckpointError(
                f"Checkpoint not found: {display}. Check the path (and the storage credentials for a URL); "
                'ckpt_path="last" picks the newest complete checkpoint of the run instead.'
            )
        if fs.isdir(fs_path):
            from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO, is_sharded_checkpoint

            if is_sharded_checkpoint(path, self.storage_options):
                # A sharded checkpoint read whole: any plugin, at any world size, can resume from it.
                return DistributedCheckpointIO(self.storage_options).load_checkpoint(path, map_location)
            raise CheckpointError(
                f"{display} is a folder, not a checkpoint file or a sharded checkpoint; pass the path of a .ckpt "
                "file inside it."
            )
        # A copy every rank of this node reads, downloaded once by ParallelPlugin.load_checkpoint.
        local_copy = _PREFETCHED.get(_prefetch_key(fs, fs_path))
        if self.verify_checksums:
            _verify_checksums(*((_local_fs(), local_copy) if local_copy else (fs, fs_path)), display)
        if local_copy is not None:
            mapped = self.mmap and _is_zip(local_copy)
            checkpoint = decode_byte_payloads(
                self._torch_load(_local_fs(), local_copy, display, map_location, mapped)
            )
        elif self._downloads(fs):  # an object store: one parallel download, then read as a local file
            checkpoint = decode_byte_payloads(self._load_downloaded(fs, fs_path, display, map_location))
        else:
            mapped = self.mmap and is_local(fs) and _is_zip(fs_path)
            checkpoint = decode_byte_payloads(self._torch_load(fs, fs_path, display, map_location, mapped))
        # A PyTorch Lightning checkpoint is returned as it is; loading it into a module converts it.
        validate_checkpoint(checkpoint, display, accept_lightning=True)
        if (
            KEY_BLOBS in checkpoint
        ):  # frozen weights stored apart (FrozenBlobCheckpointIO): read and check them
            from trainer_core.plugins.io.frozen_io import resolve_blob_references

            resolve_blob_references(checkpoint, fs, fs_path, display, map_location, mmap=self.mmap)
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
            mapped = self.mmap and _is_zip(local_path)
            return self._torch_load(local_fs, local_path, display, map_location, mapped)
        finally:
            with contextlib.suppress(OSError):
                os.remove(local_path)

    @staticmethod
    def _torch_load(
        fs: fsspec.AbstractFileSystem,
        fs_path: str,
        display: str,
        map_location: Optional[Any],
        mmap: bool = False,
    ) -> Any:
        try:
            if mmap:  # a local zip file: mapped, its pages shared with every process that maps it
                loaded = load_weights_only(
                    lambda: torch.load(fs_path, map_location=map_location, weights_only=True, mmap=True),
                    display,
                )
                return _small_tensors_copied(loaded)
            with fs.open(fs_path, "rb") as f:
                return load_weights_only(
                    lambda: torch.load(ExactReader(f), map_location=map_location, weights_only=True), display
                )
        except CheckpointError:
            raise
        except ShortReadError as err:
            raise CheckpointError(_short_read_message(display, err)) from err
        except pickle.UnpicklingError as err:
            refused = _refused_global(str(err))
            if refused is None:
                with fs.open(fs_path, "rb") as f:
                    refused = ", ".join(_suspect_globals(f)[:3]) or None
                unbuildable = re.search(r"Can only [^\n]*", str(err))
                if refused is not None and unbuildable is not None:
                    # Allowed classes, pickled in a way the weights-only unpickler never rebuilds: registering
                    # them (again) cannot help, so this error must not advise it.
                    raise CheckpointError(
                        f"Could not load {display}: it holds an object ({refused}) that loading without running "
                        f"code cannot rebuild, even when its class is registered ({unbuildable.group(0)}). "
                        "Re-save the checkpoint with plain values (dicts, lists, numbers, strings, tensors) in "
                        "its hyper-parameters and states."
                    ) from None
            if refused is not None:
                raise CheckpointError(
                    f"Refused to load {display}: it asks to call or construct {refused} while loading, and "
                    "trainer-core never runs code from a checkpoint. If the file is yours and the class is "
                    "trusted, register it with trainer_core.checkpoint.register_safe_globals; otherwise "
                    "delete the file."
                ) from None
            raise CheckpointError(_corrupt_message(display, err)) from None
        except Exception as err:
            short_read = _short_read_cause(err)
            if short_read is not None:  # raised inside torch's reader and re-raised as something else
                raise CheckpointError(_short_read_message(display, short_read)) from err
            # torch raises many kinds on garbage (IndexError, KeyError, ...): each is a corrupt file here.
            raise CheckpointError(_corrupt_message(display, err)) from err

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
        if fs.isdir(fs_path):
            from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO, is_sharded_checkpoint

            if is_sharded_checkpoint(path, self.storage_options):
                DistributedCheckpointIO(self.storage_options).remove_checkpoint(path)
            else:
                from trainer_core.utilities import rank_zero_warn

                rank_zero_warn(
                    f"Did not remove {os.fspath(path)}: it is a folder, not a checkpoint file or a sharded "
                    "checkpoint, so trainer-core wrote nothing in it. Remove it yourself if it is not needed."
                )
            return
        marker = commit_marker_path(fs_path)
        if not is_local(fs) and fs.exists(marker):
            fs.rm(marker)
        if fs.exists(fs_path):
            fs.rm(fs_path)


class ShortReadError(OSError):
    """The storage returned fewer bytes than asked for, before the end of the file."""


class ExactReader:
    """A read-only view of ``file`` whose reads return every byte asked for up to the end, or raise.

    A short read from a flaky filesystem would otherwise reach ``torch.load`` as a truncated
    record and be reported as a corrupt file, although the file itself may be fine.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._size = _file_size(file)
        self.last_error: Optional[ShortReadError] = None

    def read(self, size: int = -1) -> bytes:
        start = self._file.tell()
        data = self._file.read(size)
        if self._size is not None:
            expected = self._size - start if size is None or size < 0 else min(size, self._size - start)
            if len(data) < expected:
                self.last_error = ShortReadError(
                    f"short read: asked for {expected} bytes at offset {start} of a {self._size}-byte file, "
                    f"got {len(data)}"
                )
                raise self.last_error
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def __getattr__(self, name: str) -> Any:  # seek, tell, readline, seekable, ...
        return getattr(self._file, name)


#: Tensors of a mapped checkpoint up to this size are copied out of the mapping as soon as it is read.
SMALL_TENSOR_BYTES = 64 * 2**10


def _small_tensors_copied(obj: Any) -> Any:
    """``obj`` (a mapped checkpoint) with every tensor of at most ``SMALL_TENSOR_BYTES`` copied into memory.

    Any tensor still pointing into the mapping keeps the whole file mapped. Large tensors (weights,
    optimizer moments) are copied where they are loaded; small ones (scores a callback keeps, step
    counters, generator states, a loader's position) would otherwise pin the file for the rest of
    the run: its disk space after retention deletes it, and a crash (SIGBUS) if something truncates
    it in place. Dicts and lists are changed in place, as ``decode_byte_payloads`` does.
    """
    if type(obj) is torch.Tensor:
        return obj.clone() if obj.numel() * obj.element_size() <= SMALL_TENSOR_BYTES else obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _small_tensors_copied(value)
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            obj[index] = _small_tensors_copied(value)
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_small_tensors_copied(value) for value in obj)
    return obj


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


def _is_zip(local_path: str) -> bool:
    """Whether the local file is in torch's zip format, the only one ``torch.load(mmap=True)`` maps."""
    try:
        with open(local_path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False  # the streaming read reports what is wrong


def _file_size(file: Any) -> Optional[int]:
    size = getattr(file, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(file.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    try:
        position = file.tell()
        end = file.seek(0, os.SEEK_END)
        file.seek(position)
        return end
    except Exception:
        return None


def _short_read_cause(err: BaseException) -> Optional[ShortReadError]:
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        if isinstance(current, ShortReadError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _short_read_message(display: str, err: BaseException) -> str:
    return (
        f"Could not read the checkpoint {display}: the storage returned fewer bytes than asked for ({err}). "
        "The file itself may be intact; check the storage (network, mount) and load again. Nothing was changed."
    )


def _verify_checksums(fs: fsspec.AbstractFileSystem, fs_path: str, display: str) -> None:
    """Raise :class:`CheckpointError` if a record of the zip checkpoint at ``fs_path`` fails its CRC-32."""
    try:
        with fs.open(fs_path, "rb") as f:
            try:
                archive = zipfile.ZipFile(ExactReader(f))
            except zipfile.BadZipFile:
                return  # not a zip (an old-style pickle file): torch.load reports what it is
            bad = archive.testzip()
    except ShortReadError as err:
        raise CheckpointError(_short_read_message(display, err)) from err
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(_corrupt_message(display, err)) from err
    if bad is not None:
        raise CheckpointError(
            f"Checksum mismatch in the checkpoint {display}: its record {bad!r} differs from what was written "
            "(a bit flipped on disk or in transit). Use another checkpoint, e.g. an earlier one of the same run."
        )


def _corrupt_message(display: str, err: BaseException) -> str:
    text = str(err)
    # torch's weights-only errors open with advice to disable weights_only; the cause comes later.
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[0] if lines else type(err).__name__
    return (
        f"Could not read the checkpoint {display}: the file is truncated, corrupt or not a PyTorch "
        f"checkpoint ({type(err).__name__}: {cause}). Use another checkpoint, e.g. an earlier one of "
        'the same run, or ckpt_path="last".'
    )
