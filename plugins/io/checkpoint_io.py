"""The checkpoint IO contract: how a checkpoint reaches storage, and which stored ones a reader may pick.

Method names follow Lightning's ``CheckpointIO`` so a user's IO plugin ports by changing its import.
The base adds what every reader and the callbacks need, so none of them re-implements the protocol
below: :meth:`CheckpointIO.is_complete` and :meth:`CheckpointIO.list_complete` (``ckpt_path="last"``
must never pick a checkpoint that a killed writer left half-written), :meth:`CheckpointIO.link`
(``ModelCheckpoint(save_last="link")``), :meth:`CheckpointIO.wait` and, for an IO that wraps another
(:class:`WrappingCheckpointIO`, e.g. the asynchronous one), :attr:`CheckpointIO.unwrapped`.

How "complete" is decided depends on the storage:

* Local disk: writers publish with an atomic rename, so any file under its final name is complete.
  Temporary files (``.<name>.tmp-<id>``) are never complete.
* Everything else (object stores, ``memory://``): an object store has no rename, so a writer first
  writes the object and then a small commit marker next to it, ``<name>`` + :data:`COMMIT_MARKER_SUFFIX`.
  The marker records the object's size; a checkpoint is complete when its marker exists and the size
  matches, so a marker left over from an earlier save never vouches for a different, torn object.
* A folder (a sharded checkpoint) is complete when the files its IO names in
  :meth:`CheckpointIO.folder_commit_files` are there; its writer writes the last of them last.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, Optional

import fsspec

from trainer_core.checkpoint.files import (
    COMMIT_MARKER_SUFFIX,
    TEMP_INFIX,
    basename,
    commit_marker_path,
    foreign_entries,
    fsync_dir,
    is_temporary_name,
    lock_temporary,
    publish_local_link,
    read_commit_marker,
    remove_abandoned_temporaries,
    replace_entry,
    temporary_path,
    write_commit_marker,
)
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike, is_local, join, resolve
from trainer_core.utilities import rank_zero_warn

# The file helpers live in trainer_core.checkpoint.files, beside every other writer's; imported from
# here too, where tests and users found them first.
__all__ = [
    "COMMIT_MARKER_SUFFIX",
    "TEMP_INFIX",
    "CheckpointIO",
    "WrappingCheckpointIO",
    "commit_marker_path",
    "foreign_entries",
    "fsync_dir",
    "is_temporary_name",
    "lock_temporary",
    "read_commit_marker",
    "remove_abandoned_temporaries",
    "replace_entry",
    "temporary_path",
    "write_commit_marker",
]


class CheckpointIO(ABC):
    """Writes, reads and removes checkpoints; subclasses decide the file format and the storage layout.

    Three methods are the whole of what a subclass must write (``save_checkpoint``,
    ``load_checkpoint``, ``remove_checkpoint``). The publish protocol (which stored checkpoints are
    complete, when each was published, how one is linked under another name) lives here once; an IO
    that writes folders names the files that complete one in :meth:`folder_commit_files`.
    """

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

    def wait(self) -> None:  # noqa: B027 (an optional hook: a synchronous IO has nothing pending)
        """Block until every save and link this IO was asked for has reached storage; raise a failed one's error.

        A synchronous IO returns at once; an asynchronous one (:class:`AsyncCheckpointIO`) waits here.
        """

    @property
    def unwrapped(self) -> CheckpointIO:
        """The IO that does the writing: ``self``, or for a :class:`WrappingCheckpointIO` its ``inner``'s."""
        return self

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        """Turn ``path`` into ``(filesystem, path)``; subclasses add their storage options here."""
        return resolve(path)

    # ------------------------------------------------------------------ completeness
    def folder_commit_files(self) -> tuple[str, ...]:
        """The files that make a folder a complete checkpoint, in the order its writer writes them.

        The completeness hook for an IO that writes a checkpoint as a folder of files: a folder is
        complete when all of them exist, and its writer writes the last of them last, so that
        file's time is the folder's publication time and a copy (:meth:`link`) writes it last. The
        default, no files, means this IO writes single files and no folder is a checkpoint.
        """
        return ()

    def owns_folder_file(self, name: str) -> bool:
        """Whether ``name``, a file inside a checkpoint folder, is one this IO's writer writes there.

        Removing or replacing a checkpoint folder deletes only such files (by exact name or the
        writer's own pattern), never a file the user put into the folder. The default: the
        :meth:`folder_commit_files`.
        """
        return name in self.folder_commit_files()

    def is_complete(self, path: PathLike) -> bool:
        """Whether the checkpoint at ``path`` was fully written and may be picked by a reader."""
        fs, fs_path = self._resolve(path)
        return self._is_complete(fs, fs_path)

    def _is_complete(self, fs: fsspec.AbstractFileSystem, fs_path: str) -> bool:
        if is_temporary_name(basename(fs_path)) or fs_path.endswith(COMMIT_MARKER_SUFFIX):
            return False
        if fs.isdir(fs_path):
            files = self.folder_commit_files()
            return bool(files) and all(fs.exists(f"{fs_path.rstrip('/')}/{name}") for name in files)
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
            name = basename(info["name"])
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

    def _saved_at(self, fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> float:
        """When the checkpoint described by ``info`` was published, as a POSIX timestamp."""
        if info.get("type") == "directory" and not is_local(fs):
            # An object store's "folder" has no time of its own: it was published when the file its
            # writer writes last was.
            files = self.folder_commit_files()
            if files:
                info = fs.info(f"{info['name'].rstrip('/')}/{files[-1]}")
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

    # ------------------------------------------------------------------ linking
    def link(self, src: PathLike, dst: PathLike) -> None:
        """Publish ``dst`` as a complete checkpoint showing the complete checkpoint ``src``, without saving again.

        What ``ModelCheckpoint(save_last="link")`` does. On local disk ``dst`` becomes a relative
        symlink (the folder can move), made under a temporary name and renamed over ``dst``; where
        the filesystem has no symlinks, a copy published the same way. Object stores have neither
        links nor rename: ``dst`` becomes a server-side copy, published as a save is (a file's commit
        marker after it, a folder's :meth:`folder_commit_files` last). A reader sees the previous
        ``dst`` or the new one whole; a folder on an object store is incomplete, so never picked,
        while it is copied. Called by one process (rank 0). If it fails, the previous ``dst`` stays
        except for a folder on an object store.
        """
        src_fs, src_path = self._resolve(src)
        fs, dst_path = self._resolve(dst)
        if type(src_fs) is not type(fs):
            raise CheckpointError(
                f"Cannot link {os.fspath(dst)} to {os.fspath(src)}: they are on different storage; "
                "keep both in one folder or bucket, or save the checkpoint in full instead."
            )
        if src_path.rstrip("/") == dst_path.rstrip("/"):
            return  # already shows itself
        if not self._is_complete(src_fs, src_path):
            raise CheckpointError(
                f"Cannot link {os.fspath(dst)} to {os.fspath(src)}: {os.fspath(src)} is not a complete "
                "checkpoint (missing, or its save did not finish). Link to a checkpoint that was saved, "
                "or save the checkpoint in full instead."
            )
        if is_local(fs):
            publish_local_link(src_path, dst_path, self.owns_folder_file)
        else:
            self._publish_copy(fs, src_path, dst_path)

    def _publish_copy(self, fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
        """Server-side copy of the complete checkpoint ``src`` to ``dst``, published the way a save is."""
        src, dst = src.rstrip("/"), dst.rstrip("/")
        if fs.isdir(src) or fs.isdir(dst):
            # A folder cannot be replaced in one step: the old ``dst`` is made incomplete and removed
            # first, and the copy becomes complete with its commit files, copied last.
            self._unpublish(fs, dst)
        if not fs.isdir(src):
            # One object copy replaces ``dst`` whole; the old marker's size does not vouch for a
            # different object, and the new marker follows the copy.
            fs.copy(src, dst)
            write_commit_marker(fs, dst, size=fs.size(dst))
            return
        commit = self.folder_commit_files()
        # The checkpoint's own files only: a file the user put into the folder is not part of it.
        names = [path[len(src) + 1 :] for path in fs.find(src)]
        names = [name for name in names if "/" not in name and self.owns_folder_file(name)]
        ordered = sorted(names, key=lambda n: commit.index(n) if n in commit else -1)
        for name in ordered:
            fs.copy(f"{src}/{name}", f"{dst}/{name}")

    def _unpublish(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        """Make the checkpoint at ``path`` on an object store incomplete (its commit file first), then remove it.

        A folder loses only the files its writer writes (:meth:`owns_folder_file`); others stay.
        """
        with suppress(FileNotFoundError):
            folder = fs.isdir(path)
            if folder:
                self._remove_folder_files(fs, path)
            if fs.exists(commit_marker_path(path)):
                fs.rm(commit_marker_path(path))
            if not folder and fs.exists(path):
                fs.rm(path)

    # ------------------------------------------------------------------ removing
    @staticmethod
    def _remove_file(fs: fsspec.AbstractFileSystem, fs_path: str) -> None:
        """Remove the checkpoint file ``fs_path``; its commit marker goes first, so it is never half-picked."""
        marker = commit_marker_path(fs_path)
        if not is_local(fs) and fs.exists(marker):
            fs.rm(marker)
        if fs.exists(fs_path):
            fs.rm(fs_path)

    def _remove_folder(self, fs: fsspec.AbstractFileSystem, fs_path: str, display: str) -> None:
        """Remove the checkpoint folder ``fs_path``: the files its writer wrote, then the folder if nothing else is in it.

        Anything else (a file put there by hand, a symlink, a subfolder) is kept, and so is the folder
        then, with a warning naming what was kept.
        """
        others = self._remove_folder_files(fs, fs_path)
        if others:
            rank_zero_warn(
                f"Removed the sharded checkpoint {display}, but not the folder: it also holds "
                f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}, which trainer-core did not write and "
                "kept. Remove the folder yourself if they are not needed."
            )
        elif is_local(fs):
            with suppress(OSError):
                os.rmdir(fs_path)  # only if empty: something written into it meanwhile stays
        else:
            with suppress(OSError):  # FileNotFoundError included
                fs.rmdir(fs_path)  # memory:// keeps empty folders; an object store has none

    def _remove_folder_files(self, fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
        """Remove the files in ``folder`` that this IO's writer writes there; returns the names of what stays.

        The last of :meth:`folder_commit_files` goes first, so a reader never picks half a folder; the
        other commit files go last, so an interrupted removal leaves a folder still recognised as a
        checkpoint, which the next removal finishes. Only plain files :meth:`owns_folder_file` accepts
        are removed: a file put there by hand, a symlink or a subfolder stays.
        """
        commit = self.folder_commit_files()
        if commit:
            with suppress(FileNotFoundError):
                if fs.isfile(f"{folder}/{commit[-1]}"):
                    fs.rm(f"{folder}/{commit[-1]}")
        ours, others = [], []
        for info in fs.ls(folder, detail=True):
            plain = info.get("type") == "file" and not info.get("islink", False)
            (ours if plain and self.owns_folder_file(basename(info["name"])) else others).append(info["name"])
        if ours:
            fs.rm(sorted(ours, key=lambda path: basename(path) in commit))
        return sorted(basename(path) for path in others)


class WrappingCheckpointIO(CheckpointIO):
    """An IO that changes how another IO, ``inner``, is called (e.g. in the background) and forwards the rest.

    Every call it does not change goes to ``inner`` through :meth:`_calling_inner`, the one place a
    subclass puts what must happen around such a call (the asynchronous IO waits there for its
    pending write). :attr:`unwrapped` reaches the IO that does the writing through any number of
    wrappers.
    """

    #: Whether a save may return before ``inner`` has written the file (the asynchronous IO's does).
    writes_in_background = False

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    @property
    def unwrapped(self) -> CheckpointIO:
        return self.inner.unwrapped

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's name for :attr:`inner`."""
        return self.inner

    @contextmanager
    def _calling_inner(self) -> Iterator[None]:
        """Held around every call forwarded to ``inner``."""
        yield

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        with self._calling_inner():
            self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        with self._calling_inner():
            return self.inner.load_checkpoint(path, map_location=map_location)

    def remove_checkpoint(self, path: PathLike) -> None:
        with self._calling_inner():
            self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()

    def wait(self) -> None:
        self.inner.wait()

    def folder_commit_files(self) -> tuple[str, ...]:
        return self.inner.folder_commit_files()

    def owns_folder_file(self, name: str) -> bool:
        return self.inner.owns_folder_file(name)

    def is_complete(self, path: PathLike) -> bool:
        with self._calling_inner():
            return self.inner.is_complete(path)

    def list_complete(self, dir_url: PathLike, suffix: Optional[str] = ".ckpt") -> list[str]:
        with self._calling_inner():
            return self.inner.list_complete(dir_url, suffix)

    def latest_complete(self, dir_url: PathLike, suffix: Optional[str] = ".ckpt") -> Optional[str]:
        with self._calling_inner():
            return self.inner.latest_complete(dir_url, suffix)

    def saved_at(self, path: PathLike) -> float:
        with self._calling_inner():
            return self.inner.saved_at(path)

    def link(self, src: PathLike, dst: PathLike) -> None:
        with self._calling_inner():
            self.inner.link(src, dst)

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        return self.inner._resolve(path)
