"""Turning the Trainer's arguments into a plugin, callbacks and loggers, once, at construction.

The checks of the run settings live in ``trainer_core.config`` (``TrainerConfig``); the questions the
core asks about callbacks during a run in ``trainer_core.callback_queries``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

# tests/callbacks/test_lambda.py imports ``callback_overrides`` from here, where it used to live.
from trainer_core.callback_queries import callback_overrides  # noqa: F401
from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.callbacks.model_summary import ModelSummary, RichModelSummary, rich_available
from trainer_core.callbacks.progress import ProgressBar, TQDMProgressBar
from trainer_core.callbacks.timer import Timer
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger, TensorBoardLogger, tensorboard_available
from trainer_core.plugins import TrainingTypePlugin, plugin_from_name
from trainer_core.plugins.environments import ClusterEnvironment
from trainer_core.plugins.io import CheckpointIO
from trainer_core.utilities import as_list, rank_zero_only

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
_logger = logging.getLogger("trainer_core")


def configure_torch_backends(deterministic: Any, benchmark: Optional[bool]) -> None:
    """Apply ``deterministic`` and the resolved ``benchmark`` (``TrainerConfig``) to torch's global switches.

    ``CUBLAS_WORKSPACE_CONFIG`` makes cuBLAS deterministic; it is only set when the user has not set it.
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark


def _resolve_device(accelerator: str, devices: Any) -> torch.device:
    if accelerator not in _ACCELERATORS:
        raise MisconfigurationException(
            f"Trainer(accelerator={accelerator!r}): use one of {', '.join(_ACCELERATORS)}."
        )
    want_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise MisconfigurationException(
            f"Trainer(accelerator={accelerator!r}) but no CUDA device is available; use 'cpu'."
        )
    if not want_gpu:
        return torch.device("cpu")
    index = 0
    if isinstance(devices, (list, tuple)) and devices:
        index = int(devices[0])
    return torch.device("cuda", index)


def _device_count(devices: Any) -> int:
    if devices in ("auto", None):
        return 1
    if isinstance(devices, str):
        devices = -1 if devices.strip() == "-1" else int(devices) if devices.strip().isdigit() else devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, int):
        if devices == -1:
            return max(1, torch.cuda.device_count())
        if devices < 1:
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}): use a positive number, a list of indices or 'auto'."
            )
        return devices
    raise MisconfigurationException(
        f"Trainer(devices={devices!r}): use a positive number, a list of indices or 'auto'."
    )


def select_plugin(accelerator: str, strategy: Any, devices: Any, num_nodes: int, plugins: Any) -> Any:
    """The one training-type plugin of the run, from ``plugins=``/``strategy=`` or the device count."""
    given = [p for p in as_list(plugins) if p is not None]
    checkpoint_io = [p for p in given if isinstance(p, CheckpointIO)]
    environments = [p for p in given if isinstance(p, ClusterEnvironment)]
    given = [p for p in given if not isinstance(p, (CheckpointIO, ClusterEnvironment))]
    if len(environments) > 1:
        raise MisconfigurationException(
            f"Trainer(plugins=[...]) got {len(environments)} cluster environments "
            f"({', '.join(repr(e) for e in environments)}); pass at most one."
        )
    if strategy is not None and strategy != "auto":
        given.append(strategy)
    if len(given) > 1:
        raise MisconfigurationException(
            f"Trainer got {len(given)} training-type plugins ({', '.join(_name(p) for p in given)}); pass exactly one."
        )
    n_devices = _device_count(devices)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise MisconfigurationException(f"Trainer(num_nodes={num_nodes!r}): use a positive integer.")
    device = _resolve_device(accelerator, devices)
    if given:
        plugin = given[0]
        if isinstance(plugin, str):
            plugin = plugin_from_name(plugin)
        elif not isinstance(plugin, TrainingTypePlugin):
            raise MisconfigurationException(
                f"Trainer(plugins={plugin!r}): pass a TrainingTypePlugin, a CheckpointIO, a ClusterEnvironment "
                "or a registered plugin name."
            )
    elif n_devices * num_nodes == 1:
        plugin = plugin_from_name("single_device")
    else:
        from trainer_core.plugins import available_plugins

        if "ddp" not in available_plugins():
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}, num_nodes={num_nodes}) asks for several processes, which needs a "
                f"distributed plugin; this version has only: {', '.join(available_plugins())}."
            )
        plugin = plugin_from_name("ddp")
    if plugin.name == "single_device":
        if n_devices * num_nodes > 1:
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}, num_nodes={num_nodes}) asks for several processes but the plugin is "
                "'single_device'; pass a distributed plugin such as plugins='ddp'."
            )
        if hasattr(plugin, "set_default_device"):
            plugin.set_default_device(device)
    if checkpoint_io:
        plugin.checkpoint_io = checkpoint_io[-1]
    if environments:
        _give_environment(plugin, environments[0])
    plugin.configure_devices(device.type, n_devices, num_nodes)
    return plugin


