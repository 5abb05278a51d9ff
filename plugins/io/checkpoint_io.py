"""The checkpoint IO contract: how a checkpoint reaches storage, and which stored ones a reader may pick.

Method names follow Lightning's ``CheckpointIO`` so a user's IO plugin ports by changing its import.
Two methods are added because resuming with ``ckpt_path="last"`` must never pick a checkpoint that a
killed writer left half-written: :meth:`CheckpointIO.is_complete` and :meth:`CheckpointIO.list_complete`.

How "complete" is decided depends on the storage:

* Local disk: writers publish with an atomic rename, so any file under its final name is complete.
  Temporary files (``.<name>.tmp-<id>``) are never complete.
* Everything else (object stores, ``memory://``): an object store has no rename, so a writer first
  writes the object and then a small commit marker next to it, ``<name>`` + :data:`COMMIT_MARKER_SUFFIX`.
  The marker records the object's size; a checkpoint is complete when its marker exists and the size
  matches, so a marker left over from an earlier save never vouches for a different, torn object.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import time
from abc import ABC, abstractmethod
from typing import Any, Optional

import fsspec

from trainer_core.paths import PathLike, is_local, join, resolve

#: Suffix of the commit marker written after a checkpoint object on non-local storage.
COMMIT_MARKER_SUFFIX = ".complete"
#: Infix of the temporary names writers use before publishing; readers skip such names.
TEMP_INFIX = ".tmp-"

_MARKER_WRITER = "trainer-core"

# Exactly the temporary names our writers make: ``.<name>.tmp-<hex id>`` (files and sharded
# folders) and ``.<name>.tmp-old-<hex id>`` (a replaced sharded folder on its way out).
_OWN_TEMPORARY = re.compile(r"^\..+\.tmp-(?:old-)?[0-9a-f]{8,12}$")
# A temporary this recent is never removed: its writer locks it right after creating it, and this
# covers the moment in between (were it hit, that writer's save would fail, never a torn file).
_TEMPORARY_MIN_AGE_S = 0.1


def commit_marker_path(path: str) -> str:
    """The commit marker's path for the checkpoint at ``path`` (a filesystem path or URL)."""
    return path.rstrip("/") + COMMIT_MARKER_SUFFIX


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` (a base name) is a writer's temporary file, never a checkpoint."""
    return name.startswith(".") and TEMP_INFIX in name


def lock_temporary(fd: int) -> None:
    """Mark the temporary file or folder open as ``fd`` as in use until this process closes it or dies.

    An exclusive ``flock``: the kernel drops it when the writer exits, however it exits (SIGKILL
    included), which is what tells :func:`remove_abandoned_temporaries` a temporary is abandoned.
    On a filesystem without locks the save goes on unlocked; the cleanup then never removes it
    (it removes only what it could lock).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def remove_abandoned_temporaries(folder: str) -> list[str]:
    """Remove the temporaries a killed writer left in local ``folder``; returns the names removed.

    Only names of our own pattern (``.<name>.tmp-<hex>``) are candidates, so nobody else's files are
    touched; of those, only the ones no live process holds locked (see :func:`lock_temporary`) and
    older than 0.1 s (a writer locks its temporary right after creating it) are removed.
    """
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    removed = []
    now = time.time()
    for entry in entries:
        if not _OWN_TEMPORARY.match(entry.name):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        is_dir = stat.S_ISDIR(info.st_mode)
        if not (is_dir or stat.S_ISREG(info.st_mode)) or now - info.st_mtime < _TEMPORARY_MIN_AGE_S:
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if is_dir else 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            if is_dir:
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.remove(entry.path)
            removed.append(entry.name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def write_commit_marker(fs: fsspec.AbstractFileSystem, path: str, size: Optional[int]) -> None:
    """Publish the checkpoint at ``path``: write its marker, recording ``size`` (``None`` for a folder).

    ``saved_at`` orders checkpoints more finely than an object store's one-second modification times.
    """
    marker = {"writer": _MARKER_WRITER, "size": size, "saved_at": time.time()}
    with fs.open(commit_marker_path(path), "wb") as f:
        f.write(json.dumps(marker).encode())


def read_commit_marker(fs: fsspec.AbstractFileSystem, path: str) -> Optional[dict[str, Any]]:
    """The marker of the checkpoint at ``path``, or ``None`` if it has none or it is unreadable."""
    try:
        with fs.open(commit_marker_path(path), "rb") as f:
            marker = json.loads(f.read().decode())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) and marker.get("writer") == _MARKER_WRITER else None


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


class CheckpointIO(ABC):
    """Writes, reads and removes checkpoints; subclasses decide the file format and the storage layout."""

    @abstractmethod
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` so that a reader sees the previous one or all of the new one."""

    @abstractmethod
    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        """Read the checkpoint at ``path`` without executing code from it."""

    @abstractmethod
    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the checkpoint at ``path`` so that no reader picks a half-removed one."""

    def teardown(self) -> None:  # noqa: B027 (an optional hook: most IO holds nothing)
        """Release what the IO holds (threads, pools) when training ends."""

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        """Turn ``path`` into ``(filesystem, path)``; subclasses add their storage options here."""
        return resolve(path)

    def is_complete(self, path: PathLike) -> bool:
        """Whether the checkpoint at ``path`` was fully written and may be picked by a reader."""
        fs, fs_path = self._resolve(path)
        return self._is_complete(fs, fs_path)

    def _is_complete(self, fs: fsspec.AbstractFileSystem, fs_path: str) -> bool:
        if is_temporary_name(_basename(fs_path)) or fs_path.endswith(COMMIT_MARKER_SUFFIX):
            return False
        if fs.isdir(fs_path):
            # A folder is a sharded checkpoint: complete once DCP's metadata (written last) is there.
            from trainer_core.plugins.io.distributed_io import METADATA_FILE, TRAINER_STATE_FILE

            return fs.exists(f"{fs_path}/{METADATA_FILE}") and fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}")
        if is_local(fs):
            return fs.exists(fs_path)
        marker = read_commit_marker(fs, fs_path)
        if marker is None or not fs.exists(fs_path):
            return False
        return marker.get("size") is None or fs.size(fs_path) == marker["size"]

    def list_complete(self, dir_url: PathLike, suffix: Optional[str] = ".ckpt") -> list[str]:
        """The complete checkpoints directly inside ``dir_url``, oldest first, as URLs in its spelling.

        ``ckpt_path="last"`` resumes from the last entry. Only names ending in ``suffix`` count
        (``None``: any name). A missing folder has no checkpoints.
        """
        fs, fs_dir = self._resolve(dir_url)
        if not fs.isdir(fs_dir):
            return []
        found = []
        for info in fs.ls(fs_dir, detail=True):
            name = _basename(info["name"])
            if suffix is not None and not name.endswith(suffix):
                continue
            if not self._is_complete(fs, info["name"]):
                continue
            found.append((self._saved_at(fs, info), name))
        return [join(dir_url, name) for _, name in sorted(found)]

    def saved_at(self, path: PathLike) -> float:
        """When the checkpoint at ``path`` was published (POSIX time), to pick the newest of several folders."""
        fs, fs_path = self._resolve(path)
        return self._saved_at(fs, fs.info(fs_path))

    def latest_complete(self, dir_url: PathLike, suffix: Optional[str] = ".ckpt") -> Optional[str]:
        """The newest complete checkpoint in ``dir_url`` (what ``ckpt_path="last"`` resumes), or ``None``."""
        complete = self.list_complete(dir_url, suffix)
        return complete[-1] if complete else None

    @staticmethod
    def _saved_at(fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> float:
        """When the checkpoint described by ``info`` was published, as a POSIX timestamp."""
        if info.get("type") == "directory" and not is_local(fs):
            # An object store's "folder" has no time of its own: a sharded checkpoint was published
            # when its metadata, written last, was.
            from trainer_core.plugins.io.distributed_io import METADATA_FILE

            info = fs.info(f"{info['name']}/{METADATA_FILE}")
        if not is_local(fs):
            marker = read_commit_marker(fs, info["name"])
            if marker is not None and isinstance(marker.get("saved_at"), (int, float)):
                return float(marker["saved_at"])
        for key in ("mtime", "LastModified", "created", "last_modified", "modified"):
            value = info.get(key)
            if isinstance(value, (int, float)):
                return float(value)
            if hasattr(value, "timestamp"):
                return value.timestamp()
        return fs.modified(info["name"]).timestamp()
