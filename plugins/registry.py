"""Names a user may pass as ``Trainer(plugins="...")``, mapped to plugin classes.

Distributed plugins register themselves by name here as they are added, so the Trainer never
imports a concrete plugin and an unknown name gets one error listing the known ones.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.base import TrainingTypePlugin

_REGISTRY: dict[str, tuple[Callable[..., TrainingTypePlugin], dict[str, Any]]] = {}


def register_plugin(
    name: str, factory: Callable[..., TrainingTypePlugin], *, override: bool = False, **defaults: Any
) -> None:
    """Make ``name`` build ``factory(**defaults, **kwargs)`` (``factory``: a plugin class or a function).

    A name that is taken (a built-in such as ``"ddp"``, or one registered before) is replaced only with
    ``override=True``, as in Lightning's ``StrategyRegistry``: the registry is global to the process,
    and a name that silently changed meaning would change every run that uses it.
    """
    if not isinstance(name, str) or not name:
        raise MisconfigurationException(
            f"register_plugin({name!r}, ...): the name must be a non-empty string (what users pass as plugins=)."
        )
    _check_factory(name, factory)
    if name in _REGISTRY and not override:
        raise MisconfigurationException(
            f"register_plugin({name!r}, {_describe(factory)}): {name!r} already builds {_built_by(name)}; pass "
            "override=True to replace it, or choose another name."
        )
    _REGISTRY[name] = (factory, defaults)


def available_plugins() -> list[str]:
    return sorted(_REGISTRY)


def plugin_from_name(name: str, **kwargs: Any) -> TrainingTypePlugin:
    """The plugin ``name`` stands for, built with its defaults overridden by ``kwargs`` (checked by the plugin)."""
    if name not in _REGISTRY:
        raise MisconfigurationException(
            f"Trainer(plugins={name!r}): no plugin has that name. Known names: {', '.join(available_plugins())}."
        )
    factory, defaults = _REGISTRY[name]
    plugin = factory(**{**defaults, **kwargs})
    if not isinstance(plugin, TrainingTypePlugin):
        raise MisconfigurationException(
            f"Trainer(plugins={name!r}): {_describe(factory)}, registered under {name!r}, returned "
            f"{type(plugin).__name__}, not a TrainingTypePlugin; make it return the plugin it builds."
        )
    return plugin


def _check_factory(name: str, factory: Any) -> None:
    if isinstance(factory, type) and not issubclass(factory, TrainingTypePlugin):
        raise MisconfigurationException(
            f"register_plugin({name!r}, {factory.__name__}): {factory.__name__} is not a TrainingTypePlugin; "
            "register a subclass of TrainingTypePlugin or a function that returns one."
        )
    if isinstance(factory, TrainingTypePlugin):
        kind = type(factory).__name__
        raise MisconfigurationException(
            f"register_plugin({name!r}, {kind}(...)): pass the class, {kind}, not an instance: the registry builds "
            "a new plugin each time the name is used (or pass a function that returns one)."
        )
    if not callable(factory):
        raise MisconfigurationException(
            f"register_plugin({name!r}, {factory!r}): pass a TrainingTypePlugin subclass or a function returning one."
        )


def _describe(factory: Any) -> str:
    return getattr(factory, "__name__", None) or type(factory).__name__


def _built_by(name: str) -> str:
    """``DDPPlugin(start_method='popen')``: what ``name`` builds now, with its registered defaults."""
    factory, defaults = _REGISTRY[name]
    return f"{_describe(factory)}({', '.join(f'{key}={value!r}' for key, value in defaults.items())})"


class _Lazy:
    """A plugin class or function imported when its name is first built.

    fairscale is an optional extra, and FSDP, the pipeline and torch.distributed.checkpoint cost most of
    a second to import, which every rank and CLI call would pay.
    """

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.__name__ = name

    def __call__(self, **kwargs: Any) -> TrainingTypePlugin:
        return getattr(importlib.import_module(self.module), self.__name__)(**kwargs)


def _register_builtins() -> None:
    from trainer_core.plugins.single_device import SingleDevicePlugin

    register_plugin("single_device", SingleDevicePlugin)
    from trainer_core.plugins.ddp import DDPPlugin

    register_plugin("ddp", DDPPlugin, start_method="popen")
    register_plugin("ddp_spawn", DDPPlugin, start_method="spawn")
    # torchft is an optional extra (trainer-core[ft]), imported when the plugin is set up.
    register_plugin("ddp_ft", _Lazy("trainer_core.plugins.ddp_ft", "FaultTolerantDDPPlugin"))
    register_plugin("ddp_sharded", _Lazy("trainer_core.plugins.sharded", "DDPShardedPlugin"))
    register_plugin("zero", _Lazy("trainer_core.plugins.zero", "ZeroPlugin"))
    register_plugin("fsdp", _Lazy("trainer_core.plugins.fsdp", "FSDPPlugin"))
    register_plugin("pipeline", _Lazy("trainer_core.plugins.pipeline", "PipelinePlugin"))
    # pipeline_parallel_size > 1 picks PipelineModelParallelPlugin: one name for every layout.
    register_plugin("model_parallel", _Lazy("trainer_core.plugins.model_parallel", "model_parallel_plugin"))


_register_builtins()