def _give_environment(plugin: TrainingTypePlugin, environment: ClusterEnvironment) -> None:
    """``Trainer(plugins=[SLURMEnvironment(...)])``, as in Lightning: the plugin's cluster environment.

    A one-process plugin starts no processes, but keeps it too: the pre-emption handler reads its requeue
    settings there (trainer_core.signals).
    """
    own = getattr(plugin, "cluster_environment", None)
    if own is not None and own is not environment:
        raise MisconfigurationException(
            f"Trainer(plugins=[..., {environment!r}]) but the plugin {type(plugin).__name__} was given "
            f"cluster_environment={own!r} already; pass the environment in one place."
        )
    plugin.cluster_environment = environment


def _name(plugin: Any) -> str:
    return plugin if isinstance(plugin, str) else type(plugin).__name__


def configure_callbacks(
    callbacks: Any,
    enable_checkpointing: bool,
    enable_progress_bar: bool,
    enable_model_summary: bool = False,
    max_time: Any = None,
) -> list[Callback]:
    """The user's callbacks plus the defaults, with checkpointing callbacks last (Lightning's order).

    ``max_time`` adds a ``Timer`` checking after every batch, unless the user gave one.
    """
    result = as_list(callbacks)
    for cb in result:
        if not isinstance(cb, Callback):
            raise MisconfigurationException(
                f"Trainer(callbacks=...): {type(cb).__name__} is not a trainer_core.callbacks.Callback."
            )
    has_checkpoint = any(isinstance(cb, ModelCheckpoint) for cb in result)
    if has_checkpoint and not enable_checkpointing:
        raise MisconfigurationException(
            "Trainer(enable_checkpointing=False) but a ModelCheckpoint is in `callbacks`; remove one of the two."
        )
    if enable_checkpointing and not has_checkpoint:
        result.append(ModelCheckpoint())
    if max_time is not None:
        _add_timer(result, max_time)
    has_bar = any(isinstance(cb, ProgressBar) for cb in result)
    if has_bar and not enable_progress_bar:
        raise MisconfigurationException(
            "Trainer(enable_progress_bar=False) but a progress bar is in `callbacks`; remove one of the two."
        )
    if enable_progress_bar and not has_bar:
        result.append(TQDMProgressBar())
    if enable_model_summary and not any(isinstance(cb, ModelSummary) for cb in result):
        # Lightning's default: the rich table when ``rich`` is installed.
        result.append(RichModelSummary() if rich_available() else ModelSummary())
    return _reorder(result)


def _add_timer(callbacks: list[Callback], max_time: Any) -> None:
    if any(isinstance(cb, Timer) for cb in callbacks):
        if rank_zero_only.rank == 0:
            _logger.info(
                "Trainer(max_time=...) is ignored: `callbacks` already has a Timer, which sets the limit."
            )
        return
    try:
        callbacks.append(Timer(duration=max_time, interval="step"))
    except MisconfigurationException as err:
        raise MisconfigurationException(
            f"Trainer(max_time={max_time!r}): use 'DD:HH:MM:SS' (e.g. '00:12:00:00' for 12 hours), a "
            "datetime.timedelta, or a dict of timedelta's arguments ({'hours': 12})."
        ) from err


def merge_module_callbacks(
    current: list[Callback], extra: Union[Callback, Sequence[Callback]]
) -> list[Callback]:
    """``configure_callbacks`` results replace the Trainer's callbacks of the same type."""
    extra_list = as_list(extra)
    types = {type(cb) for cb in extra_list}
    kept = [cb for cb in current if type(cb) not in types]
    return _reorder(kept + extra_list)


def _reorder(callbacks: list[Callback]) -> list[Callback]:
    others = [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)]
    checkpoints = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
    return others + checkpoints


def configure_loggers(logger: Any, default_root_dir: str) -> list[Any]:
    """``True``/``None``: TensorBoard if installed, else CSV; ``False``: none; or the user's logger(s)."""
    if logger is False:
        return []
    if logger is None or logger is True:
        if tensorboard_available():
            return [TensorBoardLogger(save_dir=default_root_dir)]
        return [CSVLogger(save_dir=default_root_dir)]
    return as_list(logger)
