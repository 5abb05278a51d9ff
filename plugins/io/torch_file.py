"""One ``torch.save`` file read safely: no code runs, a short read is told from a corrupt file, errors say what to do.

Every reader of a torch file shares this (a single-file checkpoint, a sharded folder's
``trainer_state.pt`` and its non-tensor entries), so that a refused class, a damaged file and a flaky
mount each give the same clear :class:`~trainer_core.errors.CheckpointError`, wherever they are met:

* **No code runs.** ``torch.load(weights_only=True)`` with the format's few extra types allowed
  (:func:`~trainer_core.checkpoint.format.load_weights_only`); a file that names anything else is
  refused, and the refusal names what it asked for.
* **Short reads.** :class:`ExactReader` turns a read that returns fewer bytes than asked for into
  :class:`ShortReadError`, which is reported as a storage problem, not as a corrupt file.
* **Mapped files.** A local zip file is mapped (``mmap=True``); its small tensors are copied out at
  once (:func:`small_tensors_copied`), so they never pin the file.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import zipfile
from typing import Any, Optional

import fsspec
import torch

from trainer_core.checkpoint.format import load_weights_only, unpickling_trusted
from trainer_core.errors import CheckpointError


def refused_global(message: str) -> Optional[str]:
    """The global a weights-only load refused (``posix.system``), if that is why the load failed."""
    match = re.search(r"GLOBAL ([\w.]+)", message)
    return match.group(1) if match else None


# Modules whose globals a PyTorch file legitimately names; anything else in a failed pickle is suspect.
_EXPECTED_MODULES = ("torch", "collections", "numpy", "builtins", "__builtin__", "_codecs")


def _suspect_globals(file: Any, max_pickles: int = 8) -> list[str]:
    """Globals named by the raw pickle stream(s) in ``file`` outside the expected modules.

    Torch's weights-only unpickler rejects some old-style files on an opcode before it reaches a
    global, so "unsupported operand" cannot tell a corrupt file from one that would run code.
    ``pickletools`` only parses (it never imports or calls anything), which makes this scan safe.
    """
    found: list[str] = []
    strings: list[str] = []
    try:
        if zipfile.is_zipfile(file):  # torch's zip format: the object graph is the archive's data.pkl
            file.seek(0)
            archive = zipfile.ZipFile(file)
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return []
            file = archive.open(name)
        file.seek(0)
        for _ in range(max_pickles):
            for opcode, arg, _pos in pickletools.genops(file):
                if opcode.name == "GLOBAL":
                    found.append(str(arg).replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # garbage, or the end of the file: what was parsed so far is the answer
        pass
    return [name for name in found if not name.startswith(_EXPECTED_MODULES)]


def load_torch_file(
    fs: fsspec.AbstractFileSystem,
    fs_path: str,
    display: str,
    map_location: Optional[Any],
    mmap: bool = False,
) -> Any:
    """``torch.load`` of ``fs_path`` without running code; every failure is a :class:`CheckpointError` naming ``display``.

    ``mmap``: map the local zip file instead of reading it (its small tensors are copied out).
    Unpickled whole only inside :func:`~trainer_core.checkpoint.format.trusted_unpickling` (the user's
    ``weights_only=False``).
    """
    weights_only = not unpickling_trusted()
    try:
        if mmap:  # a local zip file: mapped, its pages shared with every process that maps it
            loaded = load_weights_only(
                lambda: torch.load(fs_path, map_location=map_location, weights_only=weights_only, mmap=True),
                display,
            )
            return small_tensors_copied(loaded)
        with fs.open(fs_path, "rb") as f:
            return load_weights_only(
                lambda: torch.load(ExactReader(f), map_location=map_location, weights_only=weights_only),
                display,
            )
    except CheckpointError:
        raise
    except ShortReadError as err:
        raise CheckpointError(_short_read_message(display, err)) from err
    except pickle.UnpicklingError as err:
        refused = refused_global(str(err))
        if refused is None:
            with fs.open(fs_path, "rb") as f:
                refused = ", ".join(_suspect_globals(f)[:3]) or None
            unbuildable = re.search(r"Can only [^\n]*", str(err))
            if refused is not None and unbuildable is not None:
                # Allowed classes, pickled in a way the weights-only unpickler never rebuilds: registering
                # them (again) cannot help, so this error must not advise it.
                raise CheckpointError(
                    f"Could not load {display}: it holds an object ({refused}) that loading without running "
                    f"code cannot rebuild, even when its class is registered ({unbuildable.group(0)}). "
                    "Re-save the checkpoint with plain values (dicts, lists, numbers, strings, tensors) in "
                    "its hyper-parameters and states."
                ) from None
        if refused is not None:
            raise CheckpointError(
                f"Refused to load {display}: it asks to call or construct {refused} while loading, and "
                "trainer-core runs no code from a checkpoint unless told to. If the file is yours and the class "
                "is trusted, register it with trainer_core.checkpoint.register_safe_globals; if the whole file "
                "is trusted, pass weights_only=False (to trainer.fit/validate/test/predict or "
                "load_from_checkpoint) to unpickle it whole; otherwise delete the file."
            ) from None
        raise CheckpointError(corrupt_message(display, err)) from None
    except Exception as err:
        short_read = _short_read_cause(err)
        if short_read is not None:  # raised inside torch's reader and re-raised as something else
            raise CheckpointError(_short_read_message(display, short_read)) from err
        # torch raises many kinds on garbage (IndexError, KeyError, ...): each is a corrupt file here.
        raise CheckpointError(corrupt_message(display, err)) from err


# ---------------------------------------------------------------- remove


class ShortReadError(OSError):
    """The storage returned fewer bytes than asked for, before the end of the file."""


class ExactReader:
    """A read-only view of ``file`` whose reads return every byte asked for up to the end, or raise.

    A short read from a flaky filesystem would otherwise reach ``torch.load`` as a truncated
    record and be reported as a corrupt file, although the file itself may be fine.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._size = _file_size(file)
        self.last_error: Optional[ShortReadError] = None

    def read(self, size: int = -1) -> bytes:
        start = self._file.tell()
        data = self._file.read(size)
        if self._size is not None:
            expected = self._size - start if size is None or size < 0 else min(size, self._size - start)
            if len(data) < expected:
                self.last_error = ShortReadError(
                    f"short read: asked for {expected} bytes at offset {start} of a {self._size}-byte file, "
                    f"got {len(data)}"
                )
                raise self.last_error
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def __getattr__(self, name: str) -> Any:  # seek, tell, readline, seekable, ...
        return getattr(self._file, name)


