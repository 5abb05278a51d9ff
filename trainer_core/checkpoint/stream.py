"""Write a checkpoint file tensor by tensor: memory bounded by the largest tensor, whatever the total.

``torch.save`` needs every tensor in memory at once; consolidating a sharded folder that way needs
host memory for the whole model and optimizer state (DeepSpeed #4025: more than a TB). Here the
checkpoint's structure is known first and its tensors are read one at a time:

* :class:`LazyTensor` stands for a tensor by its dtype and shape, with a ``read`` that produces it.
* :func:`write_torch_zip` writes the same zip file ``torch.save`` writes (``data.pkl``, the format
  records, then one ``data/<key>`` record per storage, 64-byte aligned, each with its CRC-32), but
  calls ``read`` for one storage at a time and frees it before the next. The pickle it writes is
  the one ``torch.save`` would write for the real tensors (``_rebuild_tensor_v2`` of a persistent
  storage id), so ``torch.load(weights_only=True)`` and every plugin read it as an ordinary file.
  Why not ``torch.serialization.skip_data()`` and a second pass filling the bytes in: that pass
  needs seeks (no object store has them) and the CRC-32 of each record would have to be patched.
* :class:`ShardedSource` reads a ``torch.distributed.checkpoint`` folder in this process, without
  a process group: its small non-tensor part at once, each tensor on its own when asked.

Publishing the written file atomically is :func:`trainer_core.checkpoint.files.publish_file`'s job.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike


@dataclass(eq=False)
class LazyTensor:
    """A tensor not read yet: its ``dtype`` and ``shape``, and ``read()`` that returns it (on CPU).

    ``name`` says where it comes from, for errors. Equality is identity: two lazy tensors are two
    storages in the written file, as two tensors read from a sharded folder are. ``release``, if
    given, gets the tensor back once its record is written, for a reader that reuses its memory;
    otherwise it is freed and the memory returned to the system (:func:`release_freed_memory`).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    name: str = ""
    release: Optional[Callable[[torch.Tensor], None]] = None

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # What Tensor._reduce_ex_internal returns for a contiguous CPU tensor without requires_grad;
        # the storage is a reference the pickler turns into a persistent id.
        if self.dtype in torch.storage._new_dtypes():
            storage = _StorageRef(self, typed=False)
            args: tuple[Any, ...] = (storage, 0, self.shape, self.stride(), False, OrderedDict(), self.dtype)
            return torch._utils._rebuild_tensor_v3, args
        storage = _StorageRef(self, typed=True)
        return torch._utils._rebuild_tensor_v2, (storage, 0, self.shape, self.stride(), False, OrderedDict())

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, dtype={self.dtype}, shape={tuple(self.shape)})"


@dataclass(eq=False)
class _StorageRef:
    tensor: LazyTensor
    typed: bool


def read_exact(lazy: LazyTensor) -> torch.Tensor:
    """``lazy.read()``, checked against the promised dtype and shape, as one contiguous CPU tensor
    that owns exactly its bytes (what a zip record or a safetensors range is written from)."""
    tensor = lazy.read()
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.dtype != lazy.dtype
        or tuple(tensor.shape) != lazy.shape
    ):
        got = (
            f"{tensor.dtype} {tuple(tensor.shape)}"
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise CheckpointError(
            f"{lazy.name or 'a tensor'} was read as {got}, but its metadata promised {lazy.dtype} "
            f"{lazy.shape}; the checkpoint is corrupt. Use another checkpoint."
        )
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU ``tensor`` (any dtype, bf16 included), without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


#: Below this a freed tensor is not worth a trim (it never moved glibc's mmap threshold much).
_TRIM_FROM_BYTES = 2**20


def release_freed_memory(nbytes: int = _TRIM_FROM_BYTES) -> None:
    """Give the memory of the ``nbytes`` tensor just freed back to the system (glibc's ``malloc_trim``).

    After a freed block of N bytes glibc raises its mmap threshold to N, so the next tensors of
    that size come from the heap, whose freed pages it keeps: reading tensor after tensor would
    hold several of them for good. Trimming after each large one keeps the process at one tensor
    (measured: 8 x 25 MiB peaked at 78 MiB without, 28 MiB with). Small tensors are skipped, so a
    checkpoint of many small tensors pays nothing. Nothing happens where the C library is not glibc.
    """
    if nbytes < _TRIM_FROM_BYTES:
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_MALLOC_TRIM: list[Any] = []


def _malloc_trim() -> Optional[Callable[[int], int]]:
    if not _MALLOC_TRIM:
        function = None
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError, AttributeError):
                function = ctypes.CDLL("libc.so.6").malloc_trim
        _MALLOC_TRIM.append(function)
    return _MALLOC_TRIM[0]


