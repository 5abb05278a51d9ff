"""Optimizer state keyed by parameter name instead of torch's positional index.

``optimizer.state_dict()`` numbers parameters ``0..n-1`` in the order the optimizer's param groups
list them. That order depends on how ``configure_optimizers`` grouped them and on how a plugin
partitioned them, so an index-keyed state only loads back into an identically built optimizer. A
parameter's name (``net.0.weight``) survives a change of plugin, world size or group order, which is
what lets a checkpoint written under DDP on 2 ranks load under FSDP on 3 ranks or on one device.

Stored form::

    {"state": {"net.0.weight": {"momentum_buffer": ...}, ...},
     "param_groups": [{"lr": 0.1, ..., "params": ["net.0.weight", "net.0.bias"]}, ...]}

Every other top-level key (a field a plugin's ``optimizer_state`` adds, or one an optimizer's own
``state_dict`` holds) is kept as it is, in both directions: it is the plugin's or the optimizer's,
and it comes back to ``load_optimizer_state_dict`` on resume.

An empty state (``{}``, what non-zero ranks of a sharded optimizer return after consolidation on
rank 0) passes through both conversions unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.utilities import listing
from trainer_core.utilities.compiled_names import plain_named_parameters

ParamNames = Union[Mapping[torch.Tensor, str], Sequence[str]]

_STATE = "state"
_PARAM_GROUPS = "param_groups"
_PARAMS = "params"
# Newer torch stores names next to indices when an optimizer was built from named_parameters();
# the name-keyed form already uses names as the keys, so this copy is dropped.
_TORCH_PARAM_NAMES = "param_names"


def parameter_names(module: nn.Module) -> dict[torch.Tensor, str]:
    """``{parameter: name}`` for ``module``, the mapping both conversions take.

    A tied parameter appears once, under the first name ``named_parameters`` yields, which is also the
    name its tensor has in the model's state dict. Names are the plain ones a checkpoint holds: a
    compiled submodule's ``_orig_mod`` segment is left out, so compiled and uncompiled runs agree.
    """
    return {param: name for name, param in plain_named_parameters(module)}


def _ordered_names(optimizer: torch.optim.Optimizer, param_names: ParamNames) -> list[list[str]]:
    """The names of ``optimizer``'s parameters, one list per param group, in the optimizer's order."""
    groups = [group[_PARAMS] for group in optimizer.param_groups]
    if isinstance(param_names, Mapping):
        unnamed = sum(1 for params in groups for p in params if p not in param_names)
        if unnamed:
            raise ValueError(
                f"{unnamed} parameter(s) of {type(optimizer).__name__} have no name in the mapping; "
                "build the mapping with parameter_names(module) from the module the optimizer trains."
            )
        return [[param_names[p] for p in params] for params in groups]
    names = list(param_names)
    total = sum(len(params) for params in groups)
    if len(names) != total:
        raise ValueError(
            f"got {len(names)} parameter names for {type(optimizer).__name__}, which holds {total} parameters; "
            "pass one name per parameter, in the order of optimizer.param_groups."
        )
    grouped, start = [], 0
    for params in groups:
        grouped.append(names[start : start + len(params)])
        start += len(params)
    return grouped


def optimizer_state_to_names(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, param_names: ParamNames
) -> dict[str, Any]:
    """Turn ``optimizer.state_dict()`` (index-keyed) into the name-keyed form stored in checkpoints.

    ``param_names`` is ``{param: name}`` (see :func:`parameter_names`) or the list of names in the
    order of ``optimizer.param_groups``. Per-parameter state tensors are not copied.
    """
    if not state_dict:
        return {}
    if _STATE not in state_dict and _PARAM_GROUPS not in state_dict:
        # A rank of a sharded optimizer holds none of the full state (rank 0 gathered it); a plugin's
        # ``optimizer_state`` may still add its own fields there. Nothing to key by name.
        return dict(state_dict)
    grouped = _ordered_names(optimizer, param_names)
    saved_groups = state_dict[_PARAM_GROUPS]
    if [len(g[_PARAMS]) for g in saved_groups] != [len(names) for names in grouped]:
        raise ValueError(
            f"the state dict's param groups do not have the layout of {type(optimizer).__name__}'s; "
            "pass the state dict of this very optimizer."
        )
    index_to_name = {
        index: name
        for group, names in zip(saved_groups, grouped)
        for index, name in zip(group[_PARAMS], names)
    }
    param_groups = []
    for group in saved_groups:
        named_group = {k: v for k, v in group.items() if k not in (_PARAMS, _TORCH_PARAM_NAMES)}
        named_group[_PARAMS] = [index_to_name[index] for index in group[_PARAMS]]
        param_groups.append(named_group)
    state = {index_to_name[index]: value for index, value in state_dict[_STATE].items()}
    return {**extra_fields(state_dict), _STATE: state, _PARAM_GROUPS: param_groups}


def optimizer_state_from_names(
    named_state: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    param_names: ParamNames,
    path: Optional[str] = None,
) -> dict[str, Any]:
    """Turn a name-keyed state back into the index-keyed dict ``optimizer.load_state_dict`` expects.

    Parameters are matched by name, so the loading optimizer may list its groups, and the parameters
    within a group, in any order. Each of its groups takes the hyper-parameters of the stored group its
    parameters came from; a group mixing parameters from several stored groups is an error, because its
    learning rate would be ambiguous. Raises :class:`CheckpointError` (naming ``path`` when given)
    listing names the checkpoint lacks and names the optimizer lacks.
    """
    if not named_state:
        return {}
    where = f"the optimizer state in {path}" if path else "the optimizer state"
    grouped = _ordered_names(optimizer, param_names)
    saved_group_of = {
        name: i for i, group in enumerate(named_state[_PARAM_GROUPS]) for name in group[_PARAMS]
    }
    wanted = [name for names in grouped for name in names]
    missing = [name for name in wanted if name not in saved_group_of]
    unexpected = sorted(set(saved_group_of) - set(wanted))
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"parameters the checkpoint lacks ({len(missing)}): {listing(missing)}")
        if unexpected:
            problems.append(f"parameters the optimizer lacks ({len(unexpected)}): {listing(unexpected)}")
        raise CheckpointError(
            f"{where} does not match {type(optimizer).__name__}:\n  "
            + "\n  ".join(problems)
            + "\nconfigure_optimizers must optimize the same parameters as the run that saved the checkpoint."
        )

    param_groups, state, index = [], {}, 0
    for current_group, names in zip(optimizer.param_groups, grouped):
        sources = sorted({saved_group_of[name] for name in names})
        if len(sources) > 1:
            raise CheckpointError(
                f"{where}: one param group of {type(optimizer).__name__} holds parameters from {len(sources)} "
                f"different saved groups ({listing(names)}), so its hyper-parameters are ambiguous; "
                "group the parameters as the run that saved the checkpoint did."
            )
        # An empty group has no stored counterpart and keeps its own hyper-parameters.
        source = named_state[_PARAM_GROUPS][sources[0]] if sources else current_group
        group = {k: v for k, v in source.items() if k != _PARAMS}
        group[_PARAMS] = list(range(index, index + len(names)))
        for name in names:
            if name in named_state[_STATE]:
                state[index] = named_state[_STATE][name]
            index += 1
        param_groups.append(group)
    return {**extra_fields(named_state), _STATE: state, _PARAM_GROUPS: param_groups}


def extra_fields(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level entries of an optimizer state besides ``state`` and ``param_groups``, unchanged."""
    return {key: value for key, value in state_dict.items() if key not in (_STATE, _PARAM_GROUPS)}


