"""Gradient clipping for every plugin: the norm of all gradients as one process holding them all would compute it.

One rule for every layout. Whole gradients (one device, DDP, ZeRO, pipeline stages) are measured
with torch's own ``get_total_norm``, so one process clips exactly as ``torch.nn.utils.clip_grad_norm_``;
``DTensor`` shards (FSDP, tensor parallelism) add their local sums, reduced over the mesh
dimensions they are split along; ranks that hold other parameters altogether (the stages of a
pipeline, the owners of OSS's partitions) join through ``extra_group``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


def total_grad_norm(grads: list[Tensor], norm_type: float = 2.0, extra_group: Optional[Any] = None) -> Tensor:
    """The norm of all ``grads`` together, as one process holding every full gradient would compute it.

    A ``DTensor`` gradient contributes its local shard, summed over the mesh dimensions it is sharded
    along (tensor parallel, FSDP) and counted once along those it is replicated on; gradients on
    different meshes (a layer outside the tensor-parallel plan) mix freely. ``extra_group`` adds the
    ranks that hold other parameters altogether (the stages of a pipeline). Every rank of a group
    must pass its gradients in the same order, which holds for ranks that hold the same parameters.
    """
    norm_type = float(norm_type)
    infinite = norm_type == float("inf")
    if all(type(grad) is Tensor for grad in grads):
        whole, pending = grads, {}
    else:
        whole, pending = _split_by_placement(grads, norm_type, infinite)
    if not pending and extra_group is None:
        # torch's own measure: one process gets clip_grad_norm_'s norm (and dtype) bit for bit.
        return _whole_norm(whole, norm_type, grads)
    import torch.distributed as dist

    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    norm = _whole_norm(whole, norm_type, grads).float()
    total = norm if infinite else norm.pow(norm_type)
    for mesh, dims, value in pending.values():
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if infinite else total + value
    if extra_group is not None and dist.get_world_size(extra_group) > 1:
        dist.all_reduce(total, op=op, group=extra_group)
    return total if infinite else total.pow(1.0 / norm_type)


def _whole_norm(whole: list[Tensor], norm_type: float, grads: list[Tensor]) -> Tensor:
    """The norm of whole (unsharded) tensors as torch measures it; a float32 zero on no tensors."""
    if whole:
        return torch.nn.utils.get_total_norm(whole, norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    return torch.zeros((), dtype=torch.float32, device=device)


def _split_by_placement(
    grads: list[Tensor], norm_type: float, infinite: bool
) -> tuple[list[Tensor], dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[int, ...], Tensor]]]:
    """Whole gradients, and per (mesh, sharded dimensions) the running sum (or max) of the shards' powers."""
    from torch.distributed.tensor import DTensor

    whole: list[Tensor] = []
    # One running value per (mesh, sharded dimensions): reduced together, once each.
    pending: dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[int, ...], Tensor]] = {}
    for grad in grads:
        if not isinstance(grad, DTensor):
            whole.append(grad)
            continue
        if any(p.is_partial() for p in grad.placements):
            whole.append(grad.full_tensor())
            continue
        # Any placement but Replicate splits the tensor over that dimension (Shard, and the
        # _StridedShard of FSDP over tensor parallelism, which is not is_shard()).
        dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
        if not dims:
            whole.append(grad.to_local())
            continue
        mesh = grad.device_mesh
        local = grad.to_local().detach().float()
        value = local.abs().max() if infinite and local.numel() else local.abs().pow(norm_type).sum()
        key = (id(mesh), dims)
        if key in pending:
            held = pending[key][2]
            value = torch.maximum(held, value) if infinite else held + value
        pending[key] = (mesh, dims, value)
    return whole, pending


def clip_grads_by_total_norm(
    grads: list[Tensor], max_norm: float, norm_type: float = 2.0, extra_group: Optional[Any] = None
) -> Tensor:
    """Scale ``grads`` in place so that their total norm (:func:`total_grad_norm`) is at most ``max_norm``."""
    total = total_grad_norm(grads, norm_type, extra_group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_locals(local_shards(grads), coef)
    return total


def clip_grads_by_value(grads: list[Tensor], clip_val: float) -> None:
    """Clamp every element of ``grads`` (each rank its own shards) to ``[-clip_val, clip_val]``."""
    shards = local_shards(grads)
    if shards:
        torch._foreach_clamp_min_(shards, -clip_val)
        torch._foreach_clamp_max_(shards, clip_val)


def local_shards(grads: list[Tensor]) -> list[Tensor]:
    """Each gradient as this rank holds it: a ``DTensor``'s local shard, any other tensor itself."""
    if not any(type(grad) is not Tensor for grad in grads):
        return [grad.detach() for grad in grads]
    from torch.distributed.tensor import DTensor

    return [(grad.to_local() if isinstance(grad, DTensor) else grad).detach() for grad in grads]


def _scale_locals(shards: list[Tensor], coef: Tensor) -> None:
    """Multiply the shards by ``coef`` in place, grouped by device and dtype (as torch's clipping does)."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for shard in shards:
        groups.setdefault((shard.device, shard.dtype), []).append(shard)
    for (device, dtype), tensors in groups.items():
        torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))