# ---------------------------------------------------------------------- the torch.save zip, streamed
def write_torch_zip(obj: Any, file: Any) -> None:
    """Write ``obj`` into the writable ``file`` as ``torch.save(obj, file)`` would, reading each
    :class:`LazyTensor` only when its record is written, and freeing it before the next one.

    Real tensors in ``obj`` (the small trainer state) are written as ``torch.save`` writes them.
    Memory: the pickle of the structure plus one tensor (and the file's own buffer).
    """
    records: dict[str, Any] = {}  # storage key -> real untyped storage or LazyTensor
    keys: dict[Any, str] = {}
    storage_dtypes: dict[int, torch.dtype] = {}

    def persistent_id(item: Any) -> Any:
        if isinstance(item, _StorageRef):
            lazy = item.tensor
            key = keys.setdefault(("lazy", id(lazy)), str(len(keys)))
            records[key] = lazy
            if item.typed:
                storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[lazy.dtype])
                return ("storage", storage_type, key, "cpu", lazy.numel())
            return ("storage", torch.UntypedStorage, key, "cpu", lazy.nbytes)
        if isinstance(item, torch.storage.TypedStorage) or torch.is_storage(item):
            return _real_storage_id(item, keys, records, storage_dtypes)
        return None

    class _Pickler(pickle.Pickler):
        def persistent_id(self, item: Any) -> Any:
            return persistent_id(item)

    data = io.BytesIO()
    _Pickler(data, protocol=2).dump(obj)  # torch.save's DEFAULT_PROTOCOL
    with torch.serialization._open_zipfile_writer(file) as zip_file:
        pickled = data.getvalue()
        del data
        zip_file.write_record("data.pkl", pickled, len(pickled))
        zip_file.write_record(".format_version", "1", len("1"))
        alignment = str(torch.serialization._get_storage_alignment())
        zip_file.write_record(".storage_alignment", alignment, len(alignment))
        zip_file.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key in list(records):
            source = records.pop(key)  # dropped as soon as written
            if isinstance(source, LazyTensor):
                tensor = read_exact(source)
                zip_file.write_record(f"data/{key}", tensor.untyped_storage(), tensor.nbytes)
                if source.release is not None:
                    source.release(tensor)
                    del tensor
                else:
                    del tensor
                    release_freed_memory(source.nbytes)
            else:
                storage = source if source.device.type == "cpu" else source.cpu()
                zip_file.write_record(f"data/{key}", storage, storage.nbytes())


def _real_storage_id(
    item: Any, keys: dict[Any, str], records: dict[str, Any], storage_dtypes: dict[int, torch.dtype]
) -> tuple[Any, ...]:
    """torch.save's persistent id of a real storage (torch/serialization.py ``_save``)."""
    if isinstance(item, torch.storage.TypedStorage):
        storage = item._untyped_storage
        dtype = item.dtype
        storage_type = getattr(torch, item._pickle_storage_type())
        numel = item._size()
    else:
        storage = item
        dtype = torch.uint8
        storage_type = torch.serialization.normalize_storage_type(type(item))
        numel = storage.nbytes()
    if storage.device.type != "meta" and storage.data_ptr() != 0:
        if storage_dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
            raise RuntimeError(
                "Cannot save multiple tensors or storages that view the same data as different types"
            )
    key = keys.setdefault(("real", storage._cdata), str(len(keys)))
    records[key] = storage
    return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


