"""Gathering a sharded optimizer's state to global rank 0, one tensor at a time.

fairscale's ``OSS.consolidate_state_dict`` pickles each rank's whole shard into a byte tensor and
broadcasts it (about 4x the shard on the receiving rank, 2x on the sender), and torch's
``ZeroRedundancyOptimizer`` builds its byte tensors element by element (5.5x the full state on a
sending rank, and seconds per hundred megabytes); both then keep the gathered copies alive. Here
the ranks first exchange a small manifest (which parameter, which keys, shapes and dtypes), then
each owner sends its existing tensors straight to rank 0, which receives them into fresh ones:
rank 0 ends up holding one copy of the other ranks' shards (its own by reference) and the other
ranks hold nothing extra.

Which hook a plugin subclass overrides to put its own fields next to the optimizer state depends on
who builds that state: :func:`check_optimizer_state_override` refuses an override nobody calls.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException


def check_optimizer_state_override(cls: type, base: type) -> None:
    """Refuse a plugin class whose ``optimizer_state`` override would never run.

    The ``base`` plugin's ``named_optimizer_state`` names what ``optimizer_state`` returns (fields included).
    Plugins that build the checkpoint's optimizer state themselves (FSDP and model parallel through
    torch's ``get_optimizer_state_dict``, the pipeline per stage) override ``named_optimizer_state``
    and never call ``optimizer_state``: a subclass's override of it below theirs would be ignored.
    """
    mro = cls.__mro__
    named = next(klass for klass in mro if "named_optimizer_state" in vars(klass))
    state = next(klass for klass in mro if "optimizer_state" in vars(klass))
    if named is base or mro.index(state) >= mro.index(named):
        return
    parent = next(klass for klass in mro[1:] if issubclass(klass, base))
    raise MisconfigurationException(
        f"{cls.__name__} overrides `optimizer_state`, which {parent.__name__} never calls: it builds the "
        f"checkpoint's optimizer state in `named_optimizer_state`. Override `named_optimizer_state` instead "
        "(add your field to what super() returns, and read it back in `load_optimizer_state_dict`), or keep "
        "the plugin's own data in `plugin_state_dict()` / `load_plugin_state_dict()`."
    )


def _ownership(optimizer: Optimizer) -> Optional[tuple[Optimizer, Callable[[torch.Tensor], int]]]:
    """The rank-local optimizer and "which rank owns this parameter", for the sharded optimizers we know."""
    local = getattr(optimizer, "optim", None)
    owners = getattr(optimizer, "_param_to_rank", None)
    if not isinstance(local, Optimizer) or not isinstance(owners, dict):
        return None
    return local, owners.__getitem__


def gather_sharded_state(optimizer: Optimizer, device: torch.device) -> Optional[dict[str, Any]]:
    """The full index-keyed ``state_dict`` on global rank 0, ``{}`` elsewhere; a collective.

    ``None`` when ``optimizer`` is not one whose shards this function understands (fairscale
    ``OSS``, torch ``ZeroRedundancyOptimizer``), so the caller falls back to its own
    ``consolidate_state_dict``. The result has the layout ``torch.optim.Optimizer.state_dict``
    gives: parameters numbered in ``param_groups`` order.
    """
    found = _ownership(optimizer)
    if found is None or not dist.is_initialized():
        return None
    local, owner_of = found
    rank, world = dist.get_rank(), dist.get_world_size()
    params = [p for group in optimizer.param_groups for p in group["params"]]

    manifest = []
    for index, param in enumerate(params):
        if owner_of(param) != rank or param not in local.state:
            continue
        entry = {}
        for key, value in local.state[param].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = ("tensor", tuple(value.shape), value.dtype)
            else:
                entry[key] = ("value", value.detach().cpu() if isinstance(value, torch.Tensor) else value)
        manifest.append((index, entry))
    manifests: list[Any] = [None] * world
    dist.all_gather_object(manifests, manifest)

    state: dict[int, dict[str, Any]] = {}
    for src, entries in enumerate(manifests):
        for index, entry in entries:
            owned = local.state[params[index]] if src == rank else None
            gathered: dict[str, Any] = {}
            for key, (kind, *spec) in entry.items():
                if kind == "value":
                    gathered[key] = spec[0]
                elif src == 0 and rank == 0:
                    gathered[key] = owned[key]  # type: ignore[index]
                elif rank == 0:
                    shape, dtype = spec
                    buffer = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(buffer, src=src)
                    gathered[key] = buffer
                elif rank == src:
                    dist.send(owned[key].contiguous(), dst=0)  # type: ignore[index]
            if rank == 0:
                state[index] = gathered
    if rank != 0:
        return {}
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))}
        )
        start += count
    return {"state": state, "param_groups": groups}