#: Tensors of a mapped checkpoint up to this size are copied out of the mapping as soon as it is read.
SMALL_TENSOR_BYTES = 64 * 2**10


def small_tensors_copied(obj: Any) -> Any:
    """``obj`` (a mapped checkpoint) with every tensor of at most ``SMALL_TENSOR_BYTES`` copied into memory.

    Any tensor still pointing into the mapping keeps the whole file mapped. Large tensors (weights,
    optimizer moments) are copied where they are loaded; small ones (scores a callback keeps, step
    counters, generator states, a loader's position) would otherwise pin the file for the rest of
    the run: its disk space after retention deletes it, and a crash (SIGBUS) if something truncates
    it in place. Dicts and lists are changed in place, as ``decode_byte_payloads`` does.
    """
    if type(obj) is torch.Tensor:
        return obj.clone() if obj.numel() * obj.element_size() <= SMALL_TENSOR_BYTES else obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = small_tensors_copied(value)
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            obj[index] = small_tensors_copied(value)
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(small_tensors_copied(value) for value in obj)
    return obj


#: ``(protocol, path)`` of a checkpoint on an object store -> a local copy of it (see :func:`prefetched`).


def is_zip(local_path: str) -> bool:
    """Whether the local file is in torch's zip format, the only one ``torch.load(mmap=True)`` maps."""
    try:
        with open(local_path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False  # the streaming read reports what is wrong


def _file_size(file: Any) -> Optional[int]:
    size = getattr(file, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(file.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    try:
        position = file.tell()
        end = file.seek(0, os.SEEK_END)
        file.seek(position)
        return end
    except Exception:
        return None


def _short_read_cause(err: BaseException) -> Optional[ShortReadError]:
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        if isinstance(current, ShortReadError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _short_read_message(display: str, err: BaseException) -> str:
    return (
        f"Could not read the checkpoint {display}: the storage returned fewer bytes than asked for ({err}). "
        "The file itself may be intact; check the storage (network, mount) and load again. Nothing was changed."
    )


def check_record_checksums(fs: fsspec.AbstractFileSystem, fs_path: str, display: str) -> None:
    """Raise :class:`CheckpointError` if a record of the zip checkpoint at ``fs_path`` fails its CRC-32."""
    try:
        with fs.open(fs_path, "rb") as f:
            try:
                archive = zipfile.ZipFile(ExactReader(f))
            except zipfile.BadZipFile:
                return  # not a zip (an old-style pickle file): torch.load reports what it is
            bad = archive.testzip()
    except ShortReadError as err:
        raise CheckpointError(_short_read_message(display, err)) from err
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(corrupt_message(display, err)) from err
    if bad is not None:
        raise CheckpointError(
            f"Checksum mismatch in the checkpoint {display}: its record {bad!r} differs from what was written "
            "(a bit flipped on disk or in transit). Use another checkpoint, e.g. an earlier one of the same run."
        )


def corrupt_message(display: str, err: BaseException) -> str:
    text = str(err)
    # torch's weights-only errors open with advice to disable weights_only; the cause comes later.
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[0] if lines else type(err).__name__
    return (
        f"Could not read the checkpoint {display}: the file is truncated, corrupt or not a PyTorch "
        f"checkpoint ({type(err).__name__}: {cause}). Use another checkpoint, e.g. an earlier one of "
        'the same run, or ckpt_path="last".'
    )
