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

from typing import Any, Optional

from torch import nn

from trainer_core.module import LightningModule

# The checkpoint names live in a leaf (the checkpoint code uses them without reaching the module); they
# are imported from here too.
from trainer_core.utilities.compiled_names import (
    COMPILED_SEGMENT,
    compiled_module_class,
    is_compiled,
    module_state_dict,
    plain_name,
    plain_named_parameters,
    plain_optimizer_state,
    plain_state_dict,
)

_STEP_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")
_ORIGINAL = "original_"


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
        if isinstance(model._orig_mod, LightningModule):
            return from_compiled(model)
    return model


def is_compiled_lightning_module(module: nn.Module) -> bool:
    """Whether ``module`` came from :func:`from_compiled` and is still compiled."""
    return getattr(module, "_compiler_ctx", None) is not None


__all__ = [
    "COMPILED_SEGMENT",
    "compiled_module_class",
    "from_compiled",
    "is_compiled",
    "is_compiled_lightning_module",
    "module_state_dict",
    "plain_name",
    "plain_named_parameters",
    "plain_optimizer_state",
    "plain_state_dict",
    "to_uncompiled",
    "unwrap_compiled_module",
]
