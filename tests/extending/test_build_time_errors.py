"""The natural mistakes of a user extending the Trainer, each refused where the object is built.

Written the way a user writes them: a class where an instance belongs, two of one kind in
``plugins=[...]``, a misspelt argument, a plugin whose ``__init__`` forgot ``super().__init__()``, a
registered name taken already. Each is one ``MisconfigurationException`` naming what is wrong and what
to write instead, raised before anything starts: no process, nothing written under the run's folder.
And the list done right: each piece lands where it belongs. In process; nothing here trains.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

from trainer_core import Trainer
from trainer_core.callbacks import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger
from trainer_core.plugins import (
    AsyncCheckpointIO,
    ClusterEnvironment,
    DDPPlugin,
    LocalEnvironment,
    SingleDevicePlugin,
    TorchCheckpointIO,
    available_plugins,
    plugin_from_name,
    register_plugin,
)
from trainer_core.plugins.io import CheckpointIO
from trainer_core.precision import Precision
from trainer_core.profilers import SimpleProfiler

QUIET: dict[str, Any] = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


# ---------------------------------------------------------------------------------- what a user writes
class MyCallback(Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        pass


class MyCheckpointIO(TorchCheckpointIO):
    """A user's IO: the built-in one under another name (what it writes does not matter here)."""


class MyEnvironment(ClusterEnvironment):
    """A scheduler that started every process itself; ``detect()`` is False, so no other test picks it."""

    creates_processes_externally = True

    def __init__(self, world_size: int = 1, rank: int = 0) -> None:
        self._world_size = world_size
        self._rank = rank

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def global_rank(self) -> int:
        return self._rank

    def local_rank(self) -> int:
        return self._rank

    def node_rank(self) -> int:
        return 0


class MyPrecision(Precision):
    """Float32 with nothing changed: a user's precision as small as it gets."""


