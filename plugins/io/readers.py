"""What a checkpoint path holds, and which reader reads it: the one place either question is answered.

A checkpoint on storage is one of two kinds:

* :data:`FILE`: one ``torch.save`` file (:class:`TorchCheckpointIO` writes it; any plugin, a
  ``"full"`` FSDP save, ``consolidate``). If it references frozen weights stored apart
  (``FrozenBlobCheckpointIO``), the blobs beside it are read and checked here, after the file.
* :data:`SHARDED`: a folder of ``torch.distributed.checkpoint`` shards (:class:`DistributedCheckpointIO`
  writes it): rank 0's :data:`TRAINER_STATE_FILE`, every rank's ``__<rank>_<n>.distcp`` and DCP's
  :data:`METADATA_FILE`, written last.

A PyTorch Lightning ``.ckpt`` is a :data:`FILE`; its dict is converted where it is loaded into a
module (``trainer_core.checkpoint.lightning``).

Each IO class reads and writes its own kind only. Its ``load_checkpoint`` hands the path to
:func:`read_checkpoint`, which looks at what is there: the IO's own kind (or nothing, or a folder
no reader knows, which the IO reports in its own words) goes to the IO itself, the other kind to
the reader registered for it (:func:`register_reader`; the package registers both, the sharded one
imported on first use, since DCP costs most of a second to import). So any plugin resumes from
either kind, and no IO class imports another.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional, Protocol

import fsspec

from trainer_core.checkpoint.format import KEY_BLOBS
from trainer_core.paths import PathLike, resolve
from trainer_core.plugins.io.blobs import resolve_blob_references

#: One ``torch.save`` file.
FILE = "file"
#: A folder written by ``torch.distributed.checkpoint``, every rank its own shards.
SHARDED = "sharded"

METADATA_FILE = ".metadata"
TRAINER_STATE_FILE = "trainer_state.pt"
#: What completes a sharded folder, in the order it is written: rank 0's trainer state, then DCP's metadata.
SHARDED_COMMIT_FILES = (TRAINER_STATE_FILE, METADATA_FILE)
# Every file DCP and DistributedCheckpointIO write into a sharded folder: the metadata (also per rank, and
# under its temporary name while written), the shards ``__<rank>_<n>.distcp`` and rank 0's trainer state.
_SHARDED_FILE = re.compile(r"^(?:(?:__\d+)?\.metadata(?:\.tmp)?|__\d+_\d+\.distcp|trainer_state\.pt)$")


def is_sharded_file_name(name: str) -> bool:
    """Whether ``name`` is a file DCP or ``DistributedCheckpointIO`` writes into a sharded folder (all a removal may delete)."""
    return bool(_SHARDED_FILE.match(name))


def is_sharded_folder(fs: fsspec.AbstractFileSystem, fs_path: str) -> bool:
    """Whether ``fs_path`` on ``fs`` is a sharded checkpoint folder (complete or not)."""
    return fs.isdir(fs_path) and fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}")


def is_sharded_checkpoint(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (complete or not)."""
    return is_sharded_folder(*resolve(path, **(storage_options or {})))


def kind_of(fs: fsspec.AbstractFileSystem, fs_path: str) -> Optional[str]:
    """:data:`FILE` or :data:`SHARDED`: what ``fs_path`` holds; ``None`` for nothing, or a folder of neither kind."""
    if not fs.exists(fs_path):
        return None
    if not fs.isdir(fs_path):
        return FILE
    return SHARDED if fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}") else None


class OwnFormatReader(Protocol):
    """What :func:`read_checkpoint` needs of an IO class: the kind it reads, and its read of that kind."""

    #: :data:`FILE` or :data:`SHARDED`.
    reads: str

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]: ...

    def _read(self, path: PathLike, map_location: Optional[Any]) -> dict[str, Any]:
        """The whole, validated checkpoint at ``path``, which holds this reader's kind (or nothing to read)."""
        ...


_READERS: dict[str, Callable[[dict[str, Any]], OwnFormatReader]] = {}


def register_reader(kind: str, reader: Callable[[dict[str, Any]], OwnFormatReader]) -> None:
    """Make ``reader(storage_options)`` the reader of every checkpoint of ``kind``."""
    _READERS[kind] = reader


def read_checkpoint(
    io: OwnFormatReader, path: PathLike, map_location: Optional[Any], storage_options: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint at ``path``, read by the reader of what is there (see the module's docstring).

    ``io`` is the IO asked to load it, and ``storage_options`` its options, with which another kind's
    reader is made. Every failure is one :class:`~trainer_core.errors.CheckpointError` naming ``path``.
    """
    fs, fs_path = io._resolve(path)
    kind = kind_of(fs, fs_path)
    reader = io if kind is None or kind == io.reads else _READERS[kind](storage_options)
    checkpoint = reader._read(path, map_location)
    if kind == FILE and KEY_BLOBS in checkpoint:
        # Frozen weights stored apart, beside the file (FrozenBlobCheckpointIO): read and checked.
        mmap = getattr(reader, "mmap", True)
        resolve_blob_references(checkpoint, fs, fs_path, os.fspath(path), map_location, mmap=mmap)
    return checkpoint
