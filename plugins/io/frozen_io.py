"""Frozen weights written once: each checkpoint of a run with a frozen base references them by content hash.

A LoRA run trains a small adapter on a large frozen model, and a plain save writes the frozen base with
every checkpoint (88 GiB per checkpoint for a 463 MiB adapter). :class:`FrozenBlobCheckpointIO` writes
each frozen tensor once, as a *blob* named by the sha256 of its bytes, into a store beside the
checkpoints (``<checkpoint folder>/blobs/<sha256>``), and each checkpoint holds a small reference in the
tensor's place. How a save goes:

* **Which tensors.** Those ``dump_checkpoint`` lists under ``frozen_parameters``: the parameters with
  ``requires_grad=False``. A reference names the content, never the parameter, so a wrong list costs
  space, never exactness.
* **Hashed once per run.** A tensor's hash is kept under its storage, offset, ``_version`` counter,
  shape, stride and dtype, plus a sample of its values: every later save costs only the trainable part.
  The cache holds the storage, so its address cannot be reused by another tensor while cached. An
  in-place change through the parameter bumps ``_version`` and is rehashed; one made through ``.data``
  is not counted by torch, and is caught only when it changes a sampled value (merging an adapter into
  the base does): call :meth:`FrozenBlobCheckpointIO.forget_hashes` after such a change to be certain.
* **Blob before checkpoint.** Every blob a checkpoint references is published (local disk: temporary
  file and rename; object stores: the object, then its commit marker) before the checkpoint is handed
  to the wrapped IO, so a published checkpoint never references a missing blob. A blob already in the
  store is not written again, across runs too: a resumed run reuses them (the first time a run meets
  one on local disk, it reads and checks it; a damaged one is written again).
* **What is in use.** Beside the blobs, ``refs/<checkpoint name>.json`` lists the blobs of each
  checkpoint. It is written before the checkpoint, joined with the previous list of that name (a
  failed overwrite leaves the old file covered) and narrowed once the write is done.

:meth:`FrozenBlobCheckpointIO.remove_checkpoint` (``ModelCheckpoint`` retention) removes the checkpoint,
then every blob that no checkpoint remaining in the folder references. A ``.ckpt`` there without a list
(a copy made by hand) is read to find its blobs; if it cannot be read, no blob is removed.

**The store is the folder's own.** Retention counts the references of the checkpoints in the store's
folder only, so a store shared with another run would lose that run's blobs. A ``blobs`` (or
``blobs/refs``) that is a symlink is therefore never written (a save raises :class:`CheckpointError`)
nor pruned (``remove_unreferenced_blobs`` removes nothing and warns); runs share a frozen base safely by
saving into one checkpoint folder, where every checkpoint's references are counted. Only regular files
named by a sha256 are ever removed from a store, never a symlink; object stores have no symlinks.

Reading needs no plugin: every load of a torch file resolves references (the reader table,
``readers``, with :func:`~trainer_core.plugins.io.blobs.resolve_blob_references`), so
``load_from_checkpoint``, every training plugin and the checkpoint CLI get an ordinary checkpoint. Each blob is checked before anything loads:
its size, and its sha256. Hashing costs about as much as reading the blob from the page cache, once per
load (blobs are hashed in parallel); a frozen base that loaded wrong would be silently wrong forever,
so the check is not optional. A missing or damaged blob is one error that names it and the checkpoint.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
import torch
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from trainer_core.checkpoint.files import (
    COMMIT_MARKER_SUFFIX,
    MAX_UPLOAD_PARTS,
    MIN_UPLOAD_PART_BYTES,
    UPLOAD_PART_BYTES,
    commit_marker_path,
    is_temporary_name,
    publish_local,
    remove_abandoned_temporaries,
    write_commit_marker,
)
from trainer_core.checkpoint.format import (
    BLOB_REF_DTYPE,
    BLOB_REF_SHAPE,
    BLOB_REF_TAG,
    BLOBS_FORMAT_VERSION,
    BLOBS_SHA256,
    BLOBS_STORE,
    KEY_BLOBS,
    KEY_FORMAT_VERSION,
    KEY_FROZEN_PARAMETERS,
    KEY_STATE_DICT,
    load_weights_only,
)
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.paths import PathLike, is_local
from trainer_core.plugins.io.blobs import (
    SHA256_NAME,
    STORE_NAME,
    base_name,
    blob_size,
    hashing_threads,
    is_blob_reference,
    parent_path,
    read_blob,
    referenced_blobs,
    resolve_blob_references,
    sha256_hex,
)
from trainer_core.plugins.io.checkpoint_io import CheckpointIO, WrappingCheckpointIO
from trainer_core.plugins.io.torch_io import TorchCheckpointIO
from trainer_core.utilities import rank_zero_warn

__all__ = [
    "CHECKPOINT_SUFFIX",
    "REFS_FOLDER",
    "STORE_NAME",
    "FrozenBlobCheckpointIO",
    "is_blob_reference",
    "referenced_blobs",
    "resolve_blob_references",
]

#: Inside the store: the list of blobs each checkpoint references, ``<checkpoint name>.json``.
REFS_FOLDER = "refs"
#: Checkpoints written without a list (copies made by hand) are found by this suffix and read.
CHECKPOINT_SUFFIX = ".ckpt"

_MANIFEST_WRITER = "trainer-core"
_FINGERPRINT_SAMPLES = 16


# ---------------------------------------------------------------------- references


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reference(sha256: str, tensor: torch.Tensor) -> dict[str, Any]:
    return {
        BLOB_REF_TAG: sha256,
        BLOB_REF_DTYPE: _dtype_name(tensor.dtype),
        BLOB_REF_SHAPE: list(tensor.shape),
    }


def _storable(tensor: Any) -> bool:
    """A plain strided tensor with data (not a DTensor, meta, sparse or quantized one): bytes we can hash."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and tensor.device.type != "meta"
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat uint8 CPU tensor, in row-major order (a view where possible)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _fingerprint(tensor: torch.Tensor) -> bytes:
    """A few of the tensor's values, evenly spread: a change made behind torch's version counter shows here."""
    numel = tensor.numel()
    if numel == 0:
        return b""
    flat = tensor.detach().reshape(-1)
    index = torch.linspace(0, numel - 1, min(numel, _FINGERPRINT_SAMPLES), device=flat.device).long()
    return flat[index].to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------- the store on storage


