"""The names a checkpoint uses for the weights of a module that holds compiled parts.

``torch.compile(module)`` returns a ``torch._dynamo.OptimizedModule`` that keeps the original module
as its child ``_orig_mod``, so every name beneath a compiled submodule holds that segment. A
checkpoint holds the plain names; these functions strip the segment when saving and put it back when
loading (``trainer_core/utilities/compile.py`` explains why). A leaf: the checkpoint code, the loops
and the plugins use it without reaching the ``LightningModule``.

``torch._dynamo`` takes about two seconds to import, so nothing here imports it: a module can only
be compiled once it has been imported, and :func:`compiled_module_class` looks for it in
``sys.modules``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from torch import nn

#: The attribute under which ``OptimizedModule`` keeps the module it compiles: a segment of every name below it.
COMPILED_SEGMENT = "_orig_mod"


def compiled_module_class() -> Optional[type]:
    """``torch._dynamo.OptimizedModule`` if torch's compiler has been imported; else ``None`` (nothing is compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is what ``torch.compile(module)`` returns."""
    cls = compiled_module_class()
    return cls is not None and isinstance(obj, cls)


# ---------------------------------------------------------------------- names in checkpoints
def plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` segments compiled submodules add: ``net._orig_mod.0.weight`` -> ``net.0.weight``."""
    if COMPILED_SEGMENT not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_SEGMENT)


def plain_state_dict(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` keyed by plain names (the values are not copied); ``state`` itself when nothing was compiled.

    torch's per-module ``_metadata`` (the versions ``load_state_dict`` reads) is renamed with the keys.
    """
    if not any(COMPILED_SEGMENT in key for key in state):
        return state
    renamed: OrderedDict[str, Any] = OrderedDict((plain_name(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        # The wrapper's entry comes before the compiled module's, which (the one that holds the weights) wins.
        renamed._metadata = OrderedDict((plain_name(k), v) for k, v in metadata.items())  # type: ignore[attr-defined]
    return renamed


def plain_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` under the names a checkpoint uses."""
    for name, param in module.named_parameters():
        yield plain_name(name), param


def _compiled_paths(module: nn.Module) -> frozenset[str]:
    """The plain names of ``module``'s compiled submodules (``"net"`` for ``self.net = torch.compile(...)``)."""
    cls = compiled_module_class()
    if cls is None:
        return frozenset()
    return frozenset(plain_name(name) for name, sub in module.named_modules() if isinstance(sub, cls))


def _module_name(name: str, compiled: frozenset[str]) -> str:
    """A plain ``name`` as ``module`` spells it: ``_orig_mod`` after each compiled submodule on the way."""
    parts: list[str] = []
    prefix = ""
    for part in name.split("."):
        parts.append(part)
        prefix = f"{prefix}.{part}" if prefix else part
        if prefix in compiled:
            parts.append(COMPILED_SEGMENT)
    return ".".join(parts)


def module_state_dict(module: nn.Module, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` (plain names, or ``_orig_mod`` names from Lightning) keyed as ``module.load_state_dict`` expects.

    ``state`` itself when ``module`` holds no compiled submodule and ``state`` no compiled names.
    """
    compiled = _compiled_paths(module)
    state = plain_state_dict(state)
    if not compiled:
        return state
    renamed: OrderedDict[str, Any] = OrderedDict((_module_name(k, compiled), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        renamed._metadata = OrderedDict((_module_name(k, compiled), v) for k, v in metadata.items())  # type: ignore[attr-defined]
    return renamed


def plain_optimizer_state(named_state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A name-keyed optimizer state (``checkpoint/optimizer.py``) under plain names; itself when already plain."""
    state = named_state.get("state", {})
    groups = named_state.get("param_groups", [])
    if not any(COMPILED_SEGMENT in name for name in state) and not any(
        COMPILED_SEGMENT in name for group in groups for name in group.get("params", [])
    ):
        return named_state
    return {
        **named_state,
        "state": {plain_name(name): value for name, value in state.items()},
        "param_groups": [{**g, "params": [plain_name(n) for n in g.get("params", [])]} for g in groups],
    }
