"""``DistributedCheckpointIO``: a sharded checkpoint as a folder, every rank writing its own shards.

The tensors (model and optimizer state) go through ``torch.distributed.checkpoint`` (DCP): each
rank writes the shards it holds, in parallel, and DCP writes ``.metadata`` last, so a folder
without it is incomplete and never picked. Everything else (loops, callbacks, schedulers, every
rank's RNG, hyper-parameters) is small and is written first by rank 0 as ``trainer_state.pt``.

Loading at another world size reshards: the loading plugin hands a template of its own shards
(``load_into``) and DCP fills it. Any other plugin, or a process with no process group at all,
reads the folder as one full checkpoint (``load_checkpoint``), which is also what
``python -m trainer_core.checkpoint consolidate`` writes out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import pickletools
import re
import shutil
from collections.abc import Iterator
from typing import Any, Optional

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

from trainer_core import paths
from trainer_core.checkpoint import (
    KEY_LOOPS,
    KEY_OPTIMIZER_STATES,
    KEY_STATE_DICT,
    validate_checkpoint,
)
from trainer_core.checkpoint.format import load_weights_only
from trainer_core.checkpoint.stream import GuardedWriter
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike
from trainer_core.plugins.io.checkpoint_io import (
    CheckpointIO,
    lock_temporary,
    remove_abandoned_temporaries,
    replace_entry,
    temporary_path,
)

METADATA_FILE = ".metadata"
TRAINER_STATE_FILE = "trainer_state.pt"
#: What completes a sharded folder, in the order it is written: rank 0's trainer state, then DCP's metadata.
SHARDED_COMMIT_FILES = (TRAINER_STATE_FILE, METADATA_FILE)
_SHARDED_KEYS = (KEY_STATE_DICT, KEY_OPTIMIZER_STATES)
#: Shard files each rank writes to, and reads from, an object store at the same time.
SHARD_IO_THREADS = 4
# Every file DCP and this IO write into a sharded folder: the metadata (also per rank, and under its
# temporary name while written), the shards ``__<rank>_<n>.distcp`` and rank 0's trainer state.
_OWN_FILE = re.compile(r"^(?:(?:__\d+)?\.metadata(?:\.tmp)?|__\d+_\d+\.distcp|trainer_state\.pt)$")


def is_sharded_file_name(name: str) -> bool:
    """Whether ``name`` is a file DCP or this IO writes into a sharded folder (all a removal may delete)."""
    return bool(_OWN_FILE.match(name))


def is_sharded_checkpoint(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> bool:
    """Whether ``path`` is a folder written by this IO (complete or not)."""
    fs, fs_path = paths.resolve(path, **(storage_options or {}))
    return fs.isdir(fs_path) and fs.exists(f"{fs_path}/{TRAINER_STATE_FILE}")


class DistributedCheckpointIO(CheckpointIO):
    """Sharded checkpoints with ``torch.distributed.checkpoint``; every rank calls ``save_checkpoint``."""

    def __init__(self, storage_options: Optional[dict[str, Any]] = None) -> None:
        self._storage_options = dict(storage_options or {})

    def _resolve(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        return paths.resolve(path, **self._storage_options)

    def folder_commit_files(self) -> tuple[str, ...]:
        return SHARDED_COMMIT_FILES

    def owns_folder_file(self, name: str) -> bool:
        return is_sharded_file_name(name)

    # ------------------------------------------------------------------ writing
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        """Write ``checkpoint`` as a folder; a collective: every rank calls it with its own shards."""

        url = os.fspath(path)
        fs, fs_path = self._resolve(url)
        local = paths.is_local(fs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        # A local folder is built under a temporary name and swapped in whole, so an existing
        # checkpoint of the same name stays readable until the new one is complete.
        target = _agree(temporary_path(fs_path)) if local else fs_path
        sharded = {key: checkpoint[key] for key in _SHARDED_KEYS if key in checkpoint}
        rest = {key: value for key, value in checkpoint.items() if key not in _SHARDED_KEYS}
        held: Optional[int] = None  # rank 0's lock on the local temporary folder
        try:
            if rank == 0:
                if not local and fs.exists(f"{fs_path}/{METADATA_FILE}"):
                    fs.rm(f"{fs_path}/{METADATA_FILE}")  # the old folder is no longer complete
                if local:
                    # What a writer killed mid-save left here; then our own folder, locked while in use.
                    remove_abandoned_temporaries(os.path.dirname(fs_path))
                fs.makedirs(target, exist_ok=True)
                if local:
                    held = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
                    lock_temporary(held)
                with fs.open(f"{target}/{TRAINER_STATE_FILE}", "wb") as f:
                    guarded = GuardedWriter(f, max_piece=None)
                    torch.save(rest, guarded)
                    guarded.raise_error()
            _barrier()
            writer = dcp.FileSystemWriter(target) if local else _fsspec_writer(url, self._storage_options)
            writer.fs = _GuardedStreams(
                writer.fs
            )  # a failed write raises its own error, not torch's "unexpected pos"
            dcp.save(sharded, storage_writer=writer, no_dist=not _distributed())
            _barrier()
            if rank == 0 and local:
                # Also over a ``save_last="link"`` symlink, which a folder cannot be renamed over.
                replace_entry(target, fs_path, is_sharded_file_name)
            _barrier()
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            if rank == 0 and local and os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            raise CheckpointError(
                f"Could not write the sharded checkpoint {url}: {_cause(err)}. Other "
                "checkpoints are unchanged; fix the cause (space, permissions, credentials) and save again."
            ) from err
        finally:
            if held is not None:
                os.close(held)

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove the sharded checkpoint at ``path``: the files DCP and this IO wrote there, by name.

        ``.metadata`` goes first, so a reader never picks half a folder. Any other entry (a file put
        there by hand, a symlink, a subfolder) is kept, and so is the folder then, with a warning; an
        empty folder is removed. A link at ``path`` (``save_last="link"``) is removed as a link, its
        target left as it is. A single-file checkpoint is removed as :class:`TorchCheckpointIO` does.
        """
        fs, fs_path = self._resolve(path)
        local = paths.is_local(fs)
        if local and os.path.islink(fs_path):
            os.remove(fs_path)
            return
        if not fs.exists(fs_path):
            return
        if not fs.isdir(fs_path):
            from trainer_core.plugins.io.torch_io import TorchCheckpointIO

            TorchCheckpointIO(self._storage_options).remove_checkpoint(path)
            return
        if fs.isfile(f"{fs_path}/{METADATA_FILE}"):
            fs.rm(f"{fs_path}/{METADATA_FILE}")  # incomplete first, so a reader never picks half of it
        ours, others = [], []
        for info in fs.ls(fs_path, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            plain = info.get("type") == "file" and not info.get("islink", False)
            (ours if plain and is_sharded_file_name(name) else others).append(info["name"])
        if ours:
            # The trainer state, a commit file, goes last.
            fs.rm(sorted(ours, key=lambda p: p.endswith(TRAINER_STATE_FILE)))
        if others:
            from trainer_core.utilities import rank_zero_warn

            shown = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in others)
            rank_zero_warn(
                f"Removed the sharded checkpoint {os.fspath(path)}, but not the folder: it also holds "
                f"{', '.join(shown[:5])}{', ...' if len(shown) > 5 else ''}, which trainer-core did not write and "
                "kept. Remove the folder yourself if they are not needed."
            )
        elif local:
            with contextlib.suppress(OSError):
                os.rmdir(fs_path)  # only if empty: something written into it meanwhile stays
        else:
            with contextlib.suppress(OSError):  # FileNotFoundError included
                fs.rmdir(fs_path)  # memory:// keeps empty folders; an object store has none

    # ------------------------------------------------------------------ reading
    def _check_complete(self, path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
        url = os.fspath(path)
        fs, fs_path = self._resolve(url)
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
        return fs, fs_path

    def _reader(self, url: str) -> Any:
        """A DCP reader of the folder ``url`` that never unpickles code and never leaves the folder."""
        fs, fs_path = self._resolve(url)
        if paths.is_local(fs):
            reader: _SafeMetadataReading = _SafeFileSystemReader(fs_path, display=url)
        else:
            reader = _SafeFsspecReader(url, display=url, **self._storage_options)
        reader.check_metadata()
        return reader

    def load_trainer_state(self, path: PathLike) -> dict[str, Any]:
        """The non-tensor part of a sharded checkpoint (everything but model and optimizer tensors)."""
        fs, fs_path = self._check_complete(path)
        from trainer_core.plugins.io.torch_io import TorchCheckpointIO

        # The same safe, checked read as a single-file checkpoint (weights_only, clear errors).
        return TorchCheckpointIO._torch_load(
            fs, f"{fs_path}/{TRAINER_STATE_FILE}", f"{os.fspath(path)}/{TRAINER_STATE_FILE}", "cpu"
        )

    def stored_keys(self, path: PathLike) -> set[str]:
        """The flattened keys (``optimizer_states.0.state.net.0.weight.exp_avg``) the folder holds tensors or values for."""
        self._check_complete(path)
        return set(self._reader(os.fspath(path)).read_metadata().state_dict_metadata)

    def load_into(self, path: PathLike, template: dict[str, Any]) -> dict[str, Any]:
        """Fill ``template`` (this run's own shards) from the folder, resharding as needed; a collective."""

        checkpoint = self.load_trainer_state(path)
        url = os.fspath(path)
        reader = self._reader(url)
        try:
            planner = _SafeLoadPlanner()
            planner.display = url
            dcp.load(template, storage_reader=reader, planner=planner)
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise (reader.refusal or _shard_error(url, err)) from err
        checkpoint.update(template)
        validate_checkpoint(checkpoint, url)
        return checkpoint

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        """The whole checkpoint as full tensors, in this process, without a process group.

        A single-file checkpoint (written by any other plugin, or by FSDP with ``"full"``) is read
        too, so a sharded run can resume from one.
        """
        fs, fs_path = self._resolve(path)
        if fs.exists(fs_path) and not fs.isdir(fs_path):
            from trainer_core.plugins.io.torch_io import TorchCheckpointIO

            return TorchCheckpointIO(self._storage_options).load_checkpoint(path, map_location)
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        checkpoint = self.load_trainer_state(path)
        url = os.fspath(path)
        reader = self._reader(url)
        tensors: dict[str, Any] = {}
        try:
            planner = _SafeEmptyLoadPlanner()
            planner.display = url
            _load_state_dict(tensors, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as err:  # DCP's error is a BaseException
            raise (reader.refusal or _shard_error(url, err)) from err
        checkpoint.update(tensors)
        _restore_empty_containers(checkpoint)
        if map_location is not None:
            checkpoint = _map(checkpoint, map_location)
        validate_checkpoint(checkpoint, url)
        return checkpoint


# ------------------------------------------------------------------ safe reading of DCP folders
# torch's DCP readers unpickle ``.metadata`` with plain ``pickle.load`` and every non-tensor entry
# with ``torch.load(weights_only=False)``: a crafted folder would run code when loaded. These
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
    from trainer_core.plugins.io.torch_io import _corrupt_message, _refused_global

    with torch.serialization.safe_globals([io.BytesIO]):
        try:
            return load_weights_only(lambda: torch.load(value, weights_only=True), display)
        except CheckpointError:
            raise
        except Exception as err:
            refused = _refused_global(str(err)) if isinstance(err, pickle.UnpicklingError) else None
            if refused is not None:
                raise CheckpointError(
                    f"Refused to load {display}: one of its entries asks to call or construct {refused} while "
                    "loading, and trainer-core never runs code from a checkpoint. Delete the folder unless you "
                    "know where it came from."
                ) from None
            raise CheckpointError(_corrupt_message(display, err)) from None


class _SafeLoadPlanner(DefaultLoadPlanner):
    #: The folder being read, for errors; set by the reader's caller.
    display = "a sharded checkpoint"

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = _load_bytes_safely(value, self.display)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner, _SafeLoadPlanner):
    pass


class _GuardedStreams:
    """A DCP filesystem whose write streams keep the first write error and raise it once DCP is done.

    ``torch.save`` inside DCP turns an error raised by ``write`` (disk full, connection reset) into
    an unrelated ``RuntimeError("unexpected pos ...")``; the guard hands back the real cause.
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        #: Every write error, from any of DCP's writer threads: an extra thread's exception ends
        #: only that thread, so :class:`_CheckedFsspecWriter` raises the first one for the rank.
        self.errors: list[BaseException] = []

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if not any(ch in mode for ch in "wa+"):
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self._fs.create_stream(path, mode) as stream:  # an upload is sent when this closes
                guarded = _GuardedStream(stream)
                yield guarded
                guarded.raise_error()
        except BaseException as err:
            self.errors.append(err)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class _GuardedStream(GuardedWriter):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream, max_piece=None)

    def __getattr__(self, name: str) -> Any:  # tell, fileno, ...
        return getattr(self._file, name)


def _cause(err: BaseException) -> str:
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


def _shard_error(url: str, err: BaseException) -> CheckpointError:
    """One clear error for a folder whose shards cannot be read; a refusal inside DCP keeps its words."""
    refusal = _refusal(err)
    if refusal is not None:
        return refusal
    return CheckpointError(
        f"Could not read the sharded checkpoint {url}: a shard is missing, truncated or does not match its "
        f"{METADATA_FILE} ({_cause(err)}). Use another checkpoint."
    )


def _restore_empty_containers(checkpoint: dict[str, Any]) -> None:
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


def _map(obj: Any, location: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(location)
    if isinstance(obj, dict):
        return {k: _map(v, location) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, location) for v in obj]
    return obj


def _agree(value: str) -> str:
    """Rank 0's ``value`` on every rank (a temporary folder name must be the same everywhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _CheckedFsspecWriter(FsspecWriter):
    """DCP's fsspec writer, failing the rank when any of its writer threads failed.

    With ``thread_count > 1`` DCP writes files in extra threads whose exceptions it never collects:
    the rank would report success with shards missing, and ``.metadata`` (which completes the folder)
    would be written over a torn checkpoint. Raising here fails the save on every rank instead.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        errors = getattr(self.fs, "errors", None)
        if errors:
            raise errors[0]
        return written


def _fsspec_writer(url: str, storage_options: dict[str, Any]) -> Any:
    # Each rank splits its shards into SHARD_IO_THREADS files written by as many threads: every rank
    # and every thread uploads at once (one s3fs upload per file).
    return _CheckedFsspecWriter(url, thread_count=SHARD_IO_THREADS, **storage_options)
