"""Full state dicts of FSDP2 models, gathered to rank 0 in buckets of bounded size.

torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``StateDictOptions(full_state_dict=True, cpu_offload=True)`` gather one ``DTensor`` at a time: one
all-gather per tensor (about a hundred for a 16-layer model with Adam), and every rank receives
every whole tensor only for all ranks but 0 to drop it. Here torch's *sharded* state dict (same
keys, same order) is walked once instead; every ``DTensor`` sharded ``Shard(0)`` over a 1-D mesh of
all ranks is cut into ranges of rows, and one ``dist.gather`` per bucket brings them to rank 0 only,
into full CPU tensors. A tensor larger than a bucket is split over several buckets by rows and
moves without a copy: each rank sends its rows from where they lie, rank 0 receives them where they
belong in the full tensor. Smaller tensors are packed, as bytes (any dtype), into one flat buffer
per rank and copied out on rank 0.

Memory: :func:`gather_full_state_dict` leaves the full state on rank 0's CPU, as torch's path does,
plus at most one bucket (the receive buffer of packed buckets); every other rank holds at most its
share of one bucket (the send buffer) and nothing else. :class:`StreamedGather` (a full save) gives
rank 0 placeholders instead and gathers each tensor when the file writer reaches it, the next bucket
in flight meanwhile: rank 0 then holds the tensor being written, the bucket in flight and the
receive buffer, not the state.

Every other value goes the way torch's path takes it, so the result is the same dict, bit for bit:
a ``DTensor`` on a 2-D mesh (HSDP), replicated, tensor-parallel, or on a mesh that is not all
ranks in rank order is gathered by itself (``full_tensor``); a plain tensor is moved to the CPU
(``.to("cpu")``, no copy when it is there already, as torch does); numbers, strings and ``None``
stay; dicts, lists and tuples are rebuilt. Ranks other than 0 get ``{}``. :func:`can_gather`
says whether a state holds only such values; the caller uses torch's own path when it does not.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

#: Bytes that one collective brings to rank 0 (all ranks' parts of one bucket together): rank 0's
#: memory above the full state, and ``world_size`` times what each other rank holds while gathering.
#: Small on purpose: on gloo over loopback (the 2-core machine this was measured on) a gather of more
#: than about 16 MB ran 2-4x slower per byte than one of 16 MB or less, and a collective's fixed cost
#: is already small against 16 MB (``benchmarks/fsdp_checkpoint.py --bucket-mb`` tries others). ``None`` makes the FSDP plugin use
#: torch's one-tensor-at-a-time gather instead (for comparison).
GATHER_BUCKET_BYTES: Optional[int] = 16 * 2**20

#: Whether a full save under ``FSDPPlugin`` gathers its state while rank 0 writes the file
#: (:class:`StreamedGather`); ``False`` gathers it whole first, then writes (the path before issue 32,
#: kept for comparison: ``benchmarks/fsdp_checkpoint.py`` measures both).
STREAM_FULL_SAVES = True

#: Each packed range starts at a multiple of this many bytes (copies run faster on aligned memory).
_ALIGN = 64
_SCALARS = (int, float, str, bytes, io.BytesIO, type(None))


def can_gather(state: Any) -> bool:
    """Whether ``state`` holds only what :func:`gather_full_state_dict` knows how to gather.

    That is plain tensors, ``DTensor``, numbers, strings, ``None``, dicts, lists and tuples; any other
    tensor subclass (``ShardedTensor`` of FSDP1, say) or object is left to torch. The answer depends on
    types alone, so every rank comes to the same one.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(state, torch.Tensor):
        return type(state) in (torch.Tensor, DTensor)
    if isinstance(state, _SCALARS):
        return True
    if isinstance(state, dict):
        return all(can_gather(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(can_gather(value) for value in state)
    return False


@torch.no_grad()
def gather_full_state_dict(state: dict[str, Any], bucket_bytes: Optional[int] = None) -> dict[str, Any]:
    """The full state of ``state`` (a sharded state dict) on rank 0, on the CPU; ``{}`` on other ranks.

    A collective: every rank calls it with a state of the same structure (as torch's own gather
    requires). ``bucket_bytes`` (default :data:`GATHER_BUCKET_BYTES`) bounds what one collective
    gathers; a single row larger than that is gathered by itself.
    """
    rank, world = _rank_and_world()
    run = _BucketRun(bucket_bytes, rank, world)
    rows = _planned_rows(state, run)
    run.finish()
    full = _rebuild(state, iter(rows), rank == 0)
    return full if rank == 0 else {}


class StreamedGather:
    """Full states whose bucketed tensors are gathered only when a writer reads them (one save's worth).

    :meth:`add` returns, on rank 0, the full state with a :class:`~trainer_core.checkpoint.stream.LazyTensor`
    (dtype and shape) in place of each tensor that goes into buckets; reading it (the streamed torch
    file writer does, record by record) runs the buckets up to the last one that tensor needs and
    starts the next, so the gather of one tensor overlaps the write of the one before. Rank 0 then
    holds about one bucket and one tensor at a time, not the whole state. Other ranks get ``{}`` and
    send every bucket in :meth:`finish`, which every rank must call once the file is written (or its
    writing has failed: rank 0 then receives what is left and drops it), so that the collectives match.

    States are gathered in the order they were added, whatever the order the writer reads them in;
    a tensor read before the ones planned ahead of it makes rank 0 keep those until they are read.
    Tensors that do not go into buckets (see :func:`gather_full_state_dict`) are gathered in
    :meth:`add`, on every rank, as there.
    """

    def __init__(self, bucket_bytes: Optional[int] = None) -> None:
        self._rank, world = _rank_and_world()
        self._memory = _Reused()
        self._run = _BucketRun(bucket_bytes, self._rank, world, self._memory)

    @torch.no_grad()
    def add(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a sharded state dict) as :func:`gather_full_state_dict` gives it, its bucketed
        tensors lazy. A collective only for tensors gathered by themselves."""
        rows = _planned_rows(state, self._run)
        full = _rebuild(state, iter(rows), self._rank == 0, self._lazy)
        return full if self._rank == 0 else {}

    @torch.no_grad()
    def finish(self) -> None:
        """Run the buckets not read yet (every rank; rank 0 drops what they bring). A collective."""
        from trainer_core.checkpoint.stream import release_freed_memory

        self._run.finish(discard=True)
        release_freed_memory()  # the reused buffers, freed now

    def _lazy(self, item: _Rows) -> Any:
        from trainer_core.checkpoint.stream import LazyTensor

        return LazyTensor(
            item.dtype,
            tuple(item.shape),
            functools.partial(self._read, item),
            "a gathered FSDP tensor",
            release=self._memory.give,
        )

    @torch.no_grad()
    def _read(self, item: _Rows) -> torch.Tensor:
        return self._run.take(item)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _planned_rows(state: dict[str, Any], run: _BucketRun) -> list[Optional[_Rows]]:
    """For each ``DTensor`` of ``state`` (in :func:`_rebuild`'s order), its rows, planned into ``run``'s
    buckets, or ``None`` when it is gathered by itself."""
    found: list[Any] = []
    _collect_dtensors(state, found)
    distributed = dist.is_available() and dist.is_initialized()
    rows = _bucketable(found, run.rank, run.world) if distributed else [None] * len(found)
    run.add([r for r in rows if r is not None])
    return rows


# ----------------------------------------------------------------------------- which tensors


@dataclass
class _Rows:
    """One ``DTensor`` sharded ``Shard(0)``: this rank's rows as bytes and, on rank 0, the full tensor.

    Rank ``r`` holds rows ``[r * chunk, (r + 1) * chunk)`` of the full tensor, cut at ``rows``: the
    layout of ``torch.chunk`` (and of ``Shard.local_shard_size_and_offset``), so with uneven sizes the
    last ranks hold fewer rows, or none.
    """

    local: torch.Tensor  # (local rows, row_bytes) uint8 view of this rank's shard
    mesh: Any
    shape: torch.Size
    dtype: torch.dtype
    chunk: int
    row_bytes: int
    full: Optional[torch.Tensor] = None  # rank 0: the full CPU tensor
    full_bytes: Optional[torch.Tensor] = None  # rank 0: (rows, row_bytes) uint8 view of ``full``
    last_bucket: int = -1  # place of the last bucket holding its rows in :class:`_BucketRun`'s order
    memory: Optional[_Reused] = None  # where ``full`` comes from, if not a new tensor (a streamed save)

    @property
    def rows(self) -> int:
        return self.shape[0]

    def target(self) -> torch.Tensor:
        if self.full_bytes is None:
            if self.memory is None:
                self.full = torch.empty(self.shape, dtype=self.dtype, device="cpu")
            else:
                self.full = self.memory.take(self.shape, self.dtype)
            self.full_bytes = self.full.view(-1).view(torch.uint8).view(self.rows, self.row_bytes)
        return self.full_bytes


def _collect_dtensors(obj: Any, found: list[Any]) -> None:
    """Every ``DTensor`` in ``obj``, in the order :func:`_rebuild` meets them."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect_dtensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_dtensors(value, found)


def _bucketable(dtensors: list[Any], rank: int, world: int) -> list[Optional[_Rows]]:
    """For each ``DTensor``, its rows if it goes into buckets, else ``None`` (gathered by itself).

    Decided from the global layout only (mesh, placements, shape), identical on every rank. The
    mesh must be all ranks in rank order (mesh coordinate = rank = place in ``dist.gather``'s list),
    on one device type (that of the first such tensor), so that one group carries every bucket.
    """
    from torch.distributed.tensor import Shard

    device_type: Optional[str] = None
    everyone = list(range(world))
    out: list[Optional[_Rows]] = []
    for value in dtensors:
        mesh = value.device_mesh
        placements = value.placements
        fits = (
            mesh.ndim == 1
            and len(placements) == 1
            and type(placements[0]) is Shard  # not _StridedShard, a subclass
            and placements[0].dim == 0
            and value.ndim >= 1
            and value.numel() > 0
            and mesh.mesh.flatten().tolist() == everyone
            and (device_type is None or mesh.device_type == device_type)
        )
        if not fits:
            out.append(None)
            continue
        device_type = mesh.device_type
        out.append(_rows_of(value, rank, world))
    return out


def _rows_of(value: Any, rank: int, world: int) -> _Rows:
    shape = value.shape
    chunk = -(-shape[0] // world)
    local = value.to_local()
    expected = max(0, min(shape[0], (rank + 1) * chunk) - rank * chunk)
    if local.shape[0] != expected or local.shape[1:] != shape[1:]:
        # DTensor's Shard(0) is torch.chunk's layout; anything else is a change in torch to look at.
        raise RuntimeError(
            f"rank {rank} holds a shard of shape {tuple(local.shape)} of a {tuple(shape)} tensor sharded Shard(0) "
            f"over {world} ranks; expected {expected} rows. Set trainer_core.plugins.fsdp_gather.GATHER_BUCKET_BYTES "
            "= None to gather with torch's own path."
        )
    row_bytes = value.numel() // shape[0] * value.element_size()
    local_bytes = local.contiguous().view(-1).view(torch.uint8).view(expected, row_bytes)
    return _Rows(local_bytes, value.device_mesh, shape, value.dtype, chunk, row_bytes)


class _Reused:
    """The memory of full tensors already written, reused for the next ones of the same size.

    A streamed save gathers one tensor after another, mostly of a few sizes (a layer's weight and its
    optimizer moments). A new tensor each time costs a page fault per 4 KiB and, to keep the process
    from holding freed memory, a ``malloc_trim`` after each (measured: about a tenth of a save); here
    each size keeps at most ``keep`` spare buffers, so rank 0 holds a few tensors' worth, not more.
    Tensors below :data:`_REUSE_FROM_BYTES` are not kept (they cost little either way).
    """

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._spare: dict[int, list[torch.Tensor]] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        spare = self._spare.get(nbytes)
        raw = spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8)
        return raw.view(dtype).view(shape)

    def give(self, tensor: torch.Tensor) -> None:
        """Take back a tensor from :meth:`take` (its record written); kept if its size has room."""
        nbytes = tensor.nbytes
        spare = self._spare.setdefault(nbytes, [])
        if nbytes >= _REUSE_FROM_BYTES and len(spare) < self.keep:
            spare.append(tensor.reshape(-1).view(torch.uint8))

    def clear(self) -> None:
        self._spare.clear()


#: Full tensors from this size up have their memory reused in a streamed save.
_REUSE_FROM_BYTES = 2**20


# ----------------------------------------------------------------------------- buckets


@dataclass
class _Piece:
    """Rows ``[first, first + count)`` of every rank's chunk of one tensor, at ``offset`` in each rank's part."""

    rows: _Rows
    first: int
    count: int
    offset: int

    def held(self, rank: int) -> int:
        """How many of the piece's rows rank ``rank`` holds (fewer at the uneven end, or none)."""
        return max(0, min(self.count, self.rows.rows - rank * self.rows.chunk - self.first))


@dataclass
class _Bucket:
    """What one ``dist.gather`` carries: each rank's part is ``used`` bytes, the pieces one after the other."""

    pieces: list[_Piece]
    used: int
    group: Any = None  # the process group and the device of the collective (set by :class:`_BucketRun`)
    device: Optional[torch.device] = None


def _plan(items: list[_Rows], part_bytes: int) -> list[_Bucket]:
    """Cut the tensors into buckets whose part on each rank is at most ``part_bytes``.

    A tensor whose chunk is more than a quarter of a part gets buckets of its own (cut by rows into
    equal pieces when it is larger than a part; a single row larger than a part is a bucket by
    itself): a bucket of one piece is gathered without a copy, from where each rank holds its rows
    into where rank 0 puts them. The smaller tensors share buckets, packed one after the other, so
    only they are copied.
    """
    buckets: list[_Bucket] = []
    current: Optional[_Bucket] = None
    for item in items:
        chunk_bytes = item.chunk * item.row_bytes
        if 4 * chunk_bytes < part_bytes:
            offset = -(-current.used // _ALIGN) * _ALIGN if current is not None else 0
            if current is None or offset + chunk_bytes > part_bytes:
                current = _Bucket([], 0)
                buckets.append(current)
                offset = 0
            current.pieces.append(_Piece(item, 0, item.chunk, offset))
            current.used = offset + chunk_bytes
            continue
        rows = -(-item.chunk // -(-chunk_bytes // part_bytes))
        for first in range(0, item.chunk, rows):
            count = min(rows, item.chunk - first)
            buckets.append(_Bucket([_Piece(item, first, count, 0)], count * item.row_bytes))
    return buckets


class _BucketRun:
    """The buckets of one or more states, gathered to rank 0 one ``dist.gather`` at a time, in order.

    Every rank runs the same buckets in the same order (a collective each). Rank 0 starts each gather
    without waiting for it (``async_op``): :meth:`take` lands the buckets a tensor needs and leaves
    the next one in flight, so gloo's threads receive it while the caller writes the tensor to the
    file. One bucket is landed (waited for, its packed pieces copied out) before the next starts, so
    one send and one receive buffer serve every bucket.
    """

    def __init__(
        self, bucket_bytes: Optional[int], rank: int, world: int, memory: Optional[_Reused] = None
    ) -> None:
        if bucket_bytes is None:
            bucket_bytes = GATHER_BUCKET_BYTES or 0
        if bucket_bytes <= 0:
            raise ValueError(
                f"gather_full_state_dict(bucket_bytes={bucket_bytes}): give a positive number of bytes."
            )
        self.bucket_bytes = bucket_bytes
        self.rank = rank
        self.world = world
        self._buckets: list[_Bucket] = []
        self._largest = 0  # bytes of the largest bucket's part: the size of the send and receive buffers
        self._started = 0  # buckets whose gather has started
        self._landed = 0  # buckets whose bytes are in the full tensors
        self._in_flight: Optional[tuple[Any, _Bucket, list[torch.Tensor], list[int]]] = None
        self._send: dict[torch.device, torch.Tensor] = {}
        self._receive: dict[torch.device, torch.Tensor] = {}
        self._discard = False  # drop each full tensor as it lands (a save given up on rank 0)
        self.memory = memory

    def add(self, items: list[_Rows]) -> None:
        """Plan ``items``'s buckets after those already planned (one state's tensors, one group)."""
        if not items:
            return
        mesh = items[0].mesh
        # Every item's mesh is all ranks in rank order on one device type: any of their groups will do.
        group = mesh.get_group()
        device = _comm_device(mesh.device_type)
        for item in items:
            item.memory = self.memory
        for bucket in _plan(items, max(1, self.bucket_bytes // self.world)):
            bucket.group, bucket.device = group, device
            for piece in bucket.pieces:
                piece.rows.last_bucket = len(self._buckets)
            self._buckets.append(bucket)
            self._largest = max(self._largest, bucket.used)

    def take(self, item: _Rows) -> torch.Tensor:
        """Rank 0: ``item``'s full tensor, gathered; the run keeps no reference to it afterwards."""
        while self._landed <= item.last_bucket:
            self._advance()
        if self._in_flight is None and self._started < len(self._buckets):
            self._start()  # in flight while the caller writes this tensor
        full = item.full
        if full is None:
            raise RuntimeError(f"the gathered tensor of shape {tuple(item.shape)} was taken already")
        item.full = item.full_bytes = None
        return full

    def finish(self, discard: bool = False) -> None:
        """Run every bucket not run yet; ``discard`` (rank 0): keep none of what they bring."""
        self._discard = discard
        while self._landed < len(self._buckets):
            self._advance()
        self._send.clear()
        self._receive.clear()
        if self.memory is not None:
            self.memory.clear()

    def _advance(self) -> None:
        if self._in_flight is None:
            self._start()
        self._land()

    def _start(self) -> None:
        bucket = self._buckets[self._started]
        self._started += 1
        send = _in_place_send(bucket, self.rank, bucket.device)
        if send is None:
            send = _pack(bucket, self.rank, self._buffer(self._send, (self._largest,), bucket.device))
        if self.rank != 0:
            dist.gather(send, None, dst=0, group=bucket.group)
            self._landed += 1
            return
        parts = _in_place_receive(bucket, self.world, bucket.device)
        buffered = [r for r, part in enumerate(parts) if part is None]
        if buffered:
            receive = self._buffer(self._receive, (self.world, self._largest), bucket.device)
            for r in buffered:
                parts[r] = receive[r, : bucket.used]
        work = dist.gather(send, parts, dst=0, group=bucket.group, async_op=True)
        self._in_flight = (work, bucket, parts, buffered)

    def _land(self) -> None:
        if self._in_flight is None:
            return
        work, bucket, parts, buffered = self._in_flight
        self._in_flight = None
        work.wait()
        for r in buffered:
            _unpack(bucket, r, parts[r])
        if self._discard:
            for piece in bucket.pieces:
                if piece.rows.last_bucket == self._landed:
                    piece.rows.full = piece.rows.full_bytes = None
        self._landed += 1

    @staticmethod
    def _buffer(
        buffers: dict[torch.device, torch.Tensor], shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        """A buffer of ``shape`` on ``device``, made when a bucket first needs it (again if the largest bucket grew)."""
        buffer = buffers.get(device)
        if buffer is None or tuple(buffer.shape) != shape:
            buffer = buffers[device] = torch.empty(shape, dtype=torch.uint8, device=device)
        return buffer


def _in_place_send(bucket: _Bucket, rank: int, device: torch.device) -> Optional[torch.Tensor]:
    """This rank's rows of a one-piece bucket where they lie, if it holds them all on the collective's device."""
    if len(bucket.pieces) != 1:
        return None
    piece = bucket.pieces[0]
    local = piece.rows.local
    if piece.held(rank) != piece.count or local.device != device:
        return None
    return local[piece.first : piece.first + piece.count].view(-1)


def _pack(bucket: _Bucket, rank: int, buffer: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``bucket`` in ``buffer``; rows it does not hold (the uneven end) are left as they are."""
    for piece in bucket.pieces:
        count = piece.held(rank)
        if count:
            size = count * piece.rows.row_bytes
            part = buffer[piece.offset : piece.offset + size].view(count, piece.rows.row_bytes)
            part.copy_(piece.rows.local[piece.first : piece.first + count])
    return buffer[: bucket.used]


def _in_place_receive(bucket: _Bucket, world: int, device: torch.device) -> list[Optional[torch.Tensor]]:
    """For each rank, where its part of a one-piece bucket lands straight in the full tensor (rank 0, CPU).

    ``None`` where it cannot: a bucket of several pieces, a rank at the uneven end (its part is padded),
    or a collective on an accelerator (the full tensors are on the CPU).
    """
    if len(bucket.pieces) != 1 or device.type != "cpu":
        return [None] * world
    piece = bucket.pieces[0]
    item = piece.rows
    target = item.target()
    parts: list[Optional[torch.Tensor]] = []
    for r in range(world):
        start = r * item.chunk + piece.first
        parts.append(target[start : start + piece.count].view(-1) if piece.held(r) == piece.count else None)
    return parts


def _unpack(bucket: _Bucket, rank: int, received: torch.Tensor) -> None:
    """Copy rank ``rank``'s part of ``bucket`` (``received``, rank 0's buffer) into the full tensors."""
    for piece in bucket.pieces:
        count = piece.held(rank)
        if count:
            item = piece.rows
            start = rank * item.chunk + piece.first
            size = count * item.row_bytes
            item.target()[start : start + count].copy_(
                received[piece.offset : piece.offset + size].view(count, item.row_bytes)
            )


def _comm_device(device_type: str) -> torch.device:
    """Where the mesh's collectives run: the CPU, or the current device of its accelerator type."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


# ----------------------------------------------------------------------------- the result


def _rebuild(
    obj: Any,
    rows: Iterator[Optional[_Rows]],
    keep: bool,
    lazy: Optional[Callable[[_Rows], Any]] = None,
) -> Any:
    """``obj`` with every tensor full and on the CPU (``keep``: rank 0), in torch's containers.

    Walks in :func:`_collect_dtensors`'s order; a ``DTensor`` not gathered in buckets is gathered here
    by itself, on every rank, as torch's path does. ``lazy``: what stands for a bucketed tensor
    instead of its full tensor (gathered later).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        item = next(rows)
        if item is not None:
            return item.full if lazy is None or not keep else lazy(item)
        full = obj.full_tensor()
        return full.to("cpu") if keep else None
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu") if keep else None
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, dict):
        return {key: _rebuild(value, rows, keep, lazy) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(value, rows, keep, lazy) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(value, rows, keep, lazy) for value in obj)
    raise ValueError(f"Unexpected value type {type(obj)}")
