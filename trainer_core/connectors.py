"""Turning the Trainer's arguments into a plugin, callbacks and loggers, once, at construction.

The checks of the run settings live in ``trainer_core.config`` (``TrainerConfig``); the questions the
core asks about callbacks during a run in ``trainer_core.callback_queries``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

# tests/callbacks/test_lambda.py imports ``callback_overrides`` from here, where it used to live.
from trainer_core.callback_queries import (
    callback_overrides,  # noqa: F401
    checkpoint_callbacks,
    has_model_summary,
    progress_bar_callback,
)
from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import Logger
from trainer_core.precision import Precision
from trainer_core.utilities import as_list, rank_zero_only
from trainer_core.utilities.arguments import is_class_of, pass_instance, require_instance

# The plugins, the default callbacks and loggers are imported where the Trainer builds them: ``import
# trainer_core`` should not pay for them (with fsspec, tqdm and the FLOP counter they brought in).
if TYPE_CHECKING:
    from trainer_core.plugins import TrainingTypePlugin
    from trainer_core.plugins.environments import ClusterEnvironment
    from trainer_core.plugins.io import CheckpointIO

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


#: The kinds ``Trainer(plugins=[...])`` takes apart, at most one of each (Lightning's rule), and where each goes.
_PLUGIN_KINDS = (
    ("training_type", "training-type plugin", "a TrainingTypePlugin or a registered name such as 'ddp'"),
    ("checkpoint_io", "CheckpointIO", "a CheckpointIO"),
    ("environment", "cluster environment", "a ClusterEnvironment"),
    ("precision", "precision", "a Precision"),
)
_DEFAULT_PRECISIONS = ("32-true", "32", 32, None)


@dataclass
class PluginParts:
    """``Trainer(plugins=[...], strategy=..., precision=...)`` taken apart, as Lightning's accelerator connector does.

    ``precision`` is the Precision found in the list, or else the ``precision=`` argument (a name or
    an instance), for :func:`trainer_core.precision.precision_from`.
    """

    training_type: Any = None
    checkpoint_io: Optional[CheckpointIO] = None
    environment: Optional[ClusterEnvironment] = None
    precision: Any = "32-true"


def split_plugins(plugins: Any, strategy: Any, precision: Any) -> PluginParts:
    """Sort ``plugins``/``strategy`` into their kinds; a duplicate, a class or an unknown object is refused."""
    found: dict[str, list[Any]] = {field: [] for field, _, _ in _PLUGIN_KINDS}
    for item in as_list(plugins):
        if item is not None:
            found[_kind_of(item, f"plugins=[..., {_shown(item)}]")].append(item)
    strategy_given = strategy is not None and strategy != "auto"
    if strategy_given:
        if _kind_of(strategy, f"strategy={_shown(strategy)}") != "training_type":
            raise MisconfigurationException(
                f"Trainer(strategy={_shown(strategy)}): strategy= takes a training-type plugin or a registered name; "
                f"pass the {type(strategy).__name__} in plugins=[...]."
            )
        found["training_type"].append(strategy)
    for field, kind, _ in _PLUGIN_KINDS:
        if len(found[field]) > 1:
            given = (
                "strategy=..., plugins=[...]"
                if strategy_given and field == "training_type"
                else "plugins=[...]"
            )
            raise MisconfigurationException(
                f"Trainer({given}) got {len(found[field])} {kind}s: {', '.join(_shown(p) for p in found[field])}; "
                "pass exactly one."
            )
    parts = PluginParts(**{field: items[0] for field, items in found.items() if items})
    if not found["precision"]:
        parts.precision = precision
    elif not _is_default_precision(precision):
        listed = _shown(parts.precision)
        raise MisconfigurationException(
            f"Trainer(precision={_shown(precision)}, plugins=[..., {listed}]) got two precisions; pass one: remove "
            f"precision={_shown(precision)} or the {type(parts.precision).__name__} in plugins=[...]."
        )
    return parts


def _kind_of(item: Any, given: str) -> str:
    """The field of :class:`PluginParts` ``item`` belongs to; ``given`` is how the user passed it."""
    from trainer_core.plugins import CheckpointIO, ClusterEnvironment, TrainingTypePlugin

    if isinstance(item, (TrainingTypePlugin, str)):
        return "training_type"
    if isinstance(item, CheckpointIO):
        return "checkpoint_io"
    if isinstance(item, ClusterEnvironment):
        return "environment"
    if isinstance(item, Precision):
        return "precision"
    if is_class_of(item, (TrainingTypePlugin, CheckpointIO, ClusterEnvironment, Precision)):
        raise MisconfigurationException(f"Trainer({given}): {pass_instance(item)}.")
    kinds = "; ".join(wanted for _, _, wanted in _PLUGIN_KINDS)
    what = f"the class {item.__name__}" if isinstance(item, type) else f"{type(item).__name__}(...)"
    raise MisconfigurationException(
        f"Trainer({given}): {what} is none of what plugins= takes: {kinds}. "
        "Pass instances of those, a registered plugin name, or None."
    )


def _is_default_precision(precision: Any) -> bool:
    return not isinstance(precision, Precision) and precision in _DEFAULT_PRECISIONS


def _shown(item: Any) -> str:
    """``'ddp'``, ``TorchCheckpointIO(...)`` or ``TorchCheckpointIO`` (a class): how a message names ``item``."""
    if isinstance(item, (str, int)):
        return repr(item)
    if isinstance(item, type):
        return item.__name__
    return f"{type(item).__name__}(...)"


def select_plugin(accelerator: str, parts: PluginParts, devices: Any, num_nodes: int) -> TrainingTypePlugin:
    """The one training-type plugin of the run, given its CheckpointIO and environment from ``parts``."""
    from trainer_core.plugins import plugin_from_name

    n_devices = _device_count(devices)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise MisconfigurationException(f"Trainer(num_nodes={num_nodes!r}): use a positive integer.")
    device = _resolve_device(accelerator, devices)
    plugin = parts.training_type
    if isinstance(plugin, str):
        plugin = plugin_from_name(plugin)
    elif plugin is None and n_devices * num_nodes == 1:
        plugin = plugin_from_name("single_device")
    elif plugin is None:
        from trainer_core.plugins import available_plugins

        if "ddp" not in available_plugins():
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}, num_nodes={num_nodes}) asks for several processes, which needs a "
                f"distributed plugin; this version has only: {', '.join(available_plugins())}."
            )
        plugin = plugin_from_name("ddp")
    _check_initialised(plugin)
    if plugin.name == "single_device":
        if n_devices * num_nodes > 1:
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}, num_nodes={num_nodes}) asks for several processes but the plugin is "
                "'single_device'; pass a distributed plugin such as plugins='ddp'."
            )
        if hasattr(plugin, "set_default_device"):
            plugin.set_default_device(device)
    if parts.checkpoint_io is not None:
        plugin.checkpoint_io = parts.checkpoint_io
    if parts.environment is not None:
        _give_environment(plugin, parts.environment)
    plugin.configure_devices(device.type, n_devices, num_nodes)
    return plugin


def _check_initialised(plugin: TrainingTypePlugin) -> None:
    """Refuse a plugin whose class's ``__init__`` did not run ``TrainingTypePlugin.__init__``.

    Without it the plugin lacks what the Trainer reads (its optimizers, precision, checkpoint IO) and the
    run would fail on the first of them, with an ``AttributeError`` deep in the loop.
    """
    if "_lightning_module" not in vars(plugin):
        name = type(plugin).__name__
        raise MisconfigurationException(
            f"{name}.__init__ must call super().__init__(...): the base class sets up what the Trainer reads "
            f"(optimizers, precision, checkpoint_io). Add super().__init__(**kwargs) to {name}.__init__, passing "
            "on the arguments the base takes."
        )


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
        if is_class_of(cb, Callback):
            raise MisconfigurationException(f"Trainer(callbacks=[..., {cb.__name__}]): {pass_instance(cb)}.")
        if not isinstance(cb, Callback):
            raise MisconfigurationException(
                f"Trainer(callbacks=...): {type(cb).__name__} is not a trainer_core.callbacks.Callback."
            )
    has_checkpoint = bool(checkpoint_callbacks(result))
    if has_checkpoint and not enable_checkpointing:
        raise MisconfigurationException(
            "Trainer(enable_checkpointing=False) but a ModelCheckpoint is in `callbacks`; remove one of the two."
        )
    if enable_checkpointing and not has_checkpoint:
        from trainer_core.callbacks.model_checkpoint import ModelCheckpoint

        result.append(ModelCheckpoint())
    if max_time is not None:
        _add_timer(result, max_time)
    has_bar = progress_bar_callback(result) is not None
    if has_bar and not enable_progress_bar:
        raise MisconfigurationException(
            "Trainer(enable_progress_bar=False) but a progress bar is in `callbacks`; remove one of the two."
        )
    if enable_progress_bar and not has_bar:
        from trainer_core.callbacks.progress import TQDMProgressBar

        result.append(TQDMProgressBar())
    if enable_model_summary and not has_model_summary(result):
        from trainer_core.callbacks.model_summary import ModelSummary, RichModelSummary, rich_available

        # Lightning's default: the rich table when ``rich`` is installed.
        result.append(RichModelSummary() if rich_available() else ModelSummary())
    return _reorder(result)


def _add_timer(callbacks: list[Callback], max_time: Any) -> None:
    from trainer_core.callbacks.timer import Timer

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
    checkpoints = checkpoint_callbacks(callbacks)
    last = {id(cb) for cb in checkpoints}
    return [cb for cb in callbacks if id(cb) not in last] + checkpoints


def configure_loggers(logger: Any, default_root_dir: str) -> list[Logger]:
    """``True``/``None``: TensorBoard if installed, else CSV; ``False``: none; or the user's logger(s)."""
    if logger is False:
        return []
    if logger is None or logger is True:
        from trainer_core.loggers import CSVLogger, TensorBoardLogger, tensorboard_available

        if tensorboard_available():
            return [TensorBoardLogger(save_dir=default_root_dir)]
        return [CSVLogger(save_dir=default_root_dir)]
    loggers = as_list(logger)
    for lg in loggers:
        require_instance(
            lg,
            Logger,
            "Trainer(logger=...)",
            "a trainer_core.loggers.Logger instance (CSVLogger(save_dir=...) or your subclass of Logger)",
        )
    return loggers
