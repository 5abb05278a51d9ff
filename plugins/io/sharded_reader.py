"""Reading a sharded (``torch.distributed.checkpoint``) folder without running code from it.

torch's DCP readers unpickle ``.metadata`` with plain ``pickle.load`` and every non-tensor entry with
``torch.load(weights_only=False)``: a crafted folder would run code when loaded. The readers and
planners here allow only the classes and pickle opcodes DCP's metadata is made of, load non-tensor
entries with ``weights_only=True``, and refuse shard names that point outside the folder.

Everything that reads such a folder goes through here: ``DistributedCheckpointIO`` (its own format,
into a template of this run's shards or whole) and the checkpoint CLI's streaming reader
(``trainer_core.checkpoint.stream.ShardedSource``, one tensor at a time, no process group). The
folder's file names and "is this a sharded folder" are answered in ``readers``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import pickletools
from typing import Any, Optional

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

from trainer_core import paths
from trainer_core.checkpoint.format import KEY_LOOPS, KEY_OPTIMIZER_STATES, load_weights_only
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike
from trainer_core.plugins.io.readers import METADATA_FILE, TRAINER_STATE_FILE
from trainer_core.plugins.io.torch_file import corrupt_message, load_torch_file, refused_global

#: Shard files each rank writes to, and reads from, an object store at the same time.
SHARD_IO_THREADS = 4


def check_complete(fs: fsspec.AbstractFileSystem, fs_path: str, url: str) -> None:
    """Raise :class:`CheckpointError` unless ``fs_path`` is a complete sharded folder (``url`` as the user spelled it)."""
    if not fs.exists(fs_path):
        raise CheckpointError(f"{url} does not exist; pass the folder of a sharded checkpoint.")
    if not fs.isdir(fs_path) or not fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}"):
        raise CheckpointError(
            f"{url} is not a sharded trainer-core checkpoint (no {TRAINER_STATE_FILE} in it)."
        )
    if not fs.exists(f"{fs_path}/{METADATA_FILE}"):
        raise CheckpointError(
            f"{url} is an incomplete sharded checkpoint: it has no {METADATA_FILE}, which is written last, so "
            "its save was interrupted. Use another checkpoint."
        )


def load_trainer_state(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The non-tensor part of the complete sharded folder ``path`` (everything but model and optimizer tensors)."""
    url = os.fspath(path)
    fs, fs_path = paths.resolve(url, **(storage_options or {}))
    check_complete(fs, fs_path, url)
    # The same safe, checked read as a single-file checkpoint (weights_only, clear errors).
    return load_torch_file(fs, f"{fs_path}/{TRAINER_STATE_FILE}", f"{url}/{TRAINER_STATE_FILE}", "cpu")


def open_reader(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> Any:
    """A DCP reader of the folder ``path`` that never unpickles code and never leaves the folder.

    Its ``.metadata`` is read and checked here, so a refusal is raised as it is; a refusal met later,
    inside DCP, is kept as the reader's ``refusal``.
    """
    url = os.fspath(path)
    fs, fs_path = paths.resolve(url, **(storage_options or {}))
    if paths.is_local(fs):
        reader: _SafeMetadataReading = _SafeFileSystemReader(fs_path, display=url)
    else:
        reader = _SafeFsspecReader(url, display=url, **(storage_options or {}))
    reader.check_metadata()
    return reader


# readers and planners allow only the classes and pickle opcodes DCP's metadata is made of, load
# non-tensor entries with ``weights_only=True``, and refuse shard names that point outside the folder.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_ALLOWED_METADATA_GLOBALS = {
    _STORAGE_INFO,
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
}
# Opcodes that only make data (numbers, strings, empty containers, tuples, the memo): nothing outside
# what this load made is reached. GLOBAL goes through ``find_class``; REDUCE, NEWOBJ, BUILD and the
# container updates are checked by ``_MetadataUnpickler``; the rest (INST, OBJ, NEWOBJ_EX, EXT1/2/4,
# PERSID, BINPERSID, out-of-band buffers) DCP never writes, and they are refused.
_DATA_OPCODES = frozenset(
    "PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 "
    "FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 UNICODE "
    "BINUNICODE SHORT_BINUNICODE BINUNICODE8 EMPTY_LIST LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT "
    "DICT EMPTY_SET FROZENSET GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL".split()
)


