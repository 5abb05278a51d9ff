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
shards, an index that does not match its shards, missing, unexpected or mis-shaped names), so a
bad folder is one :class:`~trainer_core.errors.CheckpointError` that names the file and leaves the
module as it was; then each tensor is read on its own and copied into the parameter or buffer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import torch

from trainer_core.checkpoint.stream import (
    LazyTensor,
    publish_file,
    read_exact,
    release_freed_memory,
    tensor_bytes,
)
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike, is_local, resolve
from trainer_core.utilities import listing

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
_HEADER_ALIGNMENT = 8
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers

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
    The folder is published whole: on local disk it is built under a temporary name and renamed
    over ``out_dir`` (a previous folder stays until then, and stays if anything fails); on an
    object store, which has no rename, the previous folder's commit marker is removed first, the
    files are written, stale files of the previous folder removed, and the marker
    ``out_dir.complete`` written last. Returns what was written (files, tensors, bytes).
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
    from trainer_core.plugins.io.checkpoint_io import (
        commit_marker_path,
        fsync_dir,
        lock_temporary,
        remove_abandoned_temporaries,
        replace_entry,
        temporary_path,
        write_commit_marker,
    )

    fs, fs_path = resolve(url, **options)
    names = [*files, *([SAFE_WEIGHTS_INDEX_NAME] if index is not None else [])]
    if is_local(fs):
        parent = os.path.dirname(fs_path.rstrip("/")) or "."
        os.makedirs(parent, exist_ok=True)
        remove_abandoned_temporaries(parent)
        temp = temporary_path(fs_path)
        os.makedirs(temp)
        held = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            lock_temporary(held)  # a live writer's folder is never cleaned up
            for name, shard in files.items():
                _write_local(
                    os.path.join(temp, name), lambda f, shard=shard: write_safetensors_file(f, shard)
                )
            if index is not None:
                _write_local(os.path.join(temp, SAFE_WEIGHTS_INDEX_NAME), lambda f: f.write(index.encode()))
            fsync_dir(temp)
            replace_entry(temp, fs_path)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        finally:
            os.close(held)
        fsync_dir(parent)
        return
    # An object store: no rename, so the marker says when the folder is whole.
    if fs.exists(commit_marker_path(fs_path)):
        fs.rm(commit_marker_path(fs_path))
    previous = [p for p in fs.find(fs_path)] if fs.isdir(fs_path) else []
    for name, shard in files.items():
        size = sum(e.nbytes for e in shard)
        publish_file(
            f"{url.rstrip('/')}/{name}",
            lambda f, shard=shard: write_safetensors_file(f, shard),
            options,
            expected_bytes=size,
            marker=False,
        )
    if index is not None:
        publish_file(
            f"{url.rstrip('/')}/{SAFE_WEIGHTS_INDEX_NAME}",
            lambda f: f.write(index.encode()),
            options,
            marker=False,
        )
    written = {f"{fs_path.rstrip('/')}/{name}" for name in names}
    stale = [p for p in previous if p.rstrip("/") not in written]
    if stale:
        fs.rm(stale)
    write_commit_marker(fs, fs_path, size=None)


def _write_local(path: str, write: Any) -> None:
    with open(path, "wb") as f:
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

    Everything is checked before anything is copied, so with ``strict=True`` a missing or
    unexpected name is one :class:`CheckpointError` listing them all, with the module unchanged; a
    shape or dtype-kind mismatch (floating into integer) is an error with either setting; with
    ``strict=False`` the names both have are loaded and the others returned. Unlike
    ``load_state_dict``, a module's own ``_load_from_state_dict`` overrides and load hooks are not
    run: the tensors are copied into ``state_dict()``'s tensors directly.
    """
    from trainer_core.checkpoint.format import check_state_dict_matches

    display = os.fspath(path)
    fs, fs_path = resolve(display, **(storage_options or {}))
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
    loaded = {name: torch.empty(info[1], dtype=info[0], device="meta") for name, (_, info) in stored.items()}
    check_state_dict_matches(expected, loaded, display, strict=strict)
    result = LoadResult(
        missing_keys=[name for name in expected if name not in stored],
        unexpected_keys=[name for name in stored if name not in expected],
    )
    local = is_local(fs)
    with torch.no_grad():
        for header in headers:
            names = [name for name in header.tensors if name in expected]
            if not names:
                continue
            try:
                for name, tensor in _read_tensors(fs, header, names, local):
                    expected[name].copy_(tensor)
                    del tensor
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(
                    f"Could not read {header.url} while loading it ({type(err).__name__}: {err}); the module is "
                    "partly loaded. Check the storage and load again."
                ) from err
    return result


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
            index = json.loads(f.read().decode())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map is not a {name: file} object")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{index_url} is not a safetensors index ({type(err).__name__}: {err}); write the folder again."
        ) from None
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    bad = sorted(file for file in by_file if "/" in file or "\\" in file or file in ("", ".", ".."))
    if bad:
        raise CheckpointError(
            f"Refused to load {index_url}: it names files outside its folder ({listing(bad)}); delete the folder "
            "unless you know where it came from."
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


def _read_header(fs: Any, path: str, display: str) -> _FileHeader:
    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(
            f"{display} is not a readable safetensors file: {why}. Write it again (consolidate --to safetensors), "
            "or copy it again if it was downloaded."
        )

    try:
        size = fs.size(path)
        with fs.open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(f"it is {size} bytes long, shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER_BYTES or 8 + length > size:
                raise corrupt(f"its header claims {length} bytes, but the file is {size} bytes (truncated?)")
            raw = json.loads(f.read(length).decode())
    except CheckpointError:
        raise
    except (ValueError, UnicodeDecodeError) as err:
        raise corrupt(f"its header is not JSON ({err})") from None
    except OSError as err:
        raise CheckpointError(
            f"Could not read {display} ({type(err).__name__}: {err}); check the storage."
        ) from err
    if not isinstance(raw, dict):
        raise corrupt("its header is not a JSON object")
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    end = 0
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES_BY_NAME[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, stop = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"its header entry for {name!r} is malformed or has an unknown dtype") from None
        numel = 1
        for s in shape:
            numel *= s
        if stop - begin != numel * torch.empty((), dtype=dtype).element_size() or begin < 0:
            raise corrupt(f"the byte range of {name!r} does not match its dtype and shape")
        tensors[name] = (dtype, shape, begin, stop)
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


def _read_tensors(fs: Any, header: _FileHeader, names: Sequence[str], local: bool) -> Any:
    """``(name, tensor)`` for ``names`` of one file: mapped with ``safe_open`` locally, ranged reads elsewhere."""
    if local:
        try:
            from safetensors import safe_open
        except ImportError:
            safe_open = None
        if safe_open is not None:
            with safe_open(header.path, framework="pt", device="cpu") as f:
                for name in names:
                    yield name, f.get_tensor(name)
            return
    with fs.open(header.path, "rb") as f:
        for name in names:
            dtype, shape, begin, stop = header.tensors[name]
            buffer = bytearray(stop - begin)
            f.seek(header.data_start + begin)
            view = memoryview(buffer)
            got = 0
            while got < len(buffer):
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{header.url} ended early while reading {name}; it is truncated.")
                got += n
            tensor = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
            yield name, tensor.reshape(shape)
