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

Memory: rank 0 holds the full state on CPU, as torch's path does, plus at most one bucket (the
receive buffer of packed buckets); every other rank holds at most its share of one bucket (the
send buffer) and nothing else.

Every other value goes the way torch's path takes it, so the result is the same dict, bit for bit:
a ``DTensor`` on a 2-D mesh (HSDP), replicated, tensor-parallel, or on a mesh that is not all
ranks in rank order is gathered by itself (``full_tensor``); a plain tensor is moved to the CPU
(``.to("cpu")``, no copy when it is there already, as torch does); numbers, strings and ``None``
stay; dicts, lists and tuples are rebuilt. Ranks other than 0 get ``{}``. :func:`can_gather`
says whether a state holds only such values; the caller uses torch's own path when it does not.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
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
    if bucket_bytes is None:
        bucket_bytes = GATHER_BUCKET_BYTES or 0
    if bucket_bytes <= 0:
        raise ValueError(
            f"gather_full_state_dict(bucket_bytes={bucket_bytes}): give a positive number of bytes."
        )
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    found: list[Any] = []
    _collect_dtensors(state, found)
    rows = _bucketable(found, rank, world) if distributed else [None] * len(found)
    _gather_rows([r for r in rows if r is not None], bucket_bytes, rank, world)
    full = _rebuild(state, iter(rows), rank == 0)
    return full if rank == 0 else {}


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

    @property
    def rows(self) -> int:
        return self.shape[0]

    def target(self) -> torch.Tensor:
        if self.full_bytes is None:
            self.full = torch.empty(self.shape, dtype=self.dtype, device="cpu")
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


def _gather_rows(items: list[_Rows], bucket_bytes: int, rank: int, world: int) -> None:
    """Gather every item's rows to rank 0 (into ``item.full``), one ``dist.gather`` per bucket."""
    if not items:
        return
    buckets = _plan(items, max(1, bucket_bytes // world))
    # Every item's mesh is all ranks in rank order on one device type: any of their groups will do.
    mesh = items[0].mesh
    group = mesh.get_group()
    device = _comm_device(mesh.device_type)
    largest = max(bucket.used for bucket in buckets)
    send_buffer: Optional[torch.Tensor] = None  # made when a bucket is first packed
    receive_buffer: Optional[torch.Tensor] = None
    for bucket in buckets:
        send = _in_place_send(bucket, rank, device)
        if send is None:
            if send_buffer is None:
                send_buffer = torch.empty(largest, dtype=torch.uint8, device=device)
            send = _pack(bucket, rank, send_buffer)
        if rank != 0:
            dist.gather(send, None, dst=0, group=group)
            continue
        parts = _in_place_receive(bucket, world, device)
        if any(part is None for part in parts):
            if receive_buffer is None:
                receive_buffer = torch.empty(world, largest, dtype=torch.uint8, device=device)
            buffered = [r for r, part in enumerate(parts) if part is None]
            for r in buffered:
                parts[r] = receive_buffer[r, : bucket.used]
        else:
            buffered = []
        dist.gather(send, parts, dst=0, group=group)
        for r in buffered:
            _unpack(bucket, r, parts[r])


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


def _rebuild(obj: Any, rows: Iterator[Optional[_Rows]], keep: bool) -> Any:
    """``obj`` with every tensor full and on the CPU (``keep``: rank 0), in torch's containers.

    Walks in :func:`_collect_dtensors`'s order; a ``DTensor`` not gathered in buckets is gathered here
    by itself, on every rank, as torch's path does.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        item = next(rows)
        if item is not None:
            return item.full
        full = obj.full_tensor()
        return full.to("cpu") if keep else None
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu") if keep else None
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, dict):
        return {key: _rebuild(value, rows, keep) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(value, rows, keep) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(value, rows, keep) for value in obj)
    raise ValueError(f"Unexpected value type {type(obj)}")
