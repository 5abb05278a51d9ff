"""Model weights as Hugging Face lays them out (safetensors), written and loaded one tensor at a time.

Writing (:func:`save_safetensors`, behind ``python -m trainer_core.checkpoint consolidate SRC --to
safetensors OUT_DIR``) produces what ``transformers``' ``save_pretrained`` produces: one
``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` of at most
``max_shard_size`` bytes each plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``). Each file is the safetensors
format (an 8-byte little-endian header length, a JSON header with every tensor's ``dtype``,
``shape`` and ``data_offsets``, then the bytes) and is written here directly, tensor by tensor:
the ``safetensors`` library's writers (``save_file``, ``save``) take a whole file's tensors in
memory at once, which is exactly what a consolidation of a large model cannot afford. The header
only needs dtypes and shapes, known before any tensor is read. Tensors are laid out as the library
lays them out (largest element size first, then by name) after a header padded to 8 bytes, so
every tensor starts aligned to its element size. The library reads the files back (the tests do).

Shared tensors (tied weights) are written once per name, as separate tensors: every name the
module's ``state_dict`` has then loads with ``strict=True``. ``safetensors.torch.save_file``
refuses shared tensors, and its ``save_model`` keeps one name of each tied group (a module whose
``load_state_dict`` is strict then misses the others); the cost here is the tied bytes twice.

Loading (:func:`load_safetensors`) reads a folder of either layout, or one ``.safetensors`` file,
on any fsspec URL, into a module: every header is read and checked first (missing or truncated
shards, an index that does not match its shards, missing, unexpected or mis-shaped names, and
each header at least as strictly as the library reads it, then by the library itself when it is
installed), so a bad folder is one :class:`~trainer_core.errors.CheckpointError` that names the
file and leaves the module as it was; then each tensor is read on its own and copied into the
parameter or buffer. A remote folder is downloaded to a temporary local folder (disk, not memory)
and checked there first, so that a connection failing part-way cannot leave the module half loaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import reprlib
import shutil
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import torch

from trainer_core.checkpoint.files import (
    commit_marker_path,
    fsync_dir,
    lock_temporary,
    publish_file,
    remove_abandoned_temporaries,
    replace_entry,
    temporary_path,
    write_commit_marker,
)
from trainer_core.checkpoint.stream import LazyTensor, read_exact, release_freed_memory, tensor_bytes
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike, is_local, resolve
from trainer_core.utilities import listing

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
_HEADER_ALIGNMENT = 8
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers
_MAX_COUNT = 2**63 - 1  # torch's sizes, strides and offsets are 64-bit signed

#: torch dtype -> safetensors dtype name (the format's spelling).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: The safetensors library's dtype order (its ``Dtype`` enum); a file lays tensors out by it,
#: descending, then by name, so that every tensor starts aligned to its element size.
#: Every name a write here can leave in its folder: the only names it ever replaces or removes there.
_OWN_NAME = re.compile(
    r"model\.safetensors|model\.safetensors\.index\.json|model-\d{5,}-of-\d{5,}\.safetensors"
)
_LIBRARY_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip

TensorLike = Union[torch.Tensor, LazyTensor]


def parse_size(text: Union[str, int]) -> int:
    """Bytes in ``text``: ``"5GB"`` (10**9 units, as Hugging Face counts), ``"500MiB"`` (2**20), ``"1000"``."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
        if match is None:
            raise CheckpointError(
                f"--max-shard-size {text!r} is not a size; write it like 5GB, 500MB, 2GiB or a number of bytes."
            )
        unit = (match.group(2) or "B").upper()
        scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
        size = int(float(match.group(1)) * scale)
    if size <= 0:
        raise CheckpointError(f"--max-shard-size must be positive (got {text!r}).")
    return size


# ---------------------------------------------------------------------- writing
@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    source: TensorLike


def _entry(name: str, tensor: TensorLike, origin: str) -> _Entry:
    if tensor.dtype not in DTYPE_NAMES:
        raise CheckpointError(
            f"{origin}: {name} is a {tensor.dtype} tensor, which safetensors cannot store "
            f"(it stores {', '.join(str(d).replace('torch.', '') for d in DTYPE_NAMES)}). "
            "Convert it, or leave it out with --strip-prefix."
        )
    shape = tuple(int(s) for s in tensor.shape)
    nbytes = tensor.numel() * tensor.element_size()
    return _Entry(name, tensor.dtype, shape, nbytes, tensor)


