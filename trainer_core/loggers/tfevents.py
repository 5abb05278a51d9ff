"""Scalars into a TensorBoard event file without importing TensorBoard.

``TensorBoardLogger`` logs scalars and, unless a program asks for more, nothing else. TensorBoard's
own writer (``torch.utils.tensorboard``) imports TensorFlow's stub and, through it, ``boto3``: about
0.3 s of CPU on the first ``log_metrics``, more than a short run spends on all its logging. A scalar
is three small protocol-buffer messages, so this module encodes them by hand, into the bytes
``SummaryWriter.add_scalar`` writes (``tests/loggers/test_tfevents.py`` compares them), framed as
TensorFlow records (length, masked CRC-32C of the length, data, masked CRC-32C of the data).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from typing import Any, BinaryIO, Optional

#: The first event of every file, as TensorBoard's ``EventFileWriter`` writes it.
FILE_VERSION = b"brain.Event:2"
SOURCE_WRITER = b"tensorboard.summary.writer.event_file_writer"

# Process-wide, as TensorBoard's ``_global_uid``: two files opened in one second get different names.
_FILE_IDS = itertools.count()
_CRC32C_TABLE: list[int] = []


class ScalarEventWriter:
    """One event file of scalar summaries, the same file name scheme and records as ``SummaryWriter``'s.

    Records go to a buffered file; ``flush()`` pushes them to the OS, and so does ``add_scalar`` once
    ``flush_secs`` have passed since the last flush (``SummaryWriter``'s rule for its queue).
    """

    def __init__(self, folder: str, filename_suffix: str = "", flush_secs: float = 120) -> None:
        now = time.time()
        #: The whole second in the file name: a writer opened after this one must name a later second.
        self.second = int(now)
        name = (
            f"events.out.tfevents.{self.second:010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"
        )
        self.path = os.path.join(folder, name + filename_suffix)
        self._flush_secs = flush_secs
        self._file: Optional[BinaryIO] = open(self.path, "wb")
        version = _field(3, FILE_VERSION) + _field(10, _field(1, SOURCE_WRITER))
        self._write(_double(1, now) + version)
        self.flush()

    def add_scalar(self, tag: str, value: Any, step: Optional[int] = None) -> None:
        """Append ``value`` (a number or a one-element tensor) under ``tag`` at ``step``, stored as float32."""
        self._write(scalar_event(tag, _as_float(tag, value), step, time.time()))
        if time.monotonic() - self._flushed_at >= self._flush_secs:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._flushed_at = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, event: bytes) -> None:
        if self._file is None:
            raise ValueError(f"the event file {self.path} is closed")
        self._file.write(record(event))


def scalar_event(tag: str, value: float, step: Optional[int], wall_time: float) -> bytes:
    """An ``Event`` holding ``Summary(value=[Value(tag=tag, simple_value=value)])``, as protobuf serializes it.

    proto3 leaves out a field at its default: a step of 0 is absent, as in ``SummaryWriter``'s events.
    """
    summary_value = _field(1, tag.encode()) + b"\x15" + _float32(value)
    event = _double(1, wall_time)
    if step:
        event += b"\x10" + _varint(int(step) & 0xFFFFFFFFFFFFFFFF)
    return event + _field(5, _field(1, summary_value))


def record(data: bytes) -> bytes:
    """``data`` framed as one TensorFlow record."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def masked_crc32c(data: bytes) -> int:
    """TensorFlow's masked CRC-32C (Castagnoli) of ``data``."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _crc32c(data: bytes) -> int:
    table = _CRC32C_TABLE or _build_crc32c_table()
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _build_crc32c_table() -> list[int]:
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        _CRC32C_TABLE.append(crc)
    return _CRC32C_TABLE


def _as_float(tag: str, value: Any) -> float:
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"TensorBoardLogger.log_metrics got a {type(value).__name__} for {tag!r}; log a number."
        )
    return float(value)


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32's range: protobuf stores an infinity
        return struct.pack("<f", math.copysign(math.inf, value))


def _double(number: int, value: float) -> bytes:
    return bytes([(number << 3) | 1]) + struct.pack("<d", value)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a nested message)."""
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
