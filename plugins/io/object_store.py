"""Fast, bounded-memory transfers of single checkpoint files to and from object stores, through fsspec.

Why this module exists: s3fs's buffered file (``S3File``) uploads the parts of a multipart upload one
after another, and a sequential read of an fsspec file fetches one block at a time, so a checkpoint
moves at the speed of one connection. Both helpers here keep several requests in flight at once, on
the filesystem's own event loop and through its own calls (no S3 client of ours), with memory
bounded by ``concurrency x part size`` whatever the checkpoint's size:

* :class:`ParallelMultipartUpload`: a write-only file that ``torch.save`` streams into; each full part
  is handed to s3fs's ``upload_part`` while the next one fills. Nothing is published until
  :meth:`~ParallelMultipartUpload.commit` completes the upload; :meth:`~ParallelMultipartUpload.abort`
  (any failure, or an interrupt) aborts it, so the previous object under the key stays as it was.
* :func:`download_to_local`: parallel ranged reads written at their offsets into a local file, which a
  caller then maps (``torch.load(mmap=True)``), so one download serves every rank of a node.

Why not s3fs's ``put_file``/``get_file``: ``put_file`` needs the whole checkpoint spooled to local disk
first (a full extra write and read of the file, and the upload cannot start until serialisation
ends); both transfer in batches of ``max_concurrency`` parts and wait for the slowest part of a batch
before starting the next, and ``get_file`` first opens a read of the whole object. The pipeline here
keeps ``concurrency`` requests busy at all times and overlaps the upload with ``torch.save`` itself.
``benchmarks/object_store.py`` measures the alternatives side by side.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import time
from typing import Any, Callable, Optional

import fsspec

#: Parts of a parallel upload (S3's minimum is 5 MiB; 10,000 parts of 8 MiB is 80 GiB).
DEFAULT_PART_BYTES = 8 * 2**20
#: Bytes per ranged read of a parallel download.
DEFAULT_CHUNK_BYTES = 16 * 2**20
#: Requests kept in flight per file. botocore's connection pool holds 10 by default.
DEFAULT_CONCURRENCY = 8
_MIN_PART_BYTES = 5 * 2**20
_MAX_PARTS = 10_000


class TransferError(OSError):
    """A transfer to or from the store failed; the message names the file and what to do."""


def supports_parallel_upload(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is an S3 filesystem (s3fs, or a subclass), whose multipart calls this module drives."""
    try:
        from s3fs import S3FileSystem
    except ImportError:  # s3fs is optional: without it no filesystem is S3
        return False
    return isinstance(fs, S3FileSystem)


def _is_async(fs: fsspec.AbstractFileSystem) -> bool:
    return bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None


def _on_loop(fs: fsspec.AbstractFileSystem, coroutine: Any) -> concurrent.futures.Future:
    """Run ``coroutine`` on ``fs``'s event loop (fsspec's IO thread) and return its future at once."""
    return asyncio.run_coroutine_threadsafe(coroutine, fs.loop)


def _call(fs: fsspec.AbstractFileSystem, method: str, **kwargs: Any) -> Any:
    """One s3fs request (``fs._call_s3``: its retries, credentials and extra kwargs), waited for."""
    return fsspec.asyn.sync(fs.loop, fs._call_s3, method, **kwargs)


