"""Frozen weights stored apart: the references a checkpoint holds in their place, and how blobs are read back.

``FrozenBlobCheckpointIO`` (``frozen_io``) writes each frozen tensor once, as a blob named by the
sha256 of its bytes in a store beside the checkpoints (``<checkpoint folder>/blobs/<sha256>``), and
each checkpoint holds a small reference in the tensor's place. This module is the format both sides
share: what a reference is, where a blob lives, and :func:`resolve_blob_references`, which every
load of a torch file runs (see ``readers``), so reading needs no plugin. Every blob is checked (its
size, then its sha256) before any is put in: a frozen base that loaded wrong would be silently wrong
forever.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
import torch

from trainer_core.checkpoint.files import read_commit_marker
from trainer_core.checkpoint.format import (
    BLOB_REF_DTYPE,
    BLOB_REF_SHAPE,
    BLOB_REF_TAG,
    BLOBS_SHA256,
    BLOBS_STORE,
    KEY_BLOBS,
    KEY_STATE_DICT,
)
from trainer_core.errors import CheckpointError
from trainer_core.paths import is_local
from trainer_core.utilities import listing

#: The store's folder name beside the checkpoints (recorded in each file, so a reader finds it).
STORE_NAME = "blobs"


SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")


def hashing_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def is_blob_reference(value: Any) -> bool:
    """Whether ``value`` is a reference to a blob in place of a tensor."""
    return isinstance(value, Mapping) and BLOB_REF_TAG in value


@dataclass(frozen=True)
class BlobRef:
    sha256: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty(0, dtype=self.dtype).element_size()


def parse_reference(value: Mapping[str, Any]) -> Optional[BlobRef]:
    sha, dtype_name, shape = value.get(BLOB_REF_TAG), value.get(BLOB_REF_DTYPE), value.get(BLOB_REF_SHAPE)
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if (
        not isinstance(sha, str)
        or not SHA256_NAME.match(sha)
        or not isinstance(dtype, torch.dtype)
        or not isinstance(shape, (list, tuple))
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        return None
    return BlobRef(sha, dtype, tuple(shape))


def sha256_hex(data: torch.Tensor) -> str:
    digest = hashlib.sha256()
    if data.numel():
        digest.update(data.numpy())  # hashlib releases the GIL: blobs hash in parallel on threads
    return digest.hexdigest()


def parent_path(fs_path: str) -> str:
    return posixpath.dirname(fs_path.rstrip("/"))


def base_name(fs_path: str) -> str:
    return posixpath.basename(fs_path.rstrip("/"))


def _store_name_of(checkpoint: Mapping[str, Any]) -> str:
    info = checkpoint.get(KEY_BLOBS)
    name = info.get(BLOBS_STORE) if isinstance(info, Mapping) else None
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        return STORE_NAME
    return name


def blob_size(fs: fsspec.AbstractFileSystem, path: str) -> Optional[int]:
    """The size of the published blob at ``path``, or ``None`` if there is none (an object needs its marker)."""
    if is_local(fs):
        try:
            return os.stat(path).st_size
        except OSError:
            return None
    marker = read_commit_marker(fs, path)
    if marker is None:
        return None
    try:
        size = fs.size(path)
    except (FileNotFoundError, OSError):
        return None
    return size if marker.get("size") in (None, size) else None


def read_blob(
    fs: fsspec.AbstractFileSystem, path: str, nbytes: int, mmap: bool
) -> tuple[Optional[torch.Tensor], str]:
    """The blob at ``path`` as flat uint8, checked against ``nbytes`` and its name; or ``None`` and why not."""
    size = blob_size(fs, path)
    if size is None:
        return None, "missing"
    if size != nbytes:
        return None, f"{size} bytes where {nbytes} were written (truncated or replaced)"
    try:
        if nbytes == 0:
            data = torch.empty(0, dtype=torch.uint8)
        elif is_local(fs) and mmap:
            # Mapped, not read: its pages stay in the page cache that every rank on the node shares.
            data = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
        else:
            data = torch.empty(nbytes, dtype=torch.uint8)
            target = memoryview(data.numpy())
            with fs.open(path, "rb") as f:
                done = 0
                while done < nbytes:
                    got = f.readinto(target[done:])
                    if not got:
                        return None, f"it ended after {done} of {nbytes} bytes while being read"
                    done += got
    except OSError as err:
        return None, f"unreadable ({type(err).__name__}: {err})"
    if sha256_hex(data) != base_name(path):
        return None, "its content does not match its sha256 (changed on disk or in transit)"
    return data, ""


def _to_location(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    if isinstance(map_location, (str, torch.device)):
        return tensor.to(map_location)
    return tensor  # a dict or a function maps saved devices; a blob was read on the CPU and stays there


def resolve_blob_references(
    checkpoint: dict[str, Any],
    fs: fsspec.AbstractFileSystem,
    fs_path: str,
    display: str,
    map_location: Any = None,
    mmap: bool = True,
) -> dict[str, Any]:
    """Put the blob each reference in ``checkpoint["state_dict"]`` names in its place; returns ``checkpoint``.

    ``fs_path`` is the checkpoint's path on ``fs`` (its store is beside it) and ``display`` how the user
    spelled it. Every blob is checked (size, sha256) before any is put in, so a missing or damaged one is
    one :class:`CheckpointError` naming each bad blob and the checkpoint, and the caller loads nothing.
    Blobs load on the CPU (mapped from local disk when ``mmap``), or on ``map_location`` if it is a device.
    A checkpoint without references comes back as it is.
    """
    state = checkpoint.get(KEY_STATE_DICT)
    if not isinstance(state, dict):
        return checkpoint
    refs = {name: value for name, value in state.items() if is_blob_reference(value)}
    if not refs:
        return checkpoint
    store_name = _store_name_of(checkpoint)
    store = f"{parent_path(fs_path)}/{store_name}"
    shown_store = posixpath.join(posixpath.dirname(display.rstrip("/")), store_name)
    parsed: dict[str, BlobRef] = {}
    malformed = []
    for name, value in refs.items():
        ref = parse_reference(value)
        if ref is None:
            malformed.append(name)
        else:
            parsed[name] = ref
    if malformed:
        raise CheckpointError(
            f"Could not read the checkpoint {display}: the blob references of [{listing(sorted(malformed))}] are "
            "malformed (the file was edited or written by a broken writer). Use another checkpoint."
        )
    by_blob: dict[str, list[str]] = {}
    for name, ref in parsed.items():
        by_blob.setdefault(ref.sha256, []).append(name)
    sizes = {sha: {parsed[name].nbytes for name in names} for sha, names in by_blob.items()}
    problems: list[str] = []
    for sha, size_set in sizes.items():
        if len(size_set) > 1:
            problems.append(
                f"{shown_store}/{sha}: referenced with different sizes by [{listing(by_blob[sha])}]"
            )
    with ThreadPoolExecutor(max_workers=min(hashing_threads(), len(by_blob))) as pool:
        futures = {
            sha: pool.submit(read_blob, fs, f"{store}/{sha}", next(iter(sizes[sha])), mmap)
            for sha in by_blob
            if len(sizes[sha]) == 1
        }
        results = {sha: future.result() for sha, future in futures.items()}
    for sha, (data, why) in results.items():
        if data is None:
            problems.append(f"{shown_store}/{sha}: {why} (the weights of [{listing(sorted(by_blob[sha]))}])")
    if problems:
        raise CheckpointError(
            f"Could not load the checkpoint {display}: {len(problems)} of the {len(by_blob)} frozen-weight blobs it "
            "references are missing or damaged:\n  " + "\n  ".join(problems) + "\n"
            f"The frozen weights are written once into {shown_store}/ and shared by the checkpoints of that "
            "folder (FrozenBlobCheckpointIO). Put the blobs back from a backup or another copy of the folder, "
            "or load another checkpoint whose blobs are intact. Nothing was loaded."
        )
    for name, ref in parsed.items():
        data = results[ref.sha256][0]
        assert data is not None
        tensor = (
            data.view(ref.dtype).reshape(ref.shape) if ref.nbytes else torch.empty(ref.shape, dtype=ref.dtype)
        )
        state[name] = _to_location(tensor, map_location)
    return checkpoint


def referenced_blobs(checkpoint: Mapping[str, Any]) -> set[str]:
    """The sha256 of every blob ``checkpoint`` references (as read, before its references are resolved)."""
    found: set[str] = set()
    info = checkpoint.get(KEY_BLOBS)
    if isinstance(info, Mapping) and isinstance(info.get(BLOBS_SHA256), list):
        found.update(h for h in info[BLOBS_SHA256] if isinstance(h, str))
    state = checkpoint.get(KEY_STATE_DICT)
    if isinstance(state, Mapping):
        found.update(
            v[BLOB_REF_TAG]
            for v in state.values()
            if is_blob_reference(v) and isinstance(v[BLOB_REF_TAG], str)
        )
    return found