def _linked_part(fs: fsspec.AbstractFileSystem, store: str) -> str:
    """The local store, or its list folder, where it is a symlink (a store shared with others); else ``""``."""
    if not is_local(fs):
        return ""
    return next((path for path in (store, f"{store}/{REFS_FOLDER}") if os.path.islink(path)), "")


def _check_own_store(fs: fsspec.AbstractFileSystem, store: str, display: str) -> None:
    """Refuse to write into a store reached through a symlink (see the module's docstring)."""
    linked = _linked_part(fs, store)
    if linked:
        raise CheckpointError(
            f"Could not save the checkpoint {display}: its frozen-weight store {linked} is a symlink (to "
            f"{os.path.realpath(linked)}). A store shared through a symlink cannot be pruned safely: the run whose "
            "folder holds it counts only its own checkpoints' references and would remove this run's blobs. "
            "Remove the symlink (this run then writes its own store), or save the runs that share a frozen base "
            "into one checkpoint folder, where every checkpoint's references are counted."
        )


def _manifest_path(store: str, checkpoint_name: str) -> str:
    return f"{store}/{REFS_FOLDER}/{checkpoint_name}.json"


def _read_manifest(fs: fsspec.AbstractFileSystem, path: str) -> Optional[set[str]]:
    """The blobs a list names, or ``None`` when it is missing or unreadable."""
    try:
        with fs.open(path, "rb") as f:
            manifest = json.loads(f.read().decode())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    hashes = manifest.get(BLOBS_SHA256) if isinstance(manifest, dict) else None
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        return None
    return set(hashes)


