"""Names a user may pass as ``Trainer(plugins="...")``, mapped to plugin classes.

Distributed plugins register themselves by name here as they are added, so the Trainer never
imports a concrete plugin and an unknown name gets one error listing the known ones.
"""

from __future__ import annotations

from typing import Any, Callable

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.base import TrainingTypePlugin

_REGISTRY: dict[str, tuple[Callable[..., TrainingTypePlugin], dict[str, Any]]] = {}


def register_plugin(name: str, factory: Callable[..., TrainingTypePlugin], **defaults: Any) -> None:
    """Make ``name`` build ``factory(**defaults, **kwargs)``."""
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
    return factory(**{**defaults, **kwargs})


def _register_builtins() -> None:
    from trainer_core.plugins.single_device import SingleDevicePlugin

    register_plugin("single_device", SingleDevicePlugin)
    from trainer_core.plugins.ddp import DDPPlugin

    register_plugin("ddp", DDPPlugin, start_method="popen")
    register_plugin("ddp_spawn", DDPPlugin, start_method="spawn")
    register_plugin("ddp_sharded", _sharded)
    register_plugin("zero", _zero)
    register_plugin("fsdp", _fsdp)
    register_plugin("pipeline", _pipeline)
    register_plugin("model_parallel", _model_parallel)


def _sharded(**kwargs: Any) -> TrainingTypePlugin:
    from trainer_core.plugins.sharded import DDPShardedPlugin

    return DDPShardedPlugin(**kwargs)


def _zero(**kwargs: Any) -> TrainingTypePlugin:
    from trainer_core.plugins.zero import ZeroPlugin

    return ZeroPlugin(**kwargs)


def _fsdp(**kwargs: Any) -> TrainingTypePlugin:
    from trainer_core.plugins.fsdp import FSDPPlugin

    return FSDPPlugin(**kwargs)


def _pipeline(**kwargs: Any) -> TrainingTypePlugin:
    from trainer_core.plugins.pipeline import PipelinePlugin

    return PipelinePlugin(**kwargs)


def _model_parallel(**kwargs: Any) -> TrainingTypePlugin:
    # pipeline_parallel_size > 1 picks PipelineModelParallelPlugin: one name for every layout.
    from trainer_core.plugins.model_parallel import model_parallel_plugin

    return model_parallel_plugin(**kwargs)


_register_builtins()