def _shown(value: Any) -> str:
    """What ``value`` is, for a refusal: a class's or a function's name, else the type's (never its repr)."""
    if isinstance(value, type) or callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return f"a {type(value).__name__}"


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Reads a DCP ``.metadata``, allowing only the classes and the opcodes it is made of.

    Allowing classes is not enough: pickle's BUILD sets attributes with ``setattr``, so a crafted file
    can name an allowed class and set attributes on the class itself (a dataclass's field default, for
    every later instance in this process) or on a shared object (an enum member, a layout), even
    though the load is refused in the end. So, as torch's weights-only unpickler does, the opcodes are
    checked too. This is the pure-Python unpickler with its own dispatch table, in which

    * REDUCE calls only what DCP's metadata is rebuilt with (``torch.Size``, ``OrderedDict``, paths,
      layouts, the metadata module's enums), with a tuple of arguments;
    * NEWOBJ makes only an empty instance of an allowed dataclass, and BUILD fills only an instance
      NEWOBJ made in this load (never a class, a module or a shared object), through its class's own
      ``__setstate__`` or from a dict with string keys;
    * APPEND(S), SETITEM(S) and ADDITEMS fill only a list, a dict or a set (which this load made:
      nothing here reads an attribute, so no shared container can be reached);
    * every other opcode that does more than make data is refused.

    Pure Python costs 5-15x the C unpickler's time, about what pickle's own pure-Python unpickler
    takes: 0.8 ms (C: 0.08 ms) for a small model's 1.7 kB ``.metadata``, 0.23 s (C: 0.02 s) for 0.36 MB
    (2,400 chunks), about 2-3 s (C: 0.45 s) for 2.8 MB (20,000 chunks); read once per load.
    """

    dispatch: dict[int, Any] = {}  # filled below, from pickle's own table

    def __init__(self, file: Any, display: str) -> None:
        super().__init__(file)
        self._display = display
        # What NEWOBJ made in this load, by id: the only objects BUILD may fill (held, so ids stay theirs).
        self._made: dict[int, Any] = {}

    def _refusal(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"Refused to load {self._display}: its {METADATA_FILE} asks to {what} while loading; "
            "trainer-core never runs code from a checkpoint or lets one change this process's objects. "
            "Delete the folder unless you know where it came from."
        )

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_METADATA_GLOBALS
        if module == _METADATA_MODULE:
            value = getattr(importlib.import_module(module), name, None)
            allowed = isinstance(value, type) and (
                dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)
            )
        elif module == "torch":
            allowed = allowed or isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            )
        if not allowed:
            raise self._refusal(f"call or construct {module}.{name}")
        return getattr(importlib.import_module(module), name)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not _rebuilds_metadata(func) or type(args) is not tuple:
            raise self._refusal(f"call {_shown(func)}")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not _is_metadata_dataclass(cls) or type(args) is not tuple or args:
            raise self._refusal(f"construct {_shown(cls)} from {_shown(args)}")
        made = cls.__new__(cls)
        self._made[id(made)] = made
        self.append(made)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._made.get(id(inst)) is not inst:
            raise self._refusal(f"set attributes of {_shown(inst)} (not an object it constructed)")
        setstate = getattr(type(inst), "__setstate__", None)  # the class's own, never one the file set
        if setstate is not None:
            setstate(inst, state)
        elif type(state) is dict and all(type(key) is str for key in state):
            inst.__dict__.update(state)
        else:
            raise self._refusal(f"set the attributes of a {type(inst).__name__} from {_shown(state)}")

    def _fills(self, kinds: tuple[type, ...], depth: int, marked: bool = False) -> None:
        """Refuse unless the object the opcode fills (``depth`` down the stack) is exactly one of ``kinds``."""
        stack = self.metastack[-1] if marked and self.metastack else self.stack
        target = stack[-depth] if len(stack) >= depth else None
        if type(target) not in kinds:
            raise self._refusal(f"add items to {_shown(target)}")

    def load_append(self) -> None:
        self._fills((list,), 2)
        super().load_append()

    def load_appends(self) -> None:
        self._fills((list,), 1, marked=True)
        super().load_appends()

    def load_setitem(self) -> None:
        self._fills((dict, collections.OrderedDict), 3)
        super().load_setitem()

    def load_setitems(self) -> None:
        self._fills((dict, collections.OrderedDict), 1, marked=True)
        super().load_setitems()

    def load_additems(self) -> None:
        self._fills((set,), 1, marked=True)
        super().load_additems()


def _refuse_opcode(name: str) -> Any:
    def refuse(self: _MetadataUnpickler) -> None:
        raise self._refusal(f"use the pickle opcode {name}")

    return refuse


def _fill_dispatch() -> None:
    checked = {"REDUCE", "NEWOBJ", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"}
    table = pickle._Unpickler.dispatch  # type: ignore[attr-defined]
    for opcode in pickletools.opcodes:
        code = opcode.code.encode("latin-1")[0]
        if opcode.name in _DATA_OPCODES:
            _MetadataUnpickler.dispatch[code] = table[code]
        elif opcode.name in checked:
            _MetadataUnpickler.dispatch[code] = getattr(_MetadataUnpickler, f"load_{opcode.name.lower()}")
        else:
            _MetadataUnpickler.dispatch[code] = _refuse_opcode(opcode.name)


_fill_dispatch()


# What REDUCE may call: what pickle rebuilds DCP's metadata with (and the metadata module's enums).
_METADATA_CALLS = (
    torch.Size,
    torch.serialization._get_layout,
    collections.OrderedDict,
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    pathlib.WindowsPath,
    pathlib.PureWindowsPath,
)


def _rebuilds_metadata(func: Any) -> bool:
    """Whether REDUCE may call ``func``."""
    if any(func is allowed for allowed in _METADATA_CALLS):
        return True
    return isinstance(func, type) and issubclass(func, enum.Enum) and func.__module__ == _METADATA_MODULE


def _is_metadata_dataclass(cls: Any) -> bool:
    return (
        isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and (cls.__module__ == _METADATA_MODULE or (cls.__module__, cls.__name__) == _STORAGE_INFO)
    )


def _is_plain_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


class _SafeMetadataReading:
    """``read_metadata`` without running code, and only shard names inside the folder.

    :meth:`check_metadata` reads and checks ``.metadata`` before DCP is called, so a refusal is
    raised as it is (DCP would log it with a traceback and retry per-rank metadata files).
    """

    _display: str
    #: The refusal raised while reading, kept because DCP reports it only as text inside its own error.
    refusal: Optional[CheckpointError] = None
    _checked: Any = None

    def check_metadata(self) -> None:
        self._checked = self._read_checked_metadata(None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if rank is None and self._checked is not None:
            metadata, self._checked = self._checked, None
            return metadata
        return self._read_checked_metadata(rank)

    def _read_checked_metadata(self, rank: Optional[int]) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(rank)  # type: ignore[attr-defined]
        try:
            with self.fs.create_stream(path, "rb") as file:  # type: ignore[attr-defined]
                metadata = _MetadataUnpickler(file, self._display).load()
        except CheckpointError as err:
            self.refusal = err
            raise
        except FileNotFoundError:
            raise  # DCP also looks for per-rank metadata files that need not exist
        except Exception as err:
            raise CheckpointError(
                f"Could not read {self._display}/{METADATA_FILE}: it is truncated or corrupt "
                f"({type(err).__name__}: {err}). Use another checkpoint."
            ) from err
        problem = _metadata_problem(metadata)
        if problem:
            # Checked here, once, so that DCP and ``ShardedSource`` never meet a wrong type deep inside.
            self.refusal = CheckpointError(
                f"Could not read {self._display}/{METADATA_FILE}: it is not the metadata of a sharded checkpoint "
                f"({problem}); it was damaged or written by something else. Use another checkpoint."
            )
            raise self.refusal
        outside = sorted(
            {
                repr(getattr(info, "relative_path", None))
                for info in (getattr(metadata, "storage_data", None) or {}).values()
                if not _is_plain_file_name(getattr(info, "relative_path", None))
            }
        )
        if outside:
            self.refusal = CheckpointError(
                f"Refused to load {self._display}: its {METADATA_FILE} names shard files outside the folder "
                f"({', '.join(outside[:3])}); a checkpoint's own contents never choose what is opened. "
                "Delete the folder unless you know where it came from."
            )
            raise self.refusal
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


def _is_size(value: Any, length: Optional[int] = None) -> bool:
    return (
        isinstance(value, tuple)
        and (length is None or len(value) == length)
        and all(type(n) is int and n >= 0 for n in value)
    )


def _metadata_problem(metadata: Any) -> str:
    """What makes ``metadata`` (an unpickled ``.metadata``) not DCP's ``Metadata``, or ``""``.

    Every field a reader uses, with its type: a wrong one would otherwise surface as an
    ``AttributeError`` or ``TypeError`` from inside DCP or the consolidating reader.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if type(metadata) is not Metadata:
        return f"it holds {_shown(metadata)}, not a Metadata"
    entries = metadata.__dict__.get("state_dict_metadata")
    if type(entries) is not dict:
        return f"state_dict_metadata is {_shown(entries)}, not a dict"
    for key, entry in entries.items():
        if type(key) is not str:
            return f"a key of state_dict_metadata is {_shown(key)}, not a str"
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            return f"the entry {key!r} is {_shown(entry)}"
        size = entry.__dict__.get("size")
        properties = entry.__dict__.get("properties")
        chunks = entry.__dict__.get("chunks")
        if not _is_size(size):
            return f"the size of {key!r} is {_shown(size)}, not a torch.Size"
        if type(properties) is not TensorProperties or not isinstance(
            properties.__dict__.get("dtype"), torch.dtype
        ):
            return f"the properties of {key!r} are {_shown(properties)}, not TensorProperties with a dtype"
        if type(chunks) is not list or not all(
            type(chunk) is ChunkStorageMetadata
            and _is_size(chunk.__dict__.get("offsets"), len(size))
            and _is_size(chunk.__dict__.get("sizes"), len(size))
            and all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, size))
            for chunk in chunks
        ):
            return f"the chunks of {key!r} are not a list of chunks inside its size {tuple(size)}"
    planner_data = metadata.__dict__.get("planner_data")
    if planner_data is not None and (
        type(planner_data) is not dict
        or not all(type(path) in (tuple, list) for path in planner_data.values())
    ):
        return f"planner_data is {_shown(planner_data)}, not a dict of key paths"
    storage = metadata.__dict__.get("storage_data")
    if type(storage) is not dict:
        return f"storage_data is {_shown(storage)}, not a dict"
    for index, info in storage.items():
        if (
            type(index) is not MetadataIndex
            or type(info) is not _StorageInfo
            or type(index.__dict__.get("fqn")) is not str
        ):
            return f"storage_data maps {_shown(index)} to {_shown(info)}, not MetadataIndex to _StorageInfo"
        if not _is_size((info.__dict__.get("offset"), info.__dict__.get("length"))):
            return f"the shard entry of {index.fqn!r} has no offset and length (whole numbers, 0 or more)"
    if metadata.__dict__.get("storage_meta") is not None and type(metadata.storage_meta) is not StorageMeta:
        return f"storage_meta is {_shown(metadata.storage_meta)}"
    return ""