class ForgetfulDDP(DDPPlugin):
    """A plugin subclass whose ``__init__`` never calls ``super().__init__()``."""

    def __init__(self, note: str = "") -> None:
        self.note = note


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def refused(folder: Path, build: Callable[[], Any]) -> str:
    """The message of the one MisconfigurationException ``build`` raises, checking nothing started."""
    before = _children()
    with pytest.raises(MisconfigurationException) as raised:
        build()
    assert _children() <= before, "a process was started"
    assert sorted(os.listdir(folder)) == [], "something was written under the run's folder"
    return str(raised.value)


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names registered by a test end with it: the registry is global to the process."""
    from trainer_core.plugins import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The run's folder and the working directory: a mistake must leave it empty."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def trainer(folder: Path, **kwargs: Any) -> Trainer:
    return Trainer(default_root_dir=folder, **{**QUIET, **kwargs})


# ---------------------------------------------------------------------------------- a class, not an instance
def test_checkpoint_io_given_as_a_class_is_refused_where_the_plugin_is_built(folder: Path) -> None:
    # The first case: accepted before, it failed after a whole epoch, at the first save.
    message = refused(folder, lambda: DDPPlugin(checkpoint_io=TorchCheckpointIO))
    assert (
        message
        == "DDPPlugin(checkpoint_io=TorchCheckpointIO): pass TorchCheckpointIO() (an instance, not the class)."
    )
    message = refused(folder, lambda: SingleDevicePlugin(checkpoint_io="checkpoints/"))
    assert message.startswith(
        "SingleDevicePlugin(checkpoint_io='checkpoints/'): got str; pass a CheckpointIO instance"
    )
    plugin = SingleDevicePlugin()
    message = refused(folder, lambda: setattr(plugin, "checkpoint_io", AsyncCheckpointIO))
    assert message == (
        "SingleDevicePlugin.checkpoint_io = AsyncCheckpointIO: pass AsyncCheckpointIO() (an instance, not the class)."
    )
    assert isinstance(plugin.checkpoint_io, TorchCheckpointIO)  # the refused value was not kept


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            {"plugins": [SingleDevicePlugin(), TorchCheckpointIO]},
            "Trainer(plugins=[..., TorchCheckpointIO]): pass TorchCheckpointIO() (an instance, not the class).",
        ),
        (
            {"devices": 2, "plugins": ["ddp", LocalEnvironment]},
            "Trainer(plugins=[..., LocalEnvironment]): pass LocalEnvironment() (an instance, not the class).",
        ),
        (
            {"plugins": [MyPrecision]},
            "Trainer(plugins=[..., MyPrecision]): pass MyPrecision() (an instance, not the class).",
        ),
        (
            {"devices": 2, "strategy": DDPPlugin},
            "Trainer(strategy=DDPPlugin): pass DDPPlugin() (an instance, not the class).",
        ),
        (
            {"callbacks": [MyCallback]},
            "Trainer(callbacks=[..., MyCallback]): pass MyCallback() (an instance, not the class).",
        ),
        ({"logger": CSVLogger}, "Trainer(logger=CSVLogger): pass CSVLogger() (an instance, not the class)."),
        (
            {"profiler": SimpleProfiler},
            "Trainer(profiler=SimpleProfiler): pass SimpleProfiler() (an instance, not the class).",
        ),
    ],
    ids=["checkpoint_io", "environment", "precision", "strategy", "callback", "logger", "profiler"],
)
def test_a_class_where_an_instance_belongs_says_what_to_write(
    folder: Path, arguments: dict[str, Any], expected: str
) -> None:
    assert refused(folder, lambda: trainer(folder, **arguments)) == expected


def test_something_of_no_kind_in_plugins_lists_the_four_kinds(folder: Path) -> None:
    message = refused(folder, lambda: trainer(folder, plugins=[SingleDevicePlugin(), MyCallback()]))
    assert message == (
        "Trainer(plugins=[..., MyCallback(...)]): MyCallback(...) is none of what plugins= takes: a "
        "TrainingTypePlugin or a registered name such as 'ddp'; a CheckpointIO; a ClusterEnvironment; a Precision. "
        "Pass instances of those, a registered plugin name, or None."
    )
    message = refused(folder, lambda: trainer(folder, strategy=MyCheckpointIO()))
    assert message == (
        "Trainer(strategy=MyCheckpointIO(...)): strategy= takes a training-type plugin or a registered name; pass "
        "the MyCheckpointIO in plugins=[...]."
    )
    message = refused(folder, lambda: trainer(folder, logger=print))
    assert message.startswith(
        "Trainer(logger=builtin_function_or_method(...)): got builtin_function_or_method; "
    )
    assert "pass a trainer_core.loggers.Logger instance" in message


# ---------------------------------------------------------------------------------- two of one kind
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            {"plugins": [TorchCheckpointIO(), AsyncCheckpointIO()]},
            "Trainer(plugins=[...]) got 2 CheckpointIOs: TorchCheckpointIO(...), AsyncCheckpointIO(...); pass "
            "exactly one.",
        ),
        (
            {"devices": 2, "plugins": ["ddp", MyEnvironment(2), LocalEnvironment()]},
            "Trainer(plugins=[...]) got 2 cluster environments: MyEnvironment(...), LocalEnvironment(...); pass "
            "exactly one.",
        ),
        (
            {"plugins": [MyPrecision(), Precision()]},
            "Trainer(plugins=[...]) got 2 precisions: MyPrecision(...), Precision(...); pass exactly one.",
        ),
        (
            {"devices": 2, "strategy": "ddp", "plugins": [DDPPlugin()]},
            "Trainer(strategy=..., plugins=[...]) got 2 training-type plugins: DDPPlugin(...), 'ddp'; pass exactly "
            "one.",
        ),
        (
            {"precision": "bf16-mixed", "plugins": [MyPrecision()]},
            "Trainer(precision='bf16-mixed', plugins=[..., MyPrecision(...)]) got two precisions; pass one: remove "
            "precision='bf16-mixed' or the MyPrecision in plugins=[...].",
        ),
    ],
    ids=["checkpoint_io", "environment", "precision", "training_type", "precision_argument"],
)
def test_two_of_one_kind_are_refused_naming_both(
    folder: Path, arguments: dict[str, Any], expected: str
) -> None:
    # Before, a second CheckpointIO silently replaced the first.
    assert refused(folder, lambda: trainer(folder, **arguments)) == expected


# ---------------------------------------------------------------------------------- plugins a user writes
def test_a_misspelt_plugin_argument_names_the_close_match(folder: Path) -> None:
    message = refused(folder, lambda: DDPPlugin(find_unused_parameter=True))
    assert message.startswith(
        "DDPPlugin(find_unused_parameter=True): unknown argument 'find_unused_parameter' (did you mean "
        "'find_unused_parameters'?). Valid arguments: "
    )
    message = refused(
        folder, lambda: trainer(folder, devices=2, plugins=plugin_from_name("ddp", start_methd="spawn"))
    )
    assert "unknown argument 'start_methd' (did you mean 'start_method'?)" in message


def test_a_plugin_that_forgot_super_init_is_refused_by_the_trainer(
    folder: Path, scratch_registry: None
) -> None:
    expected = re.escape("ForgetfulDDP.__init__ must call super().__init__(...): ")
    message = refused(folder, lambda: trainer(folder, devices=2, plugins=[ForgetfulDDP(note="x")]))
    assert (
        re.match(expected, message) and "Add super().__init__(**kwargs) to ForgetfulDDP.__init__" in message
    )
    # The same plugin chosen by a registered name.
    register_plugin("forgetful", ForgetfulDDP)
    message = refused(folder, lambda: trainer(folder, devices=2, strategy="forgetful"))
    assert re.match(expected, message)


def test_a_profiler_that_forgot_super_init_is_refused(folder: Path) -> None:
    class ForgetfulProfiler(SimpleProfiler):
        def __init__(self) -> None:
            self.events: list[str] = []

    message = refused(folder, lambda: trainer(folder, profiler=ForgetfulProfiler()))
    assert message.startswith(
        "Trainer(profiler=ForgetfulProfiler(...)): ForgetfulProfiler.__init__ must call super().__init__(...)"
    )


def test_a_logger_lacking_a_required_member_cannot_be_built(folder: Path) -> None:
    """``log_metrics``/``log_hyperparams`` are abstract: the mistake shows where the logger is built."""
    from trainer_core.loggers import Logger

    class MetricsOnly(Logger):
        def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
            pass

    with pytest.raises(TypeError, match="abstract method log_hyperparams"):
        MetricsOnly()
    assert not list(folder.iterdir())


# ---------------------------------------------------------------------------------- the registry
def test_registering_a_taken_name_needs_override(folder: Path) -> None:
    message = refused(folder, lambda: register_plugin("ddp", ForgetfulDDP))
    assert message == (
        "register_plugin('ddp', ForgetfulDDP): 'ddp' already builds DDPPlugin(start_method='popen'); pass "
        "override=True to replace it, or choose another name."
    )
    plugin = plugin_from_name("ddp")
    assert type(plugin) is DDPPlugin and plugin.start_method == "popen"  # unchanged
    message = refused(folder, lambda: register_plugin("fsdp", ForgetfulDDP))
    assert "'fsdp' already builds FSDPPlugin(); pass override=True" in message


def test_the_registry_checks_what_it_is_given_and_what_it_builds(
    folder: Path, scratch_registry: None
) -> None:
    names = available_plugins()
    assert refused(folder, lambda: register_plugin("", DDPPlugin)).startswith(
        "register_plugin('', ...): the name must be a non-empty string"
    )
    assert refused(folder, lambda: register_plugin("my_io", MyCheckpointIO)).startswith(
        "register_plugin('my_io', MyCheckpointIO): MyCheckpointIO is not a TrainingTypePlugin; register a subclass"
    )
    assert refused(folder, lambda: register_plugin("my_ddp", DDPPlugin())) == (
        "register_plugin('my_ddp', DDPPlugin(...)): pass the class, DDPPlugin, not an instance: the registry builds "
        "a new plugin each time the name is used (or pass a function that returns one)."
    )
    assert available_plugins() == names  # nothing was registered
    register_plugin("my_io", lambda: MyCheckpointIO())
    message = refused(folder, lambda: trainer(folder, plugins="my_io"))
    assert message == (
        "Trainer(plugins='my_io'): <lambda>, registered under 'my_io', "
        "returned MyCheckpointIO, not a TrainingTypePlugin; make it return the plugin it builds."
    )


# ---------------------------------------------------------------------------------- done right
def test_each_piece_of_the_list_goes_where_it_belongs(folder: Path) -> None:
    """Lightning's mixed list: the plugin, its checkpoint IO, its environment and its precision."""
    ddp, io, environment, precision = (
        DDPPlugin(),
        MyCheckpointIO(),
        MyEnvironment(world_size=1),
        MyPrecision(),
    )
    built = trainer(folder, plugins=[precision, environment, ddp, io])
    assert built.strategy is ddp
    assert ddp.checkpoint_io is io
    assert ddp.cluster_environment is environment
    assert ddp.precision is precision and built.precision_plugin is precision
    # A registered name with the same pieces, as strategy=; precision= given as well, at its default.
    io2, environment2 = CheckpointIOFromList(), MyEnvironment(world_size=2, rank=1)
    built = trainer(folder, strategy="ddp", devices=2, precision="32-true", plugins=[io2, environment2])
    assert type(built.strategy) is DDPPlugin and built.strategy.checkpoint_io is io2
    assert built.strategy.cluster_environment is environment2
    assert (built.global_rank, built.world_size) == (1, 2)
    assert sorted(os.listdir(folder)) == []


class CheckpointIOFromList(CheckpointIO):
    """The three methods a CheckpointIO must write, in memory."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved[str(path)] = checkpoint

    def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:
        return self.saved[str(path)]

    def remove_checkpoint(self, path: Any) -> None:
        self.saved.pop(str(path), None)
