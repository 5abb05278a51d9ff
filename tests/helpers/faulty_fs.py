"""``faulty://``: an object-store-like fsspec filesystem on local disk that fails on request.

It behaves like S3 for the code under test: a file opened for writing is uploaded in parts and
published whole only when committed (``autocommit=False`` then ``commit()``), ``discard()`` drops
the upload, and there is no atomic rename. The faults are set per path through storage options,
so a test says exactly which save or load fails and how:

* ``fail_write_after=N``: writing a file fails with ``ENOSPC`` once more than ``N`` bytes went in;
* ``fail_commit=True``: publishing an upload fails (S3's CompleteMultipartUpload refused);
* ``fail_rename=True``: ``mv``/``rename`` fail (DCP publishes ``.metadata`` by a rename);
* ``short_reads=True``: every read returns at most half the bytes asked for (a flaky mount).

``faulty:///abs/path`` is the local file ``/abs/path``, so a test can look at what was left.
Register it with :func:`register`.
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import Any, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

PROTOCOL = "faulty"


class FaultyFile(AbstractBufferedFile):
    """A buffered file: uploads go to a hidden staging file and are published by ``commit``."""

    def __init__(self, fs: FaultyFileSystem, path: str, mode: str = "rb", **kwargs: Any) -> None:
        self._staging: Optional[str] = None
        self._written = 0
        super().__init__(fs, path, mode, **kwargs)

    # ---------------------------------------------------------------- writing
    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        limit = self.fs.fail_write_after
        if limit is not None and self._written + size > limit:
            raise OSError(errno.ENOSPC, f"No space left on device (faulty:// after {limit} bytes)", self.path)
        self._written += size
        return super().write(data)

    def _initiate_upload(self) -> None:
        folder, name = os.path.split(self.path)
        self._staging = os.path.join(folder, f"..upload-{name}-{uuid.uuid4().hex[:8]}")
        os.makedirs(folder, exist_ok=True)
        open(self._staging, "wb").close()

    def _upload_chunk(self, final: bool = False) -> bool:
        if self._staging is None:
            self._initiate_upload()
        with open(self._staging, "ab") as f:
            f.write(self.buffer.getbuffer())
        if final and self.autocommit:
            self.commit()
        return True

    def commit(self) -> None:
        if self._staging is None:
            self._initiate_upload()
        if self.fs.fail_commit:
            raise OSError(errno.EIO, "faulty:// refused to publish the upload", self.path)
        os.replace(self._staging, self.path)
        self._staging = None

    def discard(self) -> None:
        if self._staging is not None and os.path.exists(self._staging):
            os.remove(self._staging)
        self._staging = None

    # ---------------------------------------------------------------- reading
    def _fetch_range(self, start: int, end: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        if self.fs.short_reads and len(data) > 1:
            return data[: len(data) // 2]
        return data


class FaultyFileSystem(AbstractFileSystem):
    """Local disk behind an object store's interface, with the faults of the module docstring."""

    protocol = (PROTOCOL,)
    root_marker = "/"
    cachable = False  # each set of faults is its own instance

    def __init__(
        self,
        fail_write_after: Optional[int] = None,
        fail_commit: bool = False,
        fail_rename: bool = False,
        short_reads: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fail_write_after = fail_write_after
        self.fail_commit = fail_commit
        self.fail_rename = fail_rename
        self.short_reads = short_reads
        self.local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = os.fspath(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return "/" + path.lstrip("/").rstrip("/") if path not in ("", "/") else "/"

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _open(
        self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True, **kwargs: Any
    ):
        path = self._strip_protocol(path)
        if "r" in mode and not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "No such file", path)
        return FaultyFile(
            self, path, mode, block_size=block_size or 5 * 2**20, autocommit=autocommit, cache_type="none"
        )

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = self.local.ls(self._strip_protocol(path), detail=True)
        # Staging files are invisible, as S3's unfinished multipart uploads are.
        entries = [e for e in entries if not os.path.basename(e["name"]).startswith("..upload-")]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.local.info(self._strip_protocol(path))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.local.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.local.makedirs(self._strip_protocol(path), exist_ok=True)

    def rm_file(self, path: str) -> None:
        self.local.rm_file(self._strip_protocol(path))

    def _rm(self, path: str) -> None:
        self.local.rm(self._strip_protocol(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: Optional[int] = None) -> None:
        paths = [path] if isinstance(path, str) else path
        self.local.rm([self._strip_protocol(p) for p in paths], recursive=recursive, maxdepth=maxdepth)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        if self.fail_rename:
            raise OSError(errno.EIO, "faulty:// refused the rename", f"{path1} -> {path2}")
        os.replace(self._strip_protocol(path1), self._strip_protocol(path2))

    def rename(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.mv(path1, path2)

    def modified(self, path: str) -> Any:
        return self.local.modified(self._strip_protocol(path))

    def created(self, path: str) -> Any:
        return self.local.created(self._strip_protocol(path))


def register() -> None:
    """Make ``faulty://`` URLs resolve to :class:`FaultyFileSystem` (idempotent)."""
    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
