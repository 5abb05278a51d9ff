"""How a checkpoint file reaches storage whole: temporary names, locks, fsync, atomic replace, commit markers.

The one home of the publish protocol every writer shares (the checkpoint IO plugins, the streaming
consolidation, the safetensors export, the frozen-weight store), so that what "complete" means is
decided in one place:

* Local disk: a writer writes a locked temporary (``.<name>.tmp-<hex>``) next to the target, fsyncs
  it and renames it over the target, then fsyncs the folder: a crash leaves the old file or the new
  one, and the temporary it leaves is removed by the next writer (:func:`remove_abandoned_temporaries`).
* Object stores and ``memory://``: no rename, so an upload is published only when complete, and a
  small commit marker (``<name>`` + :data:`COMMIT_MARKER_SUFFIX`) recording its size follows it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Optional

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from trainer_core.errors import CheckpointError
from trainer_core.paths import is_local, resolve

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


def basename(path: str) -> str:
    """The last part of a filesystem path or URL, a trailing slash ignored."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def publish_local_link(src: str, dst: str, owned: Optional[Callable[[str], bool]] = None) -> None:
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
            with locked_copy(src, temp, owned):
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
def locked_copy(src: str, temp: str, owned: Optional[Callable[[str], bool]] = None) -> Iterator[None]:
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


#: Object stores receive a streamed file in parts of this size (S3 allows 10,000 parts: 80 GiB).
UPLOAD_PART_BYTES = 8 * 2**20
MIN_UPLOAD_PART_BYTES = 5 * 2**20  # S3's smallest allowed part
#: Below S3's 10,000, with room for an estimate of the file's size to be low.
MAX_UPLOAD_PARTS = 9_000


# ---------------------------------------------------------------------- atomic publication
class GuardedWriter:
    """What the zip writer writes into: bounded pieces, and the first error kept.

    An exception raised by ``write`` inside torch's C++ zip writer comes back out as an unrelated
    ``RuntimeError`` ("unexpected pos ..."); the real cause (disk full, connection reset) is kept here
    and raised after the write.
    """

    def __init__(self, file: Any, max_piece: Optional[int]) -> None:
        self._file = file
        self._max_piece = max_piece
        self.error: Optional[BaseException] = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                if self._max_piece is None:
                    self._file.write(view)
                else:
                    for start in range(0, len(view), self._max_piece):
                        self._file.write(view[start : start + self._max_piece])
            except Exception as err:
                self.error = err
        return len(view)

    def flush(self) -> None:
        if self.error is None:
            try:
                self._file.flush()
            except Exception as err:
                self.error = err

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def publish_file(
    url: str,
    write: Callable[[Any], None],
    storage_options: Optional[dict[str, Any]] = None,
    expected_bytes: int = 0,
    marker: bool = True,
) -> None:
    """Write the file ``url`` with ``write(file)`` so that a reader sees the previous file or the new one whole.

    Local disk: a locked temporary next to it, fsynced and renamed over ``url``. Object stores and
    ``memory://``: an upload published only when complete (aborted on failure), then the commit
    marker readers check (``marker=False``: none, for a file inside a folder that gets one marker).
    ``expected_bytes`` sizes the upload parts.
    """
    fs, fs_path = resolve(url, **(storage_options or {}))
    if is_local(fs):
        publish_local(fs_path, write)
        return
    part = max(UPLOAD_PART_BYTES, expected_bytes // MAX_UPLOAD_PARTS + 1)
    if isinstance(fs, MemoryFileSystem):
        file: Any = MemoryFile(fs, fs._strip_protocol(fs_path))  # memory:// publishes on open otherwise
    else:
        file = fs.open(fs_path, "wb", block_size=part, autocommit=False)
    if not isinstance(file, (AbstractBufferedFile, MemoryFile)):
        file.close()
        raise CheckpointError(
            f"{url}: {type(fs).__name__} cannot publish a file atomically; write to local disk, memory:// or an "
            "object store (s3://, gs://, az://)."
        )
    try:
        guarded = GuardedWriter(file, max_piece=part)
        write(guarded)
        guarded.raise_error()
        if isinstance(file, AbstractBufferedFile):
            file.close()  # uploads the last part; with autocommit=False nothing is published yet
        file.commit()
    except BaseException:
        with contextlib.suppress(Exception):
            file.discard()  # aborts the multipart upload: the previous object stays
        if isinstance(file, AbstractBufferedFile):
            file.closed = True  # keeps __del__ from uploading a torn tail
        raise
    if marker:
        write_commit_marker(fs, fs_path, size=fs.size(fs_path))


def publish_local(path: str, write: Callable[[Any], None]) -> None:
    """Write the local file ``path`` with ``write(file)``: a locked temporary, fsynced, renamed over it."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    remove_abandoned_temporaries(parent)  # what a killed writer left here
    temp = temporary_path(path)
    try:
        with open(temp, "wb") as f:
            lock_temporary(f.fileno())  # a live writer's temporary is never cleaned up
            guarded = GuardedWriter(f, max_piece=None)
            write(guarded)
            guarded.raise_error()
            f.flush()
            os.fsync(f.fileno())
            os.replace(temp, path)  # while still locked
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise
    fsync_dir(parent)