def _write_small_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` whole (local: temporary and rename; an object store's put is whole)."""
    if is_local(fs):
        publish_local(path, lambda f: f.write(data))
    else:
        fs.pipe_file(path, data)


def _write_manifest(fs: fsspec.AbstractFileSystem, path: str, hashes: set[str]) -> None:
    body = {"writer": _MANIFEST_WRITER, BLOBS_SHA256: sorted(hashes)}
    _write_small_file(fs, path, json.dumps(body).encode())


def _publish_blob(fs: fsspec.AbstractFileSystem, path: str, data: torch.Tensor) -> None:
    """Write the blob ``data`` (flat uint8) at ``path``: a reader sees no blob or the whole one."""
    view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    if is_local(fs):
        publish_local(path, lambda f: f.write(view))
        return
    if isinstance(fs, MemoryFileSystem):
        fs.pipe_file(path, bytes(view))
    else:
        part = max(UPLOAD_PART_BYTES, len(view) // MAX_UPLOAD_PARTS + 1)
        file = fs.open(path, "wb", block_size=max(part, MIN_UPLOAD_PART_BYTES), autocommit=False)
        if not isinstance(file, AbstractBufferedFile):
            file.close()
            raise NotImplementedError(
                f"{type(fs).__name__} cannot publish a file atomically; keep the checkpoints on local disk, "
                "memory:// or an object store (s3://, gs://, az://)."
            )
        try:
            for start in range(0, len(view), part):
                file.write(view[start : start + part])
            file.close()  # uploads the last part; with autocommit=False nothing is published yet
            file.commit()
        except BaseException:
            with suppress(Exception):
                file.discard()  # aborts the upload: no torn blob is published
            file.closed = True
            raise
    write_commit_marker(fs, path, size=len(view))


def _is_plain_file(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether ``path`` is a file this IO may have written: locally a regular file, never a symlink."""
    if not is_local(fs):
        return True  # object stores hold objects only
    return os.path.isfile(path) and not os.path.islink(path)


def _remove_blob(fs: fsspec.AbstractFileSystem, path: str) -> None:
    if not is_local(fs):
        with suppress(FileNotFoundError):
            fs.rm(commit_marker_path(path))  # first: a blob without its marker is never taken as present
    with suppress(FileNotFoundError):
        fs.rm(path)


def _blobs_of_file(fs: fsspec.AbstractFileSystem, path: str) -> Optional[set[str]]:
    """The blobs the checkpoint file at ``path`` references, read without resolving them; ``None`` if unreadable."""
    try:
        if is_local(fs):
            checkpoint = load_weights_only(
                lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True), path
            )
        else:
            with fs.open(path, "rb") as f:
                checkpoint = load_weights_only(
                    lambda: torch.load(f, map_location="cpu", weights_only=True), path
                )
    except Exception:
        return None
    return referenced_blobs(checkpoint) if isinstance(checkpoint, Mapping) else set()


# ---------------------------------------------------------------------- the IO


@dataclass
class _Hashed:
    """A frozen tensor hashed once: what identifies it, a sample of its values, and its sha256."""

    storage: torch.UntypedStorage  # held: while cached, its address cannot belong to another tensor
    fingerprint: bytes
    sha256: str


_HashKey = tuple[Any, ...]


def _hash_key(tensor: torch.Tensor) -> _HashKey:
    storage = tensor.untyped_storage()
    return (
        tensor.device,
        storage.data_ptr(),
        tensor.storage_offset(),
        tensor._version,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


class FrozenBlobCheckpointIO(WrappingCheckpointIO):
    """Writes the frozen (``requires_grad=False``) weights once and has every checkpoint reference them.

    Args:
        checkpoint_io: the IO that writes the checkpoints themselves, :attr:`inner` from then on;
            :class:`TorchCheckpointIO` by default. To write in the background, wrap it here:
            ``FrozenBlobCheckpointIO(AsyncCheckpointIO())``, so that each save copies only the
            trainable part (wrapped the other way round every save copies and hashes the whole base).

    Use it as ``Trainer(plugins=[FrozenBlobCheckpointIO()])``. The frozen tensors go to
    ``<checkpoint folder>/blobs/<sha256>`` (written once, before the first checkpoint that references
    them); each checkpoint file holds the trainable weights, the optimizer and the loop state, and a
    reference per frozen tensor. Any trainer-core reader resolves the references, checking each blob's
    size and sha256; a resume is exact. :meth:`remove_checkpoint` removes the blobs that no remaining
    checkpoint of the folder references. Copy or move a checkpoint with its folder's ``blobs/``; a
    ``blobs`` that is a symlink (a store shared with other runs) is neither written nor pruned.

    Works wherever one process writes whole files: single device, DDP and the other plugins that save
    a full state dict from rank 0 (there the hash is redone at each save when the state dict is a
    gathered copy rather than the module's own tensors). Sharded folders
    (``DistributedCheckpointIO``) are refused.
    """

    def __init__(self, checkpoint_io: Optional[CheckpointIO] = None) -> None:
        inner = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        distributed = sys.modules.get("trainer_core.plugins.io.distributed_io")
        if distributed is not None and isinstance(inner.unwrapped, distributed.DistributedCheckpointIO):
            raise MisconfigurationException(
                "FrozenBlobCheckpointIO(checkpoint_io=DistributedCheckpointIO(...)): sharded folders already "
                "write each tensor once per save and cannot reference blobs; wrap a TorchCheckpointIO "
                "(the default) instead, or use DistributedCheckpointIO alone."
            )
        super().__init__(inner)
        self._hashes: dict[_HashKey, _Hashed] = {}
        # Blobs known to be in a store, whole and checked, as ``<store path>/<sha256>``.
        self._present: set[str] = set()
        self._lock = threading.Lock()
        self._owner = threading.get_ident()
        self._warned_other_thread = False
        # Lists joined with the previous one of their name, narrowed once the wrapped IO's write is done.
        self._to_narrow: list[tuple[fsspec.AbstractFileSystem, str, set[str]]] = []
        self._defers = _defers_writes(inner)
        self._warned_linked: set[str] = set()  # stores shared through a symlink, warned about once each

    def __getstate__(self) -> dict[str, Any]:
        # ``ddp_spawn`` sends the IO to every rank: the lock cannot travel, and the hashes and blobs known
        # here say nothing about the new process's tensors.
        state = dict(self.__dict__)
        for name in ("_lock", "_hashes", "_present", "_to_narrow", "_owner"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hashes, self._present, self._to_narrow = {}, set(), []
        self._lock = threading.Lock()
        self._owner = threading.get_ident()

    def _resolve_with(
        self, path: PathLike, storage_options: Optional[dict[str, Any]]
    ) -> tuple[fsspec.AbstractFileSystem, str]:
        """``(filesystem, path)`` as the IO that writes the file resolves it, with a save's own options."""
        writer = self.unwrapped
        if storage_options and isinstance(writer, TorchCheckpointIO):
            return writer._resolve(path, storage_options)
        return self._resolve(path)

    def forget_hashes(self) -> None:
        """Hash every frozen tensor again at the next save: call it after changing one through ``.data``."""
        with self._lock:
            self._hashes = {}

    # ---------------------------------------------------------------- save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        """Publish the frozen tensors' blobs and the list of them, then hand the smaller checkpoint to ``inner``."""
        names = checkpoint.get(KEY_FROZEN_PARAMETERS)
        state = checkpoint.get(KEY_STATE_DICT)
        fs, fs_path = self._resolve_with(path, storage_options)
        store = f"{parent_path(fs_path)}/{STORE_NAME}"
        manifest = _manifest_path(store, base_name(fs_path))
        frozen = (
            {name: state[name] for name in names if name in state and _storable(state[name])}
            if isinstance(names, list) and isinstance(state, dict)
            else {}
        )
        _check_own_store(fs, store, os.fspath(path))
        try:
            hashes = self._store_blobs(fs, store, frozen) if frozen else {}
            used = set(hashes.values())
            previous = _read_manifest(fs, manifest) if used or fs.exists(manifest) else None
            if used or previous:
                # Written before the checkpoint, joined with the list of the file it replaces: until the
                # write is done, either file may be the one at this path.
                _write_manifest(fs, manifest, used | (previous or set()))
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"Could not save the checkpoint {os.fspath(path)}: writing its frozen-weight blobs to "
                f"{posixpath.join(posixpath.dirname(os.fspath(path)), STORE_NAME)} failed: {type(err).__name__}: "
                f"{err}. The previous checkpoint at this path, if any, is unchanged; fix the cause (space, "
                "permissions, credentials) and save again."
            ) from err
        if hashes:
            checkpoint = _with_references(checkpoint, hashes)
        with self._calling_inner():
            self.inner.save_checkpoint(checkpoint, path, storage_options)
        if previous is not None and previous - used:
            self._to_narrow.append((fs, manifest, used))
            if not self._defers:
                self._narrow_manifests()

    def _store_blobs(
        self, fs: fsspec.AbstractFileSystem, store: str, frozen: dict[str, torch.Tensor]
    ) -> dict[str, str]:
        """The sha256 of each frozen tensor, with its blob published in ``store``; hashes each tensor once."""
        trusted = threading.get_ident() == self._owner
        if not trusted and not self._warned_other_thread:
            self._warned_other_thread = True
            rank_zero_warn(
                "FrozenBlobCheckpointIO saves on another thread than the one that made it (is it wrapped by "
                "AsyncCheckpointIO?): the tensors it gets are copies, so it hashes the frozen weights at every "
                "save. Wrap the other way round, FrozenBlobCheckpointIO(AsyncCheckpointIO()), to hash them once."
            )
        if is_local(fs) and os.path.isdir(store):
            remove_abandoned_temporaries(store)  # what a writer killed mid-save left behind
            remove_abandoned_temporaries(f"{store}/{REFS_FOLDER}")
        hashes: dict[str, str] = {}
        keys: dict[str, _HashKey] = {}
        todo: dict[str, torch.Tensor] = {}
        for name, tensor in frozen.items():
            key = _hash_key(tensor)
            keys[name] = key
            cached = self._hashes.get(key) if trusted else None
            if cached is not None and cached.fingerprint == _fingerprint(tensor):
                hashes[name] = cached.sha256
                if f"{store}/{cached.sha256}" not in self._present:
                    todo[name] = tensor  # the blob went (a new folder, or removed): write it again
            else:
                todo[name] = tensor
        if todo:
            with ThreadPoolExecutor(max_workers=min(hashing_threads(), len(todo))) as pool:
                done = dict(
                    zip(todo, pool.map(lambda t: self._hash_and_publish(fs, store, t), todo.values()))
                )
            hashes.update(done)
            if trusted:
                for name in todo:
                    tensor = todo[name]
                    self._hashes[keys[name]] = _Hashed(
                        tensor.untyped_storage(), _fingerprint(tensor), done[name]
                    )
        if trusted:
            # Tensors no longer saved (the base was replaced) let go of their storage.
            live = set(keys.values())
            self._hashes = {key: entry for key, entry in self._hashes.items() if key in live}
        return hashes

    def _hash_and_publish(self, fs: fsspec.AbstractFileSystem, store: str, tensor: torch.Tensor) -> str:
        data = _tensor_bytes(tensor)
        sha = sha256_hex(data)
        blob = f"{store}/{sha}"
        with self._lock:
            if blob in self._present:
                return sha
        # Met for the first time in this run: a blob already there (an earlier run's) is used if its size
        # is right; on local disk it is also read and hashed once, so a damaged one is replaced instead of
        # being referenced again (an object store checks what it stores itself, and a read is a download).
        size = blob_size(fs, blob)
        damaged = size == data.numel() and is_local(fs) and read_blob(fs, blob, size, mmap=True)[0] is None
        if size != data.numel() or damaged:
            _publish_blob(fs, blob, data)
        with self._lock:
            self._present.add(blob)
        return sha

    # ---------------------------------------------------------------- link, remove, wait

    def link(self, src: PathLike, dst: PathLike) -> None:
        """Link as ``inner`` does; ``dst`` references the blobs ``src`` does, and its list says so first."""
        src_fs, src_path = self._resolve(src)
        fs, dst_path = self._resolve(dst)
        store = f"{parent_path(dst_path)}/{STORE_NAME}"
        _check_own_store(fs, store, os.fspath(dst))
        source = _read_manifest(
            src_fs, _manifest_path(f"{parent_path(src_path)}/{STORE_NAME}", base_name(src_path))
        )
        manifest = _manifest_path(store, base_name(dst_path))
        previous = _read_manifest(fs, manifest)
        if source or previous:
            _write_manifest(fs, manifest, (source or set()) | (previous or set()))
        with self._calling_inner():
            self.inner.link(src, dst)
        if previous is not None and previous - (source or set()):
            self._to_narrow.append((fs, manifest, source or set()))
            if not self._defers:
                self._narrow_manifests()

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove the checkpoint at ``path``, then the blobs no checkpoint left in its folder references.

        If a pending background write failed, ``inner`` raises and nothing is removed. A failure while
        removing blobs only warns: the checkpoints are intact, and a later removal tries again.
        """
        with self._calling_inner():
            self.inner.remove_checkpoint(path)
        self._narrow_manifests()  # the wrapped IO's pending writes are done: removing waited for them
        fs, fs_path = self._resolve(path)
        folder = parent_path(fs_path)
        with suppress(FileNotFoundError):
            manifest = _manifest_path(f"{folder}/{STORE_NAME}", base_name(fs_path))
            if not _linked_part(fs, f"{folder}/{STORE_NAME}") and _is_plain_file(fs, manifest):
                fs.rm(manifest)
        try:
            self.remove_unreferenced_blobs(folder, resolved=(fs, folder))
        except Exception as err:
            rank_zero_warn(
                f"FrozenBlobCheckpointIO: removing the blobs no checkpoint in {folder} uses failed "
                f"({type(err).__name__}: {err}); the checkpoints are intact, the next removal tries again."
            )

    def remove_unreferenced_blobs(
        self, folder: PathLike, resolved: Optional[tuple[fsspec.AbstractFileSystem, str]] = None
    ) -> list[str]:
        """Remove the blobs in ``folder``'s store that no checkpoint in ``folder`` references; returns their names.

        In use: every blob named by the list of a checkpoint that exists, and by any ``.ckpt`` file there
        without a list (read to find out). If such a file cannot be read, nothing is removed. A store (or
        its list folder) that is a symlink is shared with other runs, whose checkpoints cannot be seen
        from here: nothing is removed from it, with a warning (once per store). Only regular files named
        by a sha256 are removed, never a symlink or a folder of that name.
        """
        fs, fs_folder = resolved if resolved is not None else self._resolve(folder)
        store = f"{fs_folder}/{STORE_NAME}"
        linked = _linked_part(fs, store)
        if linked:
            if linked not in self._warned_linked:
                self._warned_linked.add(linked)
                rank_zero_warn(
                    f"FrozenBlobCheckpointIO: {linked} is a symlink (to {os.path.realpath(linked)}): a store shared "
                    "through a symlink is never pruned, because the other runs' references to its blobs cannot be "
                    "seen from here. No blob was removed; remove unused blobs by hand, or give each run its own store."
                )
            return []
        if not fs.isdir(store):
            return []
        stored = {
            base_name(p)
            for p in fs.ls(store, detail=False)
            if SHA256_NAME.match(base_name(p)) and _is_plain_file(fs, p)
        }
        if not stored:
            return []
        entries = {
            base_name(p)
            for p in fs.ls(fs_folder, detail=False)
            if not is_temporary_name(base_name(p)) and not p.endswith(COMMIT_MARKER_SUFFIX)
        }
        refs = f"{store}/{REFS_FOLDER}"
        listed = {
            base_name(p)[: -len(".json")]: p for p in (fs.ls(refs, detail=False) if fs.isdir(refs) else [])
        }
        listed = {
            name: p for name, p in listed.items() if base_name(p).endswith(".json") and _is_plain_file(fs, p)
        }
        in_use: set[str] = set()
        for name, manifest in listed.items():
            if name not in entries:
                with suppress(FileNotFoundError):
                    fs.rm(manifest)  # its checkpoint is gone
                continue
            hashes = _read_manifest(fs, manifest)
            if hashes is None:
                hashes = _blobs_of_file(fs, f"{fs_folder}/{name}")
            if hashes is None:
                return []  # cannot tell what it uses: keep everything
            in_use |= hashes
        for name in entries - set(listed):
            path = f"{fs_folder}/{name}"
            if not name.endswith(CHECKPOINT_SUFFIX) or fs.isdir(path):
                continue
            hashes = _blobs_of_file(fs, path)
            if hashes is None:
                rank_zero_warn(
                    f"FrozenBlobCheckpointIO: could not read {path} to see which blobs it uses, so no blob in {store} "
                    "is removed. Remove the file if it is not a checkpoint."
                )
                return []
            in_use |= hashes
        removed = sorted(stored - in_use)
        for sha in removed:
            _remove_blob(fs, f"{store}/{sha}")
            with self._lock:
                self._present.discard(f"{store}/{sha}")
        return removed

    def _narrow_manifests(self) -> None:
        pending, self._to_narrow = self._to_narrow, []
        for fs, manifest, hashes in pending:
            _write_manifest(fs, manifest, hashes)

    def wait(self) -> None:
        self.inner.wait()
        self._narrow_manifests()

    def teardown(self) -> None:
        self.inner.teardown()  # raises a failed background write's error: the joined lists then stay
        self._narrow_manifests()

    # ---------------------------------------------------------------- load

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        """Read as ``inner`` does; references it left (a reader other than TorchCheckpointIO) are resolved here."""
        with self._calling_inner():
            checkpoint = self.inner.load_checkpoint(path, map_location=map_location)
        state = checkpoint.get(KEY_STATE_DICT)
        if isinstance(state, dict) and any(is_blob_reference(v) for v in state.values()):
            fs, fs_path = self._resolve(path)
            resolve_blob_references(checkpoint, fs, fs_path, os.fspath(path), map_location)
        return checkpoint


def _with_references(checkpoint: dict[str, Any], hashes: dict[str, str]) -> dict[str, Any]:
    """A shallow copy of ``checkpoint`` whose frozen tensors are references (the caller's dict is unchanged)."""
    state = checkpoint[KEY_STATE_DICT]
    new_state = type(state)() if type(state) is not dict else {}
    for name, value in state.items():
        new_state[name] = _reference(hashes[name], value) if name in hashes else value
    if hasattr(state, "_metadata"):
        new_state._metadata = state._metadata  # type: ignore[attr-defined]
    return {
        **checkpoint,
        KEY_FORMAT_VERSION: max(int(checkpoint.get(KEY_FORMAT_VERSION, 1)), BLOBS_FORMAT_VERSION),
        KEY_STATE_DICT: new_state,
        KEY_BLOBS: {BLOBS_STORE: STORE_NAME, BLOBS_SHA256: sorted(set(hashes.values()))},
    }


def _defers_writes(io: CheckpointIO) -> bool:
    """Whether a save through ``io`` may return before the file is written (an AsyncCheckpointIO inside)."""
    current: Optional[CheckpointIO] = io
    while isinstance(current, WrappingCheckpointIO):
        if current.writes_in_background:
            return True
        current = current.inner
    return False