# ---------------------------------------------------------------------- reading a sharded folder
class ShardedSource:
    """A sharded (``torch.distributed.checkpoint``) checkpoint folder, read one tensor at a time.

    Opening it reads ``trainer_state.pt`` and ``.metadata`` (both small) and checks that the folder
    is complete; :meth:`checkpoint` returns the whole checkpoint with a :class:`LazyTensor` for every
    tensor, nested exactly as :meth:`DistributedCheckpointIO.load_checkpoint` nests the real ones.
    Reading goes through the same safe readers (no code is unpickled, no file outside the folder
    is opened), with no process group.
    """

    def __init__(self, url: PathLike, storage_options: Optional[dict[str, Any]] = None) -> None:
        from trainer_core.plugins.io.sharded_reader import load_trainer_state, open_reader

        self.url = os.fspath(url)
        self.trainer_state = load_trainer_state(self.url, storage_options)
        self._reader = open_reader(self.url, storage_options)
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)

    @property
    def shard_files(self) -> int:
        return len({info.relative_path for info in self.metadata.storage_data.values()})

    def entries(self) -> Iterator[tuple[str, tuple[Any, ...], Any]]:
        """``(flat key, path of keys, metadata)`` of every stored entry, in the folder's order."""
        planner_data = self.metadata.planner_data or {}
        for key, entry in self.metadata.state_dict_metadata.items():
            yield key, tuple(planner_data.get(key, (key,))), entry

    def lazy_tensor(self, key: str, entry: Any) -> LazyTensor:
        size = tuple(int(s) for s in entry.size)
        return LazyTensor(
            entry.properties.dtype, size, lambda: self.read_tensor(key), name=f"{self.url}: {key}"
        )

    def read_tensor(self, key: str) -> torch.Tensor:
        """The full tensor stored under the flat ``key`` (all its chunks, from every rank's shard)."""
        entry = self.metadata.state_dict_metadata[key]
        chunks = entry.chunks
        if len(chunks) == 1 and not any(chunks[0].offsets) and tuple(chunks[0].sizes) == tuple(entry.size):
            whole = self._read_whole_chunk(key, chunks[0])
            if whole is not None:
                return whole
        # Several chunks (a tensor sharded across ranks): DCP copies each into the full tensor.
        target = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        self._read({key: target})
        return target

    def _read_whole_chunk(self, key: str, chunk: Any) -> Optional[torch.Tensor]:
        """The one chunk that is the whole tensor, as loaded, without DCP's copy into a second tensor.

        DCP's ``read_data`` loads a chunk and copies it into the target: two tensors alive at once.
        This is its per-item step for the one item (torch 2.13's reader attributes); ``None`` where
        the reader lacks them, and the caller takes DCP's way.
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        reader = self._reader
        if not all(
            hasattr(reader, name) for name in ("_slice_file", "transforms", "storage_data", "fs", "path")
        ):
            return None
        index = MetadataIndex(key, chunk.offsets)
        info = reader.storage_data.get(index)
        if info is None:
            return None
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=index,
            dest_offsets=torch.Size([0] * len(chunk.sizes)),
            storage_index=index,
            storage_offsets=torch.Size([0] * len(chunk.sizes)),
            lengths=chunk.sizes,
        )
        try:
            with reader.fs.create_stream(
                reader.fs.concat_path(reader.path, info.relative_path), "rb"
            ) as stream:
                source = reader.transforms.transform_load_stream(
                    item, info.transform_descriptors or (), reader._slice_file(stream, info)
                )
                if not source.seekable():
                    source = io.BytesIO(source.read(-1))
                tensor = torch.load(source, map_location="cpu", weights_only=True)
        except CheckpointError:
            raise
        except Exception as err:
            from trainer_core.plugins.io.sharded_reader import shard_error

            raise shard_error(self.url, err) from err
        return tensor

    def read_values(self, keys: list[str]) -> dict[str, Any]:
        """The non-tensor entries under the flat ``keys`` (small: numbers, strings, lists)."""
        values: dict[str, Any] = {key: None for key in keys}
        if keys:
            self._read(values)
        return values

    def _read(self, template: dict[str, Any]) -> None:
        """Fill the flat ``template`` from the folder: DCP's own load steps, with the metadata read once."""
        from torch.distributed.checkpoint import CheckpointException

        from trainer_core.plugins.io.sharded_reader import SafeLoadPlanner, shard_error

        planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        planner.display = self.url
        try:
            planner.set_up_planner(template, self.metadata, True)
            plans = planner.create_global_plan([self._reader.prepare_local_plan(planner.create_local_plan())])
            plan = planner.finish_plan(self._reader.prepare_global_plan(plans)[0])
            self._reader.read_data(plan, planner).wait()
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as err:
            raise (self._reader.refusal or shard_error(self.url, err)) from err

    def checkpoint(self) -> dict[str, Any]:
        """The whole checkpoint, every tensor a :class:`LazyTensor` (see the class docstring)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from trainer_core.checkpoint.format import validate_checkpoint
        from trainer_core.plugins.io.sharded_reader import restore_empty_containers

        entries = list(self.entries())
        values = self.read_values(
            [key for key, _, entry in entries if not isinstance(entry, TensorStorageMetadata)]
        )
        stored: dict[str, Any] = {}
        for key, path, entry in entries:
            value = self.lazy_tensor(key, entry) if isinstance(entry, TensorStorageMetadata) else values[key]
            _set_element(stored, path, value)
        checkpoint = dict(self.trainer_state)
        checkpoint.update(stored)
        restore_empty_containers(checkpoint)
        validate_checkpoint(checkpoint, self.url)
        return checkpoint


def _set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """DCP's ``set_element`` (how ``_EmptyStateDictLoadPlanner`` nests what it read back)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def iter_lazy_tensors(obj: Any) -> Iterator[LazyTensor]:
    """Every :class:`LazyTensor` inside ``obj`` (dicts, lists, tuples)."""
    if isinstance(obj, LazyTensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_lazy_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_lazy_tensors(value)


def save_torch_file(obj: Any, file: Any) -> None:
    """``torch.save(obj, file)``; where ``obj`` holds a :class:`LazyTensor`, :func:`write_torch_zip`, which
    writes the same bytes reading each lazy tensor only when its record is written (a full FSDP
    checkpoint gathered while it is written, say)."""
    if next(iter_lazy_tensors(obj), None) is None:
        torch.save(obj, file)
    else:
        write_torch_zip(obj, file)