class _SafeFileSystemReader(_SafeMetadataReading, dcp.FileSystemReader):
    def __init__(self, path: str, display: str) -> None:
        super().__init__(path)
        self._display = display


class _SafeFsspecReader(_SafeMetadataReading, FsspecReader):
    """Reads the shard files of an object store folder in parallel, one thread per file.

    DCP's reader goes through the files of a load plan one after another; on an object store each
    file is a separate download, so they are read :data:`SHARD_IO_THREADS` at a time. The planner's
    callbacks only place tensors into distinct slots of the state dict, which threads may do at once.
    """

    def __init__(self, path: str, display: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self._display = display

    def read_data(self, plan: Any, planner: Any) -> Any:
        import dataclasses
        from concurrent.futures import ThreadPoolExecutor

        from torch.futures import Future

        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if len(per_file) <= 1:
            return super().read_data(plan, planner)
        read_file = super().read_data
        with ThreadPoolExecutor(min(SHARD_IO_THREADS, len(per_file)), thread_name_prefix="dcp-read") as pool:
            jobs = [
                pool.submit(read_file, dataclasses.replace(plan, items=items), planner)
                for items in per_file.values()
            ]
            for job in jobs:
                job.result().wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _load_bytes_safely(value: io.BytesIO, display: str) -> Any:
    """A non-tensor entry of a shard of the folder ``display``, without running code (DCP itself uses
    ``weights_only=False``). A refused class and a damaged entry are told apart: only the first is code."""
    with torch.serialization.safe_globals([io.BytesIO]):
        try:
            return load_weights_only(lambda: torch.load(value, weights_only=True), display)
        except CheckpointError:
            raise
        except Exception as err:
            refused = refused_global(str(err)) if isinstance(err, pickle.UnpicklingError) else None
            if refused is not None:
                raise CheckpointError(
                    f"Refused to load {display}: one of its entries asks to call or construct {refused} while "
                    "loading, and trainer-core never runs code from a checkpoint. Delete the folder unless you "
                    "know where it came from."
                ) from None
            raise CheckpointError(corrupt_message(display, err)) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    #: The folder being read, for errors; set by the reader's caller.
    display = "a sharded checkpoint"

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = _load_bytes_safely(value, self.display)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner, SafeLoadPlanner):
    pass