def plan_shards(entries: Sequence[_Entry], max_shard_size: Optional[int]) -> list[list[_Entry]]:
    """Group ``entries`` (in order) into files of at most ``max_shard_size`` bytes, as Hugging Face does:
    a new file starts when the next tensor would not fit; a tensor larger than the limit gets a file of its own."""
    if max_shard_size is None:
        return [list(entries)]
    shards: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for entry in entries:
        if entry.nbytes > max_shard_size:
            shards.append([entry])
            continue
        if current and size + entry.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current:
        shards.append(current)
    return shards or [[]]


def _layout(entries: Sequence[_Entry]) -> tuple[bytes, list[_Entry]]:
    """The file's header (length prefix included) and the order its tensors' bytes follow it."""
    ordered = sorted(entries, key=lambda e: (-_LIBRARY_DTYPE_ORDER.index(DTYPE_NAMES[e.dtype]), e.name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in ordered:
        header[entry.name] = {
            "dtype": DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text, ordered


def write_safetensors_file(file: Any, entries: Sequence[_Entry]) -> None:
    """Write ``entries`` as one safetensors file into the writable ``file``, one tensor in memory at a time."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; write them on a little-endian machine.")
    header, ordered = _layout(entries)
    file.write(header)
    for entry in ordered:
        source = entry.source
        tensor = (
            read_exact(source) if isinstance(source, LazyTensor) else source.detach().to("cpu").contiguous()
        )
        file.write(tensor_bytes(tensor))
        del tensor
        if isinstance(source, LazyTensor):
            release_freed_memory(entry.nbytes)


def save_safetensors(
    tensors: Mapping[str, TensorLike],
    out_dir: PathLike,
    max_shard_size: Union[int, str, None] = None,
    storage_options: Optional[dict[str, Any]] = None,
    origin: str = "",
) -> dict[str, Any]:
    """Write ``tensors`` (``{name: tensor or LazyTensor}``) as a Hugging Face weights folder at ``out_dir``.

    ``max_shard_size`` (bytes, or ``"5GB"``): shard into files of at most that size with an index,
    as ``save_pretrained(max_shard_size=...)`` does; ``None`` writes one ``model.safetensors``.
    Only our own names are written or removed in ``out_dir``: ``model.safetensors``,
    ``model-NNNNN-of-NNNNN.safetensors`` and ``model.safetensors.index.json``; every other file
    there (a model card, a tokenizer) is kept. On local disk a new ``out_dir`` is built under a
    temporary name and renamed into place; into an existing one (or the folder a link named
    ``out_dir`` points to) every file is first written completely into a temporary folder inside
    it, then renamed over its name, shards first and the index or ``model.safetensors`` last (a link
    of that name is replaced, its target untouched), and the files a previous write left under our
    other names (another shard count, a single file or an index no longer written) are removed,
    the stale index first. A failure while writing leaves the previous files as they were. On an
    object store, which has no rename, the folder's commit marker ``out_dir.complete`` is removed
    first, the files are written, stale files of our names removed, and the marker written last.
    Returns what was written (files, tensors, bytes).
    """
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    entries = [_entry(name, tensor, origin or os.fspath(out_dir)) for name, tensor in tensors.items()]
    shards = plan_shards(entries, limit)
    if len(shards) == 1:
        files = {SAFE_WEIGHTS_NAME: shards[0]}
    else:
        files = {_SHARD_NAME.format(index=i + 1, count=len(shards)): shard for i, shard in enumerate(shards)}
    total = sum(e.nbytes for e in entries)
    index = None
    if len(files) > 1:
        weight_map = {e.name: name for name, shard in files.items() for e in shard}
        index = json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True
        )
    _publish_folder(os.fspath(out_dir), files, index, storage_options or {})
    return {
        "path": os.fspath(out_dir),
        "files": sorted(files) + ([SAFE_WEIGHTS_INDEX_NAME] if index is not None else []),
        "tensors": len(entries),
        "bytes": total,
    }


def _publish_folder(
    url: str, files: Mapping[str, Sequence[_Entry]], index: Optional[str], options: dict[str, Any]
) -> None:
    fs, fs_path = resolve(url, **options)
    names = [*files, *([SAFE_WEIGHTS_INDEX_NAME] if index is not None else [])]
    if not is_local(fs):
        _publish_to_object_store(fs, fs_path, url.rstrip("/"), files, index, options)
    elif os.path.isdir(fs_path):  # a link to a folder is written into that folder
        _publish_into_local_folder(os.path.realpath(fs_path), files, index, names)
    else:
        _publish_new_local_folder(fs_path, files, index)


def _publish_new_local_folder(path: str, files: Mapping[str, Sequence[_Entry]], index: Optional[str]) -> None:
    """Build the folder under a temporary name next to ``path`` and rename it to ``path``."""
    parent = os.path.dirname(path.rstrip("/")) or "."
    os.makedirs(parent, exist_ok=True)
    remove_abandoned_temporaries(parent)
    with _temporary_folder(path) as temp:
        _write_files(temp, files, index)
        if os.path.lexists(path):
            replace_entry(temp, path)  # a file or a link (a folder is written into instead), itself replaced
        else:
            os.rename(temp, path)  # fails, removing nothing, should a folder have appeared there meanwhile
    fsync_dir(parent)


def _publish_into_local_folder(
    folder: str, files: Mapping[str, Sequence[_Entry]], index: Optional[str], names: Sequence[str]
) -> None:
    """Write our files into the existing ``folder``, keeping everything else in it.

    Every file is written completely (into a locked temporary folder inside ``folder``) before the
    first one is renamed into place, so a failure while writing leaves the previous files as they
    were. Then shards first, the index or ``model.safetensors`` last, each renamed over its name (a
    link of that name is replaced as a link, its target untouched); then what a previous write of
    ours left under another of our names is removed (:func:`_remove_stale_files`).
    """
    paths = [os.path.join(folder, name) for name in names]
    blocked = [path for path in paths if os.path.isdir(path) and not os.path.islink(path)]
    if blocked:
        raise CheckpointError(
            f"{blocked[0]} is a folder, where this writes a file; move it away and run again."
        )
    remove_abandoned_temporaries(folder)
    with _temporary_folder(os.path.join(folder, SAFE_WEIGHTS_NAME)) as temp:
        _write_files(temp, files, index)
        for name in names:  # the index or the one model.safetensors is last
            os.replace(os.path.join(temp, name), os.path.join(folder, name))
        os.rmdir(temp)
    fsync_dir(folder)
    _remove_stale_files(
        folder,
        [entry.name for entry in os.scandir(folder) if not entry.is_dir(follow_symlinks=False)],
        names,
        lambda stale: os.remove(os.path.join(folder, stale)),  # a link goes as a link
    )
    fsync_dir(folder)


@contextlib.contextmanager
def _temporary_folder(path: str) -> Any:
    """A new folder of our temporary pattern next to ``path``, locked while in use, removed if anything fails."""
    temp = temporary_path(path)
    os.mkdir(temp)
    held = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        lock_temporary(held)  # a live writer's folder is never cleaned up
        yield temp
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        os.close(held)


def _write_files(folder: str, files: Mapping[str, Sequence[_Entry]], index: Optional[str]) -> None:
    for name, shard in files.items():
        _write_local(os.path.join(folder, name), lambda f, shard=shard: write_safetensors_file(f, shard))
    if index is not None:
        _write_local(os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME), lambda f: f.write(index.encode()))
    fsync_dir(folder)


def _publish_to_object_store(
    fs: Any,
    fs_path: str,
    url: str,
    files: Mapping[str, Sequence[_Entry]],
    index: Optional[str],
    options: dict[str, Any],
) -> None:
    """No rename on an object store: the folder's commit marker says when it is whole (removed first, written last)."""
    base = fs_path.rstrip("/")
    if fs.exists(commit_marker_path(base)):
        fs.rm(commit_marker_path(base))
    present = (
        [info["name"].rstrip("/") for info in fs.ls(base, detail=True) if info.get("type") == "file"]
        if fs.isdir(base)
        else []
    )
    for name, shard in files.items():
        publish_file(
            f"{url}/{name}",
            lambda f, shard=shard: write_safetensors_file(f, shard),
            options,
            expected_bytes=sum(e.nbytes for e in shard),
            marker=False,
        )
    if index is not None:
        publish_file(
            f"{url}/{SAFE_WEIGHTS_INDEX_NAME}", lambda f: f.write(index.encode()), options, marker=False
        )
    names = [*files, *([SAFE_WEIGHTS_INDEX_NAME] if index is not None else [])]
    _remove_stale_files(
        base, [path.rsplit("/", 1)[-1] for path in present], names, lambda stale: fs.rm(f"{base}/{stale}")
    )
    write_commit_marker(fs, base, size=None)


def _remove_stale_files(
    folder: str, present: Sequence[str], written: Sequence[str], remove: Callable[[str], None]
) -> None:
    """Remove the files of ``present`` that a previous write of ours left and this one did not rewrite.

    Only our own exact names (``model.safetensors``, ``model.safetensors.index.json``,
    ``model-NNNNN-of-NNNNN.safetensors``) are candidates: anything else in the folder is the user's.
    A stale index goes first, so that no reader finds an index whose shards are gone.
    """
    stale = [name for name in present if _OWN_NAME.fullmatch(name) and name not in written]
    for name in sorted(stale, key=lambda name: name != SAFE_WEIGHTS_INDEX_NAME):
        try:
            remove(name)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise CheckpointError(
                f"Wrote {folder}, but could not remove {folder}/{name}, left by a previous write "
                f"({type(err).__name__}: {err}); remove it by hand, or readers may pick it up."
            ) from err


def _write_local(path: str, write: Any) -> None:
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------- reading
class LoadResult(NamedTuple):
    """What :func:`load_safetensors` found, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _FileHeader:
    url: str  # as the user spelled it, for errors
    path: str  # on its filesystem
    data_start: int
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]  # name -> dtype, shape, begin, end


def load_safetensors(
    module: torch.nn.Module,
    path: PathLike,
    strict: bool = True,
    storage_options: Optional[dict[str, Any]] = None,
) -> LoadResult:
    """Load the safetensors weights at ``path`` into ``module``, tensor by tensor; return missing and unexpected names.

    ``path``: a folder holding ``model.safetensors`` or ``model.safetensors.index.json`` and its
    shards (what :func:`save_safetensors` and ``save_pretrained`` write), or one ``.safetensors``
    file; any fsspec URL. Names are matched against ``module.state_dict()``'s tensors (names of
    non-tensor extra state are not expected: safetensors holds tensors only). Values are copied
    into the existing parameters and buffers (converting dtype and device, as
    ``load_state_dict`` does); memory added is one tensor at a time.

    Everything is checked before anything is copied, so a refused load leaves the module's weights
    bit-equal to before: every file's header (at least as strictly as the ``safetensors`` library
    reads it, and by the library itself when it is installed), the index against its shards, and
    the names, shapes and dtype kinds against the module. With ``strict=True`` a missing or
    unexpected name is one :class:`CheckpointError` listing them all; a shape or dtype-kind
    mismatch (floating into integer) is an error with either setting; with ``strict=False`` the
    names both have are loaded and the others returned. A folder on remote storage is first
    downloaded (the files the module needs) to a temporary local folder, disk not memory, and
    checked there: a connection that fails part-way fails before the first tensor is copied.
    Unlike ``load_state_dict``, a module's own ``_load_from_state_dict`` overrides and load hooks
    are not run: the tensors are copied into ``state_dict()``'s tensors directly.
    """
    from trainer_core.checkpoint.format import check_state_dict_matches

    display = os.fspath(path)
    fs, fs_path = resolve(display, **(storage_options or {}))
    with contextlib.ExitStack() as stack:
        headers = _read_headers(fs, fs_path, display)
        stored: dict[str, tuple[_FileHeader, tuple[torch.dtype, tuple[int, ...], int, int]]] = {}
        for header in headers:
            for name, info in header.tensors.items():
                stored[name] = (header, info)
        expected = {
            name: value
            for name, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)
        }
        loaded = {
            name: torch.empty(info[1], dtype=info[0], device="meta") for name, (_, info) in stored.items()
        }
        check_state_dict_matches(expected, loaded, display, strict=strict)
        result = LoadResult(
            missing_keys=[name for name in expected if name not in stored],
            unexpected_keys=[name for name in stored if name not in expected],
        )
        needed = [header for header in headers if any(name in expected for name in header.tensors)]
        if not is_local(fs):
            needed = _download(fs, needed, stack)
        readers = {header.path: _open_checked(header, stack) for header in needed}
        # From here on every byte is in a checked local file that stays open (mapped by the library
        # when it is installed): the copy below cannot meet a file it has not checked.
        with torch.no_grad():
            for header in needed:
                names = [name for name in header.tensors if name in expected]
                try:
                    for name, tensor in _read_tensors(header, names, readers[header.path]):
                        expected[name].copy_(tensor)
                        del tensor
                except Exception as err:  # only a file changed in place after its check gets here
                    raise CheckpointError(
                        f"Could not read {header.url} while loading it ({type(err).__name__}: {err}); it changed "
                        "after it was checked, and the module is partly loaded. Load it again once nothing "
                        "writes to it."
                    ) from err
    return result


def _download(fs: Any, headers: Sequence[_FileHeader], stack: contextlib.ExitStack) -> list[_FileHeader]:
    """Copy the remote files of ``headers`` into a temporary local folder; their headers, checked again there."""
    import tempfile

    from fsspec.implementations.local import LocalFileSystem

    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="trainer-core-safetensors-"))
    local = []
    for i, header in enumerate(headers):
        target = os.path.join(folder, f"{i}.safetensors")
        try:
            fs.get(header.path, target)
        except Exception as err:
            raise CheckpointError(
                f"Could not download {header.url} ({type(err).__name__}: {err}); check the storage and load "
                "again. The module is unchanged."
            ) from err
        copy = _read_header(LocalFileSystem(), target, header.url)  # it may have changed since
        if copy.tensors != header.tensors:
            raise CheckpointError(
                f"{header.url} changed while it was being loaded (its header is not the one read first); load "
                "again once nothing writes to it. The module is unchanged."
            )
        local.append(copy)
    return local


def _open_checked(header: _FileHeader, stack: contextlib.ExitStack) -> Any:
    """The local file of ``header``, opened for the copy: with ``safe_open`` when the library is installed,
    so that its own checks run too (before any tensor is copied); else a plain file."""
    try:
        from safetensors import safe_open
    except ImportError:
        return stack.enter_context(open(header.path, "rb"))
    try:
        reader = stack.enter_context(safe_open(header.path, framework="pt", device="cpu"))
        found = {
            name: (reader.get_slice(name).get_shape(), reader.get_slice(name).get_dtype())
            for name in reader.keys()
        }
    except Exception as err:  # the library's SafetensorError, or an OSError
        raise CheckpointError(
            f"{header.url} is not a readable safetensors file: the safetensors library refuses it "
            f"({type(err).__name__}: {err}). Write it again (consolidate --to safetensors), or copy it again if it "
            "was downloaded."
        ) from None
    checked = {
        name: (list(shape), DTYPE_NAMES[dtype]) for name, (dtype, shape, _, _) in header.tensors.items()
    }
    if found != checked:
        raise CheckpointError(
            f"{header.url} changed while it was being loaded (the library reads other tensors than the header "
            "read first); load again once nothing writes to it. The module is unchanged."
        )
    return reader


def _read_headers(fs: Any, fs_path: str, display: str) -> list[_FileHeader]:
    """Every file's checked header; one :class:`CheckpointError` naming the file for anything wrong."""
    if not fs.exists(fs_path):
        raise CheckpointError(
            f"{display} does not exist; pass a folder written by consolidate --to safetensors (or save_pretrained) "
            "or a .safetensors file."
        )
    if not fs.isdir(fs_path):
        if fs_path.endswith(SAFE_WEIGHTS_INDEX_NAME):
            return _read_index(fs, fs_path.rsplit("/", 1)[0], display.rsplit("/", 1)[0])
        if not fs_path.endswith(".safetensors"):
            raise CheckpointError(
                f"{display} is neither a folder nor a .safetensors file; pass the folder that holds "
                f"{SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}."
            )
        return [_read_header(fs, fs_path, display)]
    base = fs_path.rstrip("/")
    if fs.exists(f"{base}/{SAFE_WEIGHTS_INDEX_NAME}"):
        return _read_index(fs, base, display.rstrip("/"))
    if fs.exists(f"{base}/{SAFE_WEIGHTS_NAME}"):
        return [_read_header(fs, f"{base}/{SAFE_WEIGHTS_NAME}", f"{display.rstrip('/')}/{SAFE_WEIGHTS_NAME}")]
    raise CheckpointError(
        f"{display} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}; pass a folder written by "
        "consolidate --to safetensors (or save_pretrained)."
    )


def _read_index(fs: Any, base: str, display: str) -> list[_FileHeader]:
    index_url = f"{display}/{SAFE_WEIGHTS_INDEX_NAME}"
    try:
        with fs.open(f"{base}/{SAFE_WEIGHTS_INDEX_NAME}", "rb") as f:
            text = _read_up_to(f, _MAX_HEADER_BYTES + 1)
        if len(text) > _MAX_HEADER_BYTES:
            raise ValueError(f"it is larger than {_MAX_HEADER_BYTES} bytes")
        index = _parse_json(text)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map is not a {name: file} object")
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise CheckpointError(
            f"{index_url} is not a safetensors index ({type(err).__name__}: {_short(str(err))}); write the folder "
            "again."
        ) from None
    except OSError as err:
        raise CheckpointError(
            f"Could not read {index_url} ({type(err).__name__}: {err}); check the storage."
        ) from err
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    bad = sorted(file for file in by_file if any(c in file for c in "/\\\0") or file in ("", ".", ".."))
    if bad:
        raise CheckpointError(
            f"Refused to load {index_url}: it names files outside its folder ({listing([_short(b) for b in bad])}); "
            "delete the folder unless you know where it came from."
        )
    missing = sorted(file for file in by_file if not fs.exists(f"{base}/{file}"))
    if missing:
        raise CheckpointError(
            f"{display} is incomplete: {index_url} names shard files that are not there "
            f"({listing([f'{display}/{file}' for file in missing])}). "
            "Copy the missing shards into the folder, or write it again with consolidate --to safetensors."
        )
    headers = []
    for file, names in by_file.items():
        header = _read_header(fs, f"{base}/{file}", f"{display}/{file}")
        lacking = sorted(set(names) - set(header.tensors))
        extra = sorted(set(header.tensors) - set(names))
        if lacking or extra:
            problems = []
            if lacking:
                problems.append(f"lacks {len(lacking)} tensors the index puts there ({listing(lacking)})")
            if extra:
                problems.append(f"holds {len(extra)} tensors the index does not put there ({listing(extra)})")
            raise CheckpointError(
                f"{header.url} does not match {index_url}: it {' and '.join(problems)}. The index and the shards "
                "come from different saves; write the folder again."
            )
        headers.append(header)
    return headers


def _parse_json(text: bytes) -> Any:
    """``text`` as strict JSON, as the library (serde_json) reads it: UTF-8, no ``NaN``/``Infinity``, no
    repeated key, no string that is not valid Unicode; any of those is a ``ValueError``."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON value")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            key.encode("utf-8")  # a lone surrogate escape ("\ud800") is a UnicodeEncodeError, a ValueError
            if key in obj:
                raise ValueError(f"the key {_short(key)} appears twice")
            obj[key] = value
        return obj

    return json.loads(text.decode("utf-8"), parse_constant=constant, object_pairs_hook=unique)


def _short(value: Any) -> str:
    """``value`` for an error message, cut short: a hostile header can hold huge names and lists."""
    return reprlib.repr(value)


def _read_up_to(file: Any, size: int) -> bytes:
    """``size`` bytes of ``file``, fewer only at its end: a remote read may return less than asked."""
    parts, got = [], 0
    while got < size:
        part = file.read(size - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # not bool, not float; sizes are bounded by the file's


def _read_header(fs: Any, path: str, display: str) -> _FileHeader:
    """The checked header of the safetensors file ``path``: at least every check the library makes."""

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(
            f"{display} is not a readable safetensors file: {why}. Write it again (consolidate --to safetensors), "
            "or copy it again if it was downloaded."
        )

    try:
        size = fs.size(path)
        with fs.open(path, "rb") as f:
            prefix = _read_up_to(f, 8)
            if len(prefix) < 8:
                raise corrupt(f"it is {size} bytes long, shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER_BYTES or 8 + length > size:
                raise corrupt(f"its header claims {length} bytes, but the file is {size} bytes (truncated?)")
            text = _read_up_to(f, length)
        if not text.startswith(b"{"):
            raise corrupt("its header does not start with '{'")
        raw = _parse_json(text)
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as err:  # UnicodeError is a ValueError
        raise corrupt(f"its header is not JSON ({_short(str(err))})") from None
    except OSError as err:
        raise CheckpointError(
            f"Could not read {display} ({type(err).__name__}: {err}); check the storage."
        ) from err
    if not isinstance(raw, dict):
        raise corrupt("its header is not a JSON object")
    metadata = raw.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise corrupt("its __metadata__ is not an object of strings")
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_entry(name, info, corrupt)
    # As the library checks: the ranges tile the data exactly, with no gap and no overlap.
    end = 0
    for _, _, begin, stop in sorted(tensors.values(), key=lambda info: (info[2], info[3])):
        if begin != end:
            raise corrupt("its tensors' byte ranges overlap or leave gaps")
        end = stop
    if 8 + length + end != size:
        raise corrupt(
            f"its header describes {8 + length + end} bytes but the file is {size} bytes"
            + (" (truncated)" if size < 8 + length + end else "")
        )
    return _FileHeader(display, path, 8 + length, tensors)


def _tensor_entry(
    name: str, info: Any, corrupt: Callable[[str], CheckpointError]
) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """One checked header entry ``{"dtype", "shape", "data_offsets"}`` as ``(dtype, shape, begin, end)``."""
    if not isinstance(info, dict):
        raise corrupt(f"its header entry for {_short(name)} is not an object")
    dtype = _DTYPES_BY_NAME.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise corrupt(
            f"{_short(name)} has dtype {_short(info.get('dtype'))}, not one of {', '.join(_DTYPES_BY_NAME)}"
        )
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise corrupt(f"the shape of {_short(name)} ({_short(shape)}) is not a list of whole numbers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(v) for v in offsets)):
        raise corrupt(
            f"the data_offsets of {_short(name)} ({_short(offsets)}) are not two whole numbers >= 0"
        )
    begin, stop = offsets
    # torch's sizes and strides are 64-bit signed: the product of the sizes (a 0 counted as 1) must fit.
    extent = 1
    for s in shape:
        extent *= max(s, 1)
        if extent > _MAX_COUNT:
            raise corrupt(f"the shape of {_short(name)} ({_short(shape)}) is too large")
    numel = math.prod(shape)
    if begin > stop or stop - begin != numel * torch.empty((), dtype=dtype).element_size():
        raise corrupt(f"the byte range of {_short(name)} does not match its dtype and shape")
    return dtype, tuple(shape), begin, stop


def _read_tensors(header: _FileHeader, names: Sequence[str], reader: Any) -> Any:
    """``(name, tensor)`` for ``names`` of one checked local file opened by :func:`_open_checked`."""
    if not hasattr(reader, "readinto"):  # safe_open: mapped, no copy until copy_
        for name in names:
            yield name, reader.get_tensor(name)
        return
    for name in names:
        dtype, shape, begin, stop = header.tensors[name]
        buffer = bytearray(stop - begin)
        reader.seek(header.data_start + begin)
        view = memoryview(buffer)
        got = 0
        while got < len(buffer):
            n = reader.readinto(view[got:])
            if not n:
                raise EOFError(f"it ended early while reading {name}")
            got += n
        tensor = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
        yield name, tensor.reshape(shape)
