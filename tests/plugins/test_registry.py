"""The plugin registry (``plugins/registry.py``): the names a user may pass as ``Trainer(plugins="...")``.

Every built-in name builds the class it stands for with its defaults, a keyword argument overrides a
default and is checked by the plugin, an unknown name is refused with the known ones listed, and a
name registered by the user works like a built-in one. In process, without starting anything.
(That every name refuses a misspelt argument is ``test_plugin_config.py``.)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from trainer_core import Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import (
    DDPPlugin,
    DistributedCheckpointIO,
    FSDPPlugin,
    ModelParallelPlugin,
    PipelinePlugin,
    SingleDevicePlugin,
    TrainingTypePlugin,
    ZeroPlugin,
    available_plugins,
    plugin_from_name,
    register_plugin,
)

#: Each built-in name and the class it builds (ddp_sharded is checked apart: fairscale is optional).
BUILT_IN = {
    "single_device": SingleDevicePlugin,
    "ddp": DDPPlugin,
    "ddp_spawn": DDPPlugin,
    "zero": ZeroPlugin,
    "fsdp": FSDPPlugin,
    "pipeline": PipelinePlugin,
    "model_parallel": ModelParallelPlugin,
}


def test_the_built_in_names_are_listed_in_order() -> None:
    names = available_plugins()
    assert names == sorted(names)
    assert set(names) >= {*BUILT_IN, "ddp_sharded"}


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_each_name_builds_its_class(name: str) -> None:
    plugin = plugin_from_name(name)
    assert type(plugin) is BUILT_IN[name]
    # The plugin's own name is the registry's; "ddp_spawn" is DDP started another way.
    assert plugin.name == ("ddp" if name == "ddp_spawn" else name)


def test_ddp_sharded_builds_the_fairscale_plugin() -> None:
    pytest.importorskip("fairscale")
    from trainer_core.plugins import DDPShardedPlugin

    plugin = plugin_from_name("ddp_sharded")
    assert type(plugin) is DDPShardedPlugin and plugin.name == "ddp_sharded"


@pytest.mark.parametrize(("name", "start_method"), [("ddp", "popen"), ("ddp_spawn", "spawn")])
def test_ddp_names_differ_in_how_processes_start(name: str, start_method: str) -> None:
    plugin = plugin_from_name(name)
    assert plugin.start_method == start_method
    # A keyword argument overrides the name's default.
    assert plugin_from_name(name, start_method="fork").start_method == "fork"


def test_keyword_arguments_reach_the_plugin() -> None:
    ddp = plugin_from_name("ddp_spawn", timeout=timedelta(seconds=30))
    assert ddp.timeout == timedelta(seconds=30)
    fsdp = plugin_from_name("fsdp", state_dict_type="sharded", reshard_after_forward=False)
    assert isinstance(fsdp.checkpoint_io, DistributedCheckpointIO) and fsdp.reshard_after_forward is False
    assert plugin_from_name("single_device", device="meta").root_device == torch.device("meta")


def test_keyword_values_are_checked_by_the_plugin() -> None:
    with pytest.raises(MisconfigurationException) as raised:
        plugin_from_name("ddp", start_method="thread")
    assert str(raised.value) == (
        "DDPPlugin(start_method='thread'): use 'popen' (re-run the script), 'spawn', 'fork' or 'forkserver'."
    )
    with pytest.raises(
        MisconfigurationException, match=r"^FSDPPlugin\(state_dict_type='local'\): use 'full'"
    ):
        plugin_from_name("fsdp", state_dict_type="local")


def test_model_parallel_with_a_pipeline_builds_the_pipeline_variant() -> None:
    plugin = plugin_from_name("model_parallel", pipeline_parallel_size=2, split_points=["layers.1"])
    assert isinstance(plugin, PipelinePlugin) and type(plugin).__name__ == "PipelineModelParallelPlugin"
    assert plugin.name == "model_parallel"
    assert type(plugin_from_name("model_parallel", pipeline_parallel_size=1)) is ModelParallelPlugin


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(MisconfigurationException) as raised:
        plugin_from_name("dpp")
    assert str(raised.value) == (
        f"Trainer(plugins='dpp'): no plugin has that name. Known names: {', '.join(available_plugins())}."
    )


class _UserPlugin(SingleDevicePlugin):
    name = "test_registry_user_plugin"

    def __init__(self, device: Any = None, marker: str = "", **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self.marker = marker


def test_a_registered_name_works_as_a_built_in_one() -> None:
    # Left registered: a name only this test uses; override=True lets the test run twice in one process.
    register_plugin(_UserPlugin.name, _UserPlugin, override=True, marker="default")
    assert _UserPlugin.name in available_plugins()
    plugin = plugin_from_name(_UserPlugin.name)
    assert type(plugin) is _UserPlugin and plugin.marker == "default"
    assert plugin_from_name(_UserPlugin.name, marker="given").marker == "given"
    trainer = Trainer(
        plugins=_UserPlugin.name, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    assert type(trainer.strategy) is _UserPlugin
    assert isinstance(trainer.strategy, TrainingTypePlugin)


def test_a_trainer_takes_a_name_with_its_defaults() -> None:
    trainer = Trainer(
        plugins="ddp_spawn", devices=2, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    assert type(trainer.strategy) is DDPPlugin and trainer.strategy.start_method == "spawn"
    assert trainer.world_size == 2
