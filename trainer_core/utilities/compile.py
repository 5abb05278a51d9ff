"""``torch.compile`` and the run: a compiled module trains compiled and checkpoints under its plain names.

``torch.compile(module)`` returns a ``torch._dynamo.OptimizedModule`` that holds the original module
as its child ``_orig_mod``. Two consequences, each handled once, here:

* **A whole compiled LightningModule** is not a ``LightningModule`` (``isinstance`` fails), and the
  Trainer calls ``training_step``, not ``forward``. :func:`from_compiled` (Lightning's function, under
  its name) hands the Trainer the original module with its ``forward`` and step methods compiled by
  the same compiler context, so the run trains compiled and the module keeps its own parameter names.
* **A compiled submodule** (``self.net = torch.compile(net)``) puts ``_orig_mod`` into every name
  beneath it: ``net._orig_mod.0.weight`` instead of ``net.0.weight``. PyTorch Lightning writes those
  names into its checkpoints, so a run with compilation switched off (or on) cannot load them
  (Lightning #17415, #20233). Here a checkpoint holds the plain names: :func:`plain_name` and
  :func:`plain_state_dict` strip the segment when saving and when naming optimizer state, and
  :func:`module_state_dict` puts it back where this module holds a compiled submodule when loading.
  A file that still holds ``_orig_mod`` names (written by Lightning) loads too: names are made plain
  first, then mapped onto the module.

``torch.distributed.checkpoint.state_dict`` (FSDP's full and sharded states) already uses the
plain names, so every plugin writes the same keys whether or not anything was compiled. The
module's own ``state_dict()`` and ``named_parameters()`` keep torch's names: torch's checkpoint
helpers walk the module by them, so only what reaches a checkpoint is renamed.

``torch._dynamo`` takes about two seconds to import, so nothing here imports it: a module can only
be compiled once it has been imported, and :func:`compiled_module_class` looks for it in
``sys.modules``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule

#: The attribute under which ``OptimizedModule`` keeps the module it compiles: a segment of every name below it.
COMPILED_SEGMENT = "_orig_mod"
_STEP_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")
_ORIGINAL = "original_"


def compiled_module_class() -> Optional[type]:
    """``torch._dynamo.OptimizedModule`` if torch's compiler has been imported; else ``None`` (nothing is compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is what ``torch.compile(module)`` returns."""
    cls = compiled_module_class()
    return cls is not None and isinstance(obj, cls)


# ---------------------------------------------------------------------- the whole LightningModule
def from_compiled(model: nn.Module) -> LightningModule:
    """The LightningModule inside ``torch.compile(module)``, with its ``forward`` and steps compiled.

    Lightning's ``from_compiled``: the module is changed in place (its ``forward``, ``training_step``,
    ``validation_step``, ``test_step`` and ``predict_step`` run through the compiled wrapper's
    compiler context) and returned, so ``trainer.fit(torch.compile(model))`` trains compiled while
    ``state_dict`` keeps the module's own names. Unlike Lightning's, calling it again with the same
    compiled wrapper (a second ``fit``) does not compile the compiled methods a second time.
    :func:`to_uncompiled` undoes it.
    """
    from trainer_core.module import LightningModule

    if not is_compiled(model):
        raise ValueError(
            f"from_compiled: expected the result of torch.compile, got a {type(model).__name__}."
        )
    module = model._orig_mod
    if not isinstance(module, LightningModule):
        raise ValueError(
            f"from_compiled: torch.compile wrapped a {type(module).__name__}, not a trainer_core.LightningModule; "
            "compile the LightningModule, or compile the submodule inside it (`self.net = torch.compile(net)`)."
        )
    context = model.dynamo_ctx
    current = getattr(module, "_compiler_ctx", None)
    if current is not None:
        if current["dynamo_ctx"] is context:
            return module
        to_uncompiled(module)  # compiled by another call of torch.compile: that one's compilation gives way
    saved: dict[str, Any] = {"compiler": "dynamo", "dynamo_ctx": context}
    for name in _STEP_METHODS:
        # What the instance itself held (``None``: the class's method), for to_uncompiled to put back.
        original = module.__dict__.get(name)
        saved[_ORIGINAL + name] = original
        setattr(module, name, _CompiledStep(context, module, name, original))
    module._compiler_ctx = saved
    return module


class _CompiledStep:
    """One of the module's step methods, run through ``torch.compile``'s compiler context.

    ``context(method)`` alone cannot be pickled, and ``plugins="ddp_spawn"`` pickles the module into
    its processes (as does ``copy.deepcopy``): this one pickles as the context (which torch can pickle)
    and the method's name, and wraps the method again where it is loaded.
    """

    def __init__(self, context: Any, module: nn.Module, name: str, original: Optional[Any] = None) -> None:
        method = original if original is not None else getattr(type(module), name).__get__(module)
        self._args = (context, module, name, original)
        self._compiled = context(method)
        # `is_overridden` (which steps the module defines) looks through `__wrapped__`.
        self.__wrapped__ = method
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CompiledStep, self._args)


def to_uncompiled(model: nn.Module) -> LightningModule:
    """The LightningModule without the compilation :func:`from_compiled` gave it (Lightning's function).

    Takes the ``torch.compile`` wrapper or the module :func:`from_compiled` returned; changes the module in place.
    """
    from trainer_core.module import LightningModule

    module = model._orig_mod if is_compiled(model) else model
    if not isinstance(module, LightningModule):
        raise ValueError(
            f"to_uncompiled: expected a compiled trainer_core.LightningModule, got a {type(module).__name__}."
        )
    saved = getattr(module, "_compiler_ctx", None)
    if saved is None:
        if module is model:
            raise ValueError(
                f"to_uncompiled: {type(module).__name__} is not compiled (neither torch.compile's result nor "
                "from_compiled's)."
            )
        return module
    for name in _STEP_METHODS:
        original = saved.get(_ORIGINAL + name)
        if original is None:
            module.__dict__.pop(name, None)  # uncovers the class's own method
        else:
            setattr(module, name, original)
    module._compiler_ctx = None
    return module


def unwrap_compiled_module(model: Any) -> Any:
    """``model``, or the LightningModule of a compiled one via :func:`from_compiled`; anything else unchanged."""
    if is_compiled(model):
        from trainer_core.module import LightningModule

        if isinstance(model._orig_mod, LightningModule):
            return from_compiled(model)
    return model


def is_compiled_lightning_module(module: nn.Module) -> bool:
    """Whether ``module`` came from :func:`from_compiled` and is still compiled."""
    return getattr(module, "_compiler_ctx", None) is not None


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