def describe_failure(err: BaseException) -> str:
    """``Type: message`` of what went wrong, without DCP's wall of per-rank tracebacks."""
    if isinstance(err, dcp.CheckpointException):
        causes = []
        for rank, failure in sorted(err.failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return "; ".join(causes) or "DCP failed"
    return f"{type(err).__name__}: {err}"


def _refusal(err: BaseException) -> Optional[CheckpointError]:
    """A :class:`CheckpointError` raised inside DCP (our safe readers' refusals), if that is the cause."""
    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [err]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, CheckpointError):
            return current
        if isinstance(current, dcp.CheckpointException):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in current.failures.values())
        stack.extend([current.__cause__, current.__context__])
    return None


def shard_error(url: str, err: BaseException) -> CheckpointError:
    """One clear error for a folder whose shards cannot be read; a refusal inside DCP keeps its words."""
    refusal = _refusal(err)
    if refusal is not None:
        return refusal
    return CheckpointError(
        f"Could not read the sharded checkpoint {url}: a shard is missing, truncated or does not match its "
        f"{METADATA_FILE} ({describe_failure(err)}). Use another checkpoint."
    )


def restore_empty_containers(checkpoint: dict[str, Any]) -> None:
    """Put back the empty containers DCP does not store, in place.

    DCP writes leaves only: an optimizer that holds no per-parameter state (plain SGD, or any
    optimizer before its first step) comes back without its ``"state"`` key, and a run without
    optimizers without ``optimizer_states``; both are part of the format.
    """
    if KEY_OPTIMIZER_STATES not in checkpoint:
        if KEY_LOOPS in checkpoint:  # a full checkpoint (not weights-only) always has the list
            checkpoint[KEY_OPTIMIZER_STATES] = []
        return
    states = _dcp_list(checkpoint[KEY_OPTIMIZER_STATES])
    for state in states:
        if isinstance(state, dict) and "param_groups" in state:
            state.setdefault("state", {})
    checkpoint[KEY_OPTIMIZER_STATES] = states


def _dcp_list(value: Any) -> list[Any]:
    """The list DCP stored as a dict keyed by index (``{"0": ..., "1": ...}``), back as a list."""
    if isinstance(value, dict) and all(str(k).isdigit() for k in value):
        return [value[k] for k in sorted(value, key=lambda k: int(k))]
    return list(value)
