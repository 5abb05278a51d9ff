"""Profilers for ``Trainer(profiler=...)``, as in ``lightning.pytorch.profilers``.

``Trainer(profiler="simple")`` prints a per-hook time table at the end of each run,
``"advanced"`` a ``cProfile`` report per hook, ``"pytorch"`` an operator table and Chrome traces;
an instance (``SimpleProfiler(dirpath=..., filename="perf")``) writes the report to a file instead.
``AdvancedProfiler`` and ``PyTorchProfiler`` are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from trainer_core.errors import MisconfigurationException
from trainer_core.profilers.base import PassThroughProfiler, Profiler
from trainer_core.profilers.simple import SimpleProfiler

if TYPE_CHECKING:
    from trainer_core.profilers.advanced import AdvancedProfiler
    from trainer_core.profilers.pytorch import PyTorchProfiler

__all__ = [
    "AdvancedProfiler",
    "PassThroughProfiler",
    "Profiler",
    "PyTorchProfiler",
    "SimpleProfiler",
]

_LAZY = {
    "AdvancedProfiler": "trainer_core.profilers.advanced",
    "PyTorchProfiler": "trainer_core.profilers.pytorch",
}
#: The names ``Trainer(profiler=...)`` accepts, and the class each makes.
PROFILERS = {"simple": "SimpleProfiler", "advanced": "AdvancedProfiler", "pytorch": "PyTorchProfiler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_profiler(profiler: Optional[Union[Profiler, str]]) -> Profiler:
    """The Trainer's profiler for ``Trainer(profiler=...)``: an instance, a name, or ``None`` (profile nothing)."""
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, Profiler):
        if "_stage" not in vars(profiler):
            name = type(profiler).__name__
            raise MisconfigurationException(
                f"Trainer(profiler={name}(...)): {name}.__init__ must call super().__init__(...) (Profiler sets up "
                "its report file there); add super().__init__(dirpath=..., filename=...) to it."
            )
        return profiler
    choices = "'simple', 'advanced', 'pytorch', or a Profiler instance from trainer_core.profilers"
    if isinstance(profiler, str):
        name = PROFILERS.get(profiler.lower())
        if name is None:
            raise MisconfigurationException(
                f"Trainer(profiler={profiler!r}) is not a profiler name: use {choices}."
            )
        return SimpleProfiler() if name == "SimpleProfiler" else __getattr__(name)()
    if isinstance(profiler, type) and issubclass(profiler, Profiler):
        raise MisconfigurationException(
            f"Trainer(profiler={profiler.__name__}): pass {profiler.__name__}() (an instance, not the class)."
        )
    raise MisconfigurationException(
        f"Trainer(profiler=...) got a {type(profiler).__name__}: use {choices} (or None for no profiling)."
    )


def is_active(profiler: Profiler) -> bool:
    """Whether ``profiler`` records anything: every profiler but the plain ``PassThroughProfiler``."""
    return type(profiler) is not PassThroughProfiler
