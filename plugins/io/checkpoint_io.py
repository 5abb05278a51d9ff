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

import fcntl
import json
import os
import re
import shutil
import stat
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Optional

import fsspec

from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike, is_local, join, resolve

#: Suffix of the commit marker written after a checkpoint object on non-local storage.
COMMIT_MARKER_SUFFIX = ".complete"
#: Infix of the temporary names writers use before publishing; readers skip such names.
TEMP_INFIX = ".tmp-"

_MARKER_WRITER = "trainer-core"

# Exactly the temporary names our writers make: ``.<name>.tmp-<hex id>`` (files and sharded
# folders) and ``.<name>.tmp-old-<hex id>`` (a replaced folder or link on its way out).
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


def temporary_path(path: str, old: bool = False) -> str:
    """A fresh temporary name next to the local ``path``: ``.<name>.tmp-<hex>`` (``.tmp-old-<hex>`` for
    an entry on its way out), a name readers skip and :func:`remove_abandoned_temporaries` recognises."""
    folder, name = os.path.split(path.rstrip("/"))
    return os.path.join(folder, f".{name}{TEMP_INFIX}{'old-' if old else ''}{uuid.uuid4().hex[:12]}")


def fsync_dir(path: str) -> None:
    """Make a rename in local folder ``path`` durable; some filesystems cannot open a folder, which is fine."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def replace_entry(new: str, final: str, owned: Optional[Callable[[str], bool]] = None) -> None:
    """Put the local file, link or folder ``new`` at ``final``; a reader sees the old entry or the new one.

    A file or a link is renamed over ``final`` in one step (a link is replaced, never what it points
    to). A folder can be neither renamed over nor replaced by a file in one rename, so the old entry
    is renamed aside first (for a moment there is no ``final``, never half of one) and then removed.
    A folder at ``final`` is replaced only if every entry in it is a plain file whose name ``owned``
    accepts (the files the caller's writer writes; none if ``owned`` is ``None``): a folder holding
    anything else (a file the user put there, a symlink) is refused with :class:`CheckpointError`
    before anything changes, so it is never removed.
    """
    if not os.path.lexists(final) or not (_is_real_dir(new) or _is_real_dir(final)):
        os.replace(new, final)
        return
    if _is_real_dir(final):
        foreign = foreign_entries(final, owned)
        if foreign:
            raise CheckpointError(
                f"Did not replace the folder {final}: it holds entries no checkpoint writer of trainer-core "
                f"writes ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}), and they would be lost. "
                "Move them elsewhere or save to another path."
            )
    old = temporary_path(final, old=True)
    os.replace(final, old)
    os.replace(new, final)
    if _is_real_dir(old):
        # Only our own files, checked above; rmtree never follows a link.
        shutil.rmtree(old, ignore_errors=True)
    else:
        with suppress(OSError):
            os.remove(old)


def foreign_entries(folder: str, owned: Optional[Callable[[str], bool]]) -> list[str]:
    """The names in local ``folder`` that are not a plain file ``owned`` accepts (symlinks and folders never are)."""
    foreign = []
    for entry in os.scandir(folder):
        if owned is None or not entry.is_file(follow_symlinks=False) or not owned(entry.name):
            foreign.append(entry.name)
    return sorted(foreign)


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
    # A damaged marker (not JSON, not UTF-8, nested past the recursion limit) vouches for nothing.
    except (FileNotFoundError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return marker if isinstance(marker, dict) and marker.get("writer") == _MARKER_WRITER else None


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


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
        if is_temporary_name(_basename(fs_path)) or fs_path.endswith(COMMIT_MARKER_SUFFIX):
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
            _publish_local_link(src_path, dst_path, self.owns_folder_file)
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
        for name in reversed(self.folder_commit_files()):
            with suppress(FileNotFoundError):
                if fs.isfile(f"{path}/{name}"):
                    fs.rm(f"{path}/{name}")
        with suppress(FileNotFoundError):
            if fs.exists(commit_marker_path(path)):
                fs.rm(commit_marker_path(path))
            if fs.isdir(path):
                owned = [
                    info["name"]
                    for info in fs.ls(path, detail=True)
                    if info.get("type") == "file" and self.owns_folder_file(_basename(info["name"]))
                ]
                if owned:
                    fs.rm(owned)
            elif fs.exists(path):
                fs.rm(path)


def _publish_local_link(src: str, dst: str, owned: Optional[Callable[[str], bool]] = None) -> None:
    """Make the local ``dst`` a relative symlink to ``src`` (a copy without symlinks), atomically.

    A checkpoint folder at ``dst`` is replaced only if it holds nothing but files ``owned`` names.
    """
    folder = os.path.dirname(dst)
    os.makedirs(folder, exist_ok=True)
    temp = temporary_path(dst)
    try:
        try:
            os.symlink(os.path.relpath(src, folder), temp)
        except OSError:
            # No symlinks on this filesystem (some network and FUSE mounts): a copy, published alike.
            with _locked_copy(src, temp, owned):
                replace_entry(temp, dst, owned)
        else:
            replace_entry(temp, dst, owned)
    except BaseException:
        if _is_real_dir(temp):
            shutil.rmtree(temp, ignore_errors=True)
        elif os.path.lexists(temp):
            os.remove(temp)
        raise
    fsync_dir(folder)


@contextmanager
def _locked_copy(src: str, temp: str, owned: Optional[Callable[[str], bool]] = None) -> Iterator[None]:
    """Copy the local file or folder ``src`` to the temporary ``temp``, locked (see :func:`lock_temporary`)
    while the caller publishes it, and synced to disk first. Of a folder, only the files ``owned`` names."""
    if os.path.isdir(src):
        os.makedirs(temp)
        fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            lock_temporary(fd)
            shutil.copytree(
                src,
                temp,
                dirs_exist_ok=True,
                ignore=lambda _, names: [n for n in names if owned is not None and not owned(n)],
            )
            yield
        finally:
            os.close(fd)
        return
    with open(src, "rb") as source, open(temp, "wb") as target:
        lock_temporary(target.fileno())
        shutil.copyfileobj(source, target, 2**24)
        target.flush()
        os.fsync(target.fileno())
        yield


class WrappingCheckpointIO(CheckpointIO):
    """An IO that changes how another IO, ``inner``, is called (e.g. in the background) and forwards the rest.

    Every call it does not change goes to ``inner`` through :meth:`_calling_inner`, the one place a
    subclass puts what must happen around such a call (the asynchronous IO waits there for its
    pending write). :attr:`unwrapped` reaches the IO that does the writing through any number of
    wrappers.
    """

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