class ParallelMultipartUpload:
    """A write-only file whose full parts are uploaded concurrently as one S3 multipart upload.

    ``write`` fills a part buffer; a full part is sent with s3fs's ``upload_part`` on the
    filesystem's event loop and a new buffer started. When ``concurrency`` parts are in flight,
    ``write`` waits for the oldest, so at most ``concurrency + 1`` parts are held in memory. An object
    smaller than one part is sent with a single ``put_object`` at :meth:`commit`.

    Args:
        fs: an s3fs ``S3FileSystem`` (see :func:`supports_parallel_upload`).
        fs_path: ``bucket/key`` of the object to write.
        part_size: bytes per part, at least 5 MiB (S3's minimum for every part but the last).
        concurrency: parts uploaded at the same time.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        fs_path: str,
        part_size: int = DEFAULT_PART_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if part_size < _MIN_PART_BYTES:
            raise ValueError(f"part_size={part_size} is below S3's minimum part of {_MIN_PART_BYTES} bytes")
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} must be at least 1")
        self.fs = fs
        self.path = fs_path
        self.bucket, self.key, _ = fs.split_path(fs_path)
        self.part_size = part_size
        self.concurrency = concurrency
        self.upload_id: Optional[str] = None
        self._buffer = bytearray()
        self._in_flight: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._etags: dict[int, str] = {}
        self._next_part = 1
        self._size = 0
        self.closed = False

    # ------------------------------------------------------------------ file protocol
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        while len(view):
            take = min(self.part_size - len(self._buffer), len(view))
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) >= self.part_size:
                self._send_part()
        self._size += written
        return written

    def flush(self) -> None:
        """Nothing to do: parts leave when full, the rest at :meth:`commit`."""

    def tell(self) -> int:
        return self._size

    def writable(self) -> bool:
        return True

    # ------------------------------------------------------------------ parts
    def _send_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = _call(self.fs, "create_multipart_upload", Bucket=self.bucket, Key=self.key)[
                "UploadId"
            ]
        if self._next_part > _MAX_PARTS:
            raise TransferError(
                f"{self.path}: more than {_MAX_PARTS} parts of {self.part_size} bytes; use a larger part size."
            )
        while len(self._in_flight) >= self.concurrency:
            self._wait_oldest()
        body, self._buffer = self._buffer, bytearray()
        number = self._next_part
        self._next_part += 1
        coroutine = self.fs._call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
        )
        self._in_flight.append((number, _on_loop(self.fs, coroutine)))

    def _wait_oldest(self) -> None:
        number, future = self._in_flight.popleft()
        self._etags[number] = future.result()["ETag"]

    # ------------------------------------------------------------------ publish / abort
    def commit(self) -> None:
        """Send what is left and complete the upload: only now does the object appear (or replace the old)."""
        if self.closed:
            raise ValueError(f"{self.path}: the upload was already committed or aborted")
        if self.upload_id is None:
            _call(self.fs, "put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer))
        else:
            if self._buffer:
                self._send_part()
            while self._in_flight:
                self._wait_oldest()
            parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
            _call(
                self.fs,
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
        self.closed = True
        self._buffer = bytearray()
        self.fs.invalidate_cache(self.path)
        abort_stale_uploads(self.fs, self.path, keep=self.upload_id)

    def abort(self) -> None:
        """Stop: cancel parts not yet sent, wait for those in flight, abort the multipart upload.

        Safe to call after any failure and more than once; never raises (the caller is already
        raising the failure that made it abort).
        """
        if self.closed:
            return
        self.closed = True
        self._buffer = bytearray()
        for _, future in self._in_flight:
            future.cancel()
        for _, future in self._in_flight:
            with contextlib.suppress(BaseException):
                future.result(timeout=60)
        self._in_flight.clear()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                _call(
                    self.fs,
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                )


def abort_stale_uploads(fs: fsspec.AbstractFileSystem, fs_path: str, keep: Optional[str] = None) -> int:
    """Abort the unfinished multipart uploads of exactly ``fs_path`` (but ``keep``); returns how many.

    A writer killed mid-save (SIGKILL, a lost node) cannot abort its own upload: its parts stay on the
    store, unseen but billed. The next successful save of the same path removes them. One writer per
    path is the contract (rank 0 writes a file checkpoint), so an unfinished upload of a path whose
    save just completed belongs to a dead writer.
    """
    bucket, key, _ = fs.split_path(fs_path)
    try:
        listing = _call(fs, "list_multipart_uploads", Bucket=bucket, Prefix=key)
    except Exception:  # listing uploads may be forbidden by a narrow policy: a cleanup, never a failure
        return 0
    stale = [u for u in listing.get("Uploads", []) or [] if u.get("Key") == key and u.get("UploadId") != keep]
    for upload in stale:
        with contextlib.suppress(Exception):
            _call(fs, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"])
    return len(stale)


def _ranged_read(
    fs: fsspec.AbstractFileSystem, fs_path: str, etag: Optional[str]
) -> Callable[[int, int], Any]:
    """A coroutine factory ``read(start, end)`` for the bytes ``[start, end)`` of ``fs_path``.

    On S3 every range is asked for with ``If-Match`` on the object's ETag, so an object replaced
    mid-download (a trainer overwriting ``last.ckpt``) fails the download instead of mixing two
    checkpoints' bytes; elsewhere the filesystem's own ranged ``_cat_file``.
    """
    if supports_parallel_upload(fs) and etag is not None:
        bucket, key, version = fs.split_path(fs_path)
        extra = {"VersionId": version} if version else {}

        async def read_s3(start: int, end: int) -> bytes:
            response = await fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=etag, **extra
            )
            try:
                return await response["Body"].read()
            finally:
                response["Body"].close()

        return read_s3

    async def read(start: int, end: int) -> bytes:
        return await fs._cat_file(fs_path, start=start, end=end)

    return read


def download_to_local(
    fs: fsspec.AbstractFileSystem,
    fs_path: str,
    local_path: str,
    chunk_size: int = DEFAULT_CHUNK_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> int:
    """Copy the file ``fs_path`` on ``fs`` to ``local_path`` with parallel ranged reads; returns its size.

    Up to ``concurrency`` ranges of ``chunk_size`` bytes are read at once (on the filesystem's event
    loop for an async filesystem such as s3fs, in threads otherwise) and each is written at its
    offset as it arrives, so memory stays at about ``concurrency x chunk_size`` whatever the file's
    size. Every range must come back whole; on S3 the object must not change during the download.

    Raises:
        TransferError: a range failed, came back short, or the object changed; ``local_path`` is
            removed, so a partial file is never mistaken for the checkpoint.
    """
    if chunk_size < 1 or concurrency < 1:
        raise ValueError(f"chunk_size={chunk_size} and concurrency={concurrency} must be at least 1")
    fs.invalidate_cache(fs_path)  # a listing cached before the object was replaced has a stale size and ETag
    info = fs.info(fs_path)
    size = int(info["size"])
    ranges = [(start, min(start + chunk_size, size)) for start in range(0, size, chunk_size)]
    fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.ftruncate(fd, size)
            if _is_async(fs):
                read = _ranged_read(fs, fs_path, info.get("ETag"))
                _pull(ranges, lambda s, e: _on_loop(fs, read(s, e)), fd, concurrency, fs_path)
            else:
                with concurrent.futures.ThreadPoolExecutor(
                    concurrency, thread_name_prefix="download"
                ) as pool:
                    _pull(
                        ranges,
                        lambda s, e: pool.submit(fs.cat_file, fs_path, start=s, end=e),
                        fd,
                        concurrency,
                        fs_path,
                    )
        finally:
            os.close(fd)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(local_path)
        if isinstance(err, TransferError) or not isinstance(err, Exception):
            raise
        raise TransferError(f"{fs_path}: download failed: {_describe(err)}") from err
    return size


def _pull(
    ranges: list[tuple[int, int]],
    start_read: Callable[[int, int], concurrent.futures.Future],
    fd: int,
    concurrency: int,
    fs_path: str,
) -> None:
    """Keep ``concurrency`` ranged reads in flight; write each at its offset as it completes."""
    pending = collections.deque(ranges)
    in_flight: dict[concurrent.futures.Future, tuple[int, int]] = {}
    try:
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                start, end = pending.popleft()
                in_flight[start_read(start, end)] = (start, end)
            done, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                start, end = in_flight.pop(future)
                data = future.result()
                if len(data) != end - start:
                    raise TransferError(
                        f"{fs_path}: the storage returned fewer bytes than asked for (bytes {start}-{end}: got "
                        f"{len(data)}); the object may have changed or the connection dropped. Load again."
                    )
                view, offset = memoryview(data), start
                while len(view):
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
    finally:
        for future in in_flight:
            future.cancel()
        deadline = time.monotonic() + 60
        for future in in_flight:
            with contextlib.suppress(BaseException):
                future.result(timeout=max(0.0, deadline - time.monotonic()))


def _describe(err: BaseException) -> str:
    text = str(err)
    if "PreconditionFailed" in text or "pre-conditions" in text or "412" in text:
        return "the object was replaced while it was being read (its ETag changed); load again"
    return f"{type(err).__name__}: {text}"