def refuse_fields_of_sharded_states(states: Iterable[Mapping[str, Any]], writer: str) -> None:
    """Raise when an optimizer state written as shards holds fields a sharded checkpoint cannot give back.

    A sharded (DCP) folder loads into a template of this run's own shards, which has ``state`` and
    ``param_groups`` only: any other field would be written and then silently lost on resume.
    """
    fields = sorted({str(key) for state in states if state for key in extra_fields(state)})
    if fields:
        raise MisconfigurationException(
            f"{writer} writes sharded checkpoints, which load back only 'state' and 'param_groups' of an "
            f"optimizer state; {', '.join(map(repr, fields))} would be lost on resume. Keep the plugin's own "
            "data in `plugin_state_dict()` / `load_plugin_state_dict()`, or write full checkpoints "
            "(FSDPPlugin(state_dict_type='full'), ModelParallelPlugin(save_distributed_checkpoint=False))."
        )


def merge_named_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Name-keyed states of several parts of one model as one; param groups with equal settings merge.

    The parts of a split model (pipeline stages, one optimizer per part) each hold some of the
    model's parameters under the same hyper-parameters; merged, they read like one optimizer's state.
    Other top-level fields are kept; parts that hold one field with different values cannot be one
    state, and raise :class:`CheckpointError` naming the field.
    """
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    extras: dict[str, Any] = {}
    for part in states:
        if not part:
            continue
        for key, value in extra_fields(part).items():
            if key in extras and not _equal(extras[key], value):
                raise CheckpointError(
                    f"the optimizer states of the model's parts hold different values under {key!r}, which "
                    "one state cannot keep; a plugin that adds fields to optimizer_state must add one value "
                    "per optimizer, or key the field by part."
                )
            extras[key] = value
        state.update(part.get("state", {}))
        for group in part.get("param_groups", []):
            settings = {k: v for k, v in group.items() if k != "params"}
            for existing in groups:
                if {k: v for k, v in existing.items() if k != "params"} == settings:
                    existing["params"] = [*existing["params"], *group["params"]]
                    break
            else:
                groups.append({**settings, "params": list(group["params"])})
    return {**extras, "state": state, "param_groups": groups}


def _equal(a: Any, b: Any) -> bool:
    """Whether two values of an optimizer state's field are the same (tensors compared element-wise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def select_named_state(named_state: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The part of a name-keyed state that belongs to the parameters ``names`` (groups left empty dropped).

    Other top-level fields go with every part: they belong to the optimizer, not to a parameter.
    """
    wanted = set(names)
    groups = [
        {**g, "params": [n for n in g["params"] if n in wanted]} for g in named_state.get("param_groups", [])
    ]
    return {
        **extra_fields(named_state),
        "state": {n: v for n, v in named_state.get("state", {}).items() if n in wanted},
        "param_groups": [g for g in groups if g["params"]],
    }


def named_parameters_of(named_state: Mapping[str, Any]) -> set[str]:
    """Every parameter name a name-keyed optimizer state mentions (in its state or its groups)."""
    return set(named_state.get(_STATE, {})) | {
        n for group in named_state.get(_PARAM_GROUPS, []) for n in group.get(_PARAMS, [])
    }


def check_named_state_covers(
    named_state: Mapping[str, Any], module: nn.Module, owner: str, path: str
) -> None:
    """Raise unless a name-keyed state names exactly ``module``'s trainable parameters.

    For plugins that load a whole model's state into parts of it (FSDP shards, pipeline stages),
    where the per-optimizer check of :func:`optimizer_state_from_names` cannot see the whole.
    """
    wanted = {name for name, p in plain_named_parameters(module) if p.requires_grad}
    saved = named_parameters_of(named_state)
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"the optimizer state in {path} does not match {owner}: parameters the checkpoint lacks "
            f"{missing[:20]}, parameters the model lacks {unexpected[:20]}. configure_optimizers must optimize "
            "the same parameters as the run that saved the checkpoint."
        )
