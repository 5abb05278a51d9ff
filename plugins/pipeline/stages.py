"""The parts a pipeline rank holds: stage modules, meta tensors for the layers of other ranks, shards.

The user's module keeps its whole name space on every rank; the tensors of layers a rank does not
hold move to the meta device, and a part is a shallow copy of the module holding one stage's
tensors. Helpers for tensor-parallel shards (``DTensor``) inside the stages close the file.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from trainer_core.module import LightningModule


def _stage_module(root: nn.Module, held: set[str]) -> nn.Module:
    """``root`` with the subtrees of ``held`` shared and every other layer an ``nn.Identity``.

    Containers on the way are shallow copies with their own child dicts, so several stages of one
    rank can be built from the same module without copying any tensor.
    """

    def build(name: str, mod: nn.Module) -> nn.Module:
        if name in held:
            return mod
        prefix = f"{name}." if name else ""
        if not any(h.startswith(prefix) for h in held):
            return nn.Identity()
        new = copy.copy(mod)
        new._modules = {}
        new._parameters = {}
        new._buffers = {}
        for child_name, child in mod._modules.items():
            new._modules[child_name] = None if child is None else build(prefix + child_name, child)
        return new

    return build("", root)


def _materialise(module: nn.Module, held: Sequence[str], device: torch.device) -> None:
    """Give the layers this rank holds real memory when the module was built on the meta device.

    A module built under ``torch.device("meta")`` takes no memory on any rank; each rank allocates
    only its own layers here and initialises them with their ``reset_parameters`` (a checkpoint
    loaded afterwards, ``ckpt_path=...``, overwrites them).
    """
    for name in held:
        sub = module.get_submodule(name)
        if not any(t.is_meta for t in [*sub.parameters(), *sub.buffers()]):
            continue
        sub.to_empty(device=device)
        for inner in sub.modules():
            reset = getattr(inner, "reset_parameters", None)
            if callable(reset):
                reset()


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return module.get_submodule(prefix), leaf


def _tensor_part(root: nn.Module, held: set[str]) -> nn.Module:
    """``root`` with only the tensors named in ``held``, under their names, and no other.

    Modules on the way are shallow copies with their own dicts; the tensors are the root's.
    """

    def build(prefix: str, mod: nn.Module) -> Optional[nn.Module]:
        new = copy.copy(mod)
        new._parameters = {k: v for k, v in mod._parameters.items() if prefix + k in held}
        new._buffers = {k: v for k, v in mod._buffers.items() if prefix + k in held}
        new._modules = {}
        for child_name, child in mod._modules.items():
            if child is not None:
                built = build(f"{prefix}{child_name}.", child)
                if built is not None:
                    new._modules[child_name] = built
        empty = not (new._parameters or new._buffers or new._modules)
        return None if empty and prefix else new

    part = build("", root)
    assert part is not None
    return part


def _tensors_to_meta(module: nn.Module, names: Sequence[str]) -> None:
    """The named tensors take no memory on this rank; their names, shapes and dtypes stay."""
    for name in names:
        try:
            owner, leaf = _owner(module, name)
        except AttributeError:
            continue  # non-tensor state (``_extra_state``)
        if leaf in owner._parameters and owner._parameters[leaf] is not None:
            param = owner._parameters[leaf]
            if not param.is_meta:
                owner._parameters[leaf] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        elif leaf in owner._buffers and owner._buffers[leaf] is not None:
            owner._buffers[leaf] = owner._buffers[leaf].to("meta")


def _materialise_tensors(module: nn.Module, names: Sequence[str], device: torch.device) -> None:
    """Give the named tensors memory when the module was built on the meta device (see ``_materialise``)."""
    owners: dict[int, nn.Module] = {}
    for name in names:
        try:
            owner, leaf = _owner(module, name)
        except AttributeError:
            continue
        if (
            leaf in owner._parameters
            and owner._parameters[leaf] is not None
            and owner._parameters[leaf].is_meta
        ):
            param = owner._parameters[leaf]
            owner._parameters[leaf] = nn.Parameter(
                torch.empty_like(param, device=device), requires_grad=param.requires_grad
            )
            owners[id(owner)] = owner
        elif leaf in owner._buffers and owner._buffers[leaf] is not None and owner._buffers[leaf].is_meta:
            owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device=device)
            owners[id(owner)] = owner
    for owner in owners.values():
        reset = getattr(owner, "reset_parameters", None)
        if callable(reset):
            reset()


def _without_side_effects_of_inference(stage: PipelineStage) -> PipelineStage:
    """Undo what the stage's shape inference changes in the module: buffers and random state.

    Before the first micro-batch a ``PipelineStage`` runs its module once more to learn the shapes
    it exchanges; batch norm would count that batch twice (and dropout draw twice) compared with
    one process. The buffers and the random generators are put back afterwards.
    """
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return stage

    def inference(*args: Any, **kwargs: Any) -> Any:
        saved = [(buffer, buffer.detach().clone()) for buffer in stage.submod.buffers() if not buffer.is_meta]
        with torch.random.fork_rng(devices=[stage.device] if stage.device.type == "cuda" else []):
            try:
                return infer(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, value in saved:
                        buffer.copy_(value)

    stage._forward_metadata_inference = inference  # type: ignore[method-assign]
    return stage


def _check_pipelined_module(module: LightningModule) -> None:
    if not callable(getattr(module, "loss_fn", None)):
        raise MisconfigurationException(
            f"PipelinePlugin: {type(module).__name__} must define `loss_fn(output, target)`. The pipeline splits "
            "`forward(input)` across stages and turns the last stage's output into the loss with `loss_fn`; "
            "`training_step` is not called."
        )


def _merge_parts(parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Name-keyed states of several ``(stage id, state)`` parts as one, in stage order."""
    from trainer_core.checkpoint import merge_named_states

    merged = merge_named_states(part for _, part in sorted(parts, key=lambda entry: entry[0]))
    return merged if merged["param_groups"] else {}


class _NoData:
    """A loader for a rank that holds neither the first nor the last stage: as many batches, none read."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.batch_size = getattr(loader, "batch_size", None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[None]:
        return iter([None] * len(self.loader))


# ---------------------------------------------------------------------- tensor-parallel shards
def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: Tensor) -> Tensor:
    """A ``DTensor`` gathered whole (a collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _full_state(obj: Any) -> Any:
    """An optimizer state with every ``DTensor`` gathered whole, in the state's own (deterministic) order."""
    if isinstance(obj, Tensor):
        return _full(obj)
    if isinstance(obj, dict):
        return {k: _full_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full_state(v) for v in obj]
    return obj


def _like(value: Any, target: Any) -> Any:
    """A whole tensor as ``target`` holds it: this rank's shard when ``target`` is a ``DTensor``.

    Every rank holds the same whole tensor (read from the same checkpoint), so each takes its own
    shard without communicating.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor) or isinstance(value, DTensor) or not isinstance(value, Tensor):
        return value
    return distribute_tensor(
        value.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
    )
