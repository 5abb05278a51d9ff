"""Plugin configuration is strict: every keyword argument is read, or refused when the plugin is built.

A misspelt name (``FSDPPlugin(reshard_after_foward=False)``) used to be passed down to a
``DistributedDataParallel`` that the plugin never builds, and silently ignored. Now it fails at
construction with the argument, the plugin, a close match and the valid names; the arguments
Lightning users pass to ``DDPPlugin`` (``find_unused_parameters=True``, ``static_graph=True``,
``gradient_as_bucket_view=True``) still reach the wrapper, which a real two-rank run checks.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
from launch import LAUNCH_VARS
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, plugins
from trainer_core.callbacks import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import (
    ClusterEnvironment,
    DDPPlugin,
    PipelinePlugin,
    TrainingTypePlugin,
    ZeroPlugin,
)
from trainer_core.plugins.registry import available_plugins, plugin_from_name


def _plugin_class(name: str) -> type[TrainingTypePlugin]:
    """The plugin class ``name``; DDPShardedPlugin needs fairscale, an optional extra."""
    if name == "DDPShardedPlugin":
        pytest.importorskip("fairscale")
    return getattr(plugins, name)


# (plugin, a misspelt argument, the argument meant)
TYPOS = [
    ("TrainingTypePlugin", "checkpoint", "checkpoint_io"),
    ("SingleDevicePlugin", "devic", "device"),
    ("DDPPlugin", "find_unused_parameter", "find_unused_parameters"),
    ("DDPPlugin", "start_methd", "start_method"),
    ("ZeroPlugin", "parameters_as_bucket_vew", "parameters_as_bucket_view"),
    ("ZeroPlugin", "static_grap", "static_graph"),
    ("DDPShardedPlugin", "reduce_bufer_size", "reduce_buffer_size"),
    ("FSDPPlugin", "reshard_after_foward", "reshard_after_forward"),
    ("PipelinePlugin", "split_point", "split_points"),
]


def _valid_names(message: str) -> list[str]:
    """The names after "Valid arguments:", the plugin's own and the wrapper's."""
    listed = message.split("Valid arguments: ", 1)[1].rstrip(".")
    return re.split(r", |; passed on to \w+: ", listed)


@pytest.mark.parametrize(("plugin", "typo", "meant"), TYPOS)
def test_a_misspelt_argument_is_refused_with_the_name_meant(plugin: str, typo: str, meant: str) -> None:
    cls = _plugin_class(plugin)
    with pytest.raises(MisconfigurationException) as raised:
        cls(**{typo: True})
    message = str(raised.value)
    assert message.startswith(
        f"{cls.__name__}({typo}=True): unknown argument {typo!r} (did you mean {meant!r}?). Valid arguments: "
    )
    assert meant in _valid_names(message)


def test_the_valid_arguments_are_the_plugins_own_then_the_wrappers() -> None:
    with pytest.raises(MisconfigurationException) as raised:
        DDPPlugin(bogus=1)
    message = str(raised.value)
    assert "did you mean" not in message
    own, wrapper = message.split("Valid arguments: ", 1)[1].rstrip(".").split("; passed on to ")
    assert own.split(", ") == [
        "start_method",
        "process_group_backend",
        "timeout",
        "cluster_environment",
        "checkpoint_io",
        "ddp_comm_state",
        "ddp_comm_hook",
        "ddp_comm_wrapper",
    ]
    name, names = wrapper.split(": ")
    assert name == "DistributedDataParallel"
    for lightning_name in (
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "bucket_cap_mb",
    ):
        assert lightning_name in names.split(", ")
    # The plugin sets these itself: one device per process, and the module it wraps.
    assert "device_ids" not in names.split(", ") and "module" not in names.split(", ")


def test_several_unknown_arguments_are_named_at_once() -> None:
    with pytest.raises(MisconfigurationException) as raised:
        PipelinePlugin(split_point=["layers.2"], shedule="GPipe", colour="red")
    assert str(raised.value).startswith(
        "PipelinePlugin(split_point=['layers.2'], shedule='GPipe', colour='red'): unknown arguments 'split_point' "
        "(did you mean 'split_points'?), 'shedule' (did you mean 'schedule'?), 'colour'. Valid arguments: "
    )


@pytest.mark.parametrize(
    ("plugin", "argument"),
    [
        # FSDP and the pipeline build no DistributedDataParallel: its arguments would be ignored.
        ("FSDPPlugin", "find_unused_parameters"),
        ("FSDPPlugin", "broadcast_buffers"),
        ("PipelinePlugin", "static_graph"),
        # Set by the plugin from the process's local rank, or the module it wraps.
        ("DDPPlugin", "device_ids"),
        ("DDPPlugin", "module"),
        ("DDPShardedPlugin", "sharded_optimizer"),
        # ShardedDataParallel takes no DistributedDataParallel argument.
        ("DDPShardedPlugin", "find_unused_parameters"),
    ],
)
def test_a_wrapper_argument_the_plugin_would_not_pass_on_is_refused(plugin: str, argument: str) -> None:
    cls = _plugin_class(plugin)
    with pytest.raises(
        MisconfigurationException, match=rf"^{cls.__name__}\({argument}=True\): unknown argument"
    ):
        cls(**{argument: True})


@pytest.mark.parametrize("name", available_plugins())
def test_every_registry_name_refuses_an_unknown_argument(name: str) -> None:
    if name == "ddp_sharded":
        pytest.importorskip("fairscale")
    with pytest.raises(
        MisconfigurationException, match=r"\(colour='red'\): unknown argument 'colour'\. Valid arguments: "
    ):
        plugin_from_name(name, colour="red")


def test_a_registry_name_takes_the_plugins_arguments() -> None:
    plugin = plugin_from_name("ddp_spawn", find_unused_parameters=True, timeout=timedelta(minutes=1))
    assert isinstance(plugin, DDPPlugin) and plugin.start_method == "spawn"
    assert plugin.timeout == timedelta(minutes=1)
    with pytest.raises(MisconfigurationException, match=r"did you mean 'reshard_after_forward'\?"):
        plugin_from_name("fsdp", reshard_after_foward=False)


# ---------------------------------------------------------------------- the arguments reach the wrapper
class _TwoRanks(ClusterEnvironment):
    """Rank 0 of two, as the plugin sees it; nothing is started and no process group is made."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        return False  # passed explicitly, never picked by detect_environment

    def world_size(self) -> int:
        return 2

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0


class _Recorder:
    """Stands in for the wrapper class: records the keyword arguments the plugin builds it with."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def __call__(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        self.kwargs = kwargs
        return module


LIGHTNING_DDP_ARGUMENTS = {
    "find_unused_parameters": True,
    "static_graph": True,
    "gradient_as_bucket_view": True,
}


@pytest.mark.parametrize("plugin", [DDPPlugin, ZeroPlugin])
def test_lightning_style_arguments_are_passed_to_distributed_data_parallel(
    plugin: type[DDPPlugin], monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = plugin(cluster_environment=_TwoRanks(), **LIGHTNING_DDP_ARGUMENTS)
    recorder = _Recorder()
    monkeypatch.setattr("trainer_core.plugins.ddp.DistributedDataParallel", recorder)
    instance.wrap_model(nn.Linear(2, 2))
    assert recorder.kwargs == {"device_ids": None, **LIGHTNING_DDP_ARGUMENTS}


def test_sharded_arguments_are_passed_to_sharded_data_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = _plugin_class("DDPShardedPlugin")
    plugin = cls(cluster_environment=_TwoRanks(), reduce_buffer_size=2**20, broadcast_buffers=False)
    recorder = _Recorder()
    monkeypatch.setattr("fairscale.nn.data_parallel.ShardedDataParallel", recorder)
    module = nn.Linear(2, 2)
    plugin.optimizers = [torch.optim.SGD(module.parameters(), lr=0.1)]
    plugin.wrap_model(module)
    assert recorder.kwargs == {
        "sharded_optimizer": plugin.optimizers,
        "reduce_buffer_size": 2**20,
        "broadcast_buffers": False,
    }


class _UnusedParameterNet(LightningModule):
    """A layer outside the loss: DistributedDataParallel fails on the second step unless told to look for it."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.used(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _WrapperSettings(Callback):
    """Reads the settings of the wrapper rank 0 trains through; ddp_spawn hands them back as callback state."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wrapper = trainer.plugin.model
        self.seen = {"wrapper": type(wrapper).__name__}
        self.seen.update({name: getattr(wrapper, name, None) for name in LIGHTNING_DDP_ARGUMENTS})

    def state_dict(self) -> dict[str, Any]:
        return dict(self.seen)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = dict(state_dict)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_find_unused_parameters_reaches_ddp_in_a_two_rank_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        # The launcher sets the rendezvous in this process; monkeypatch removes it again afterwards.
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    settings = _WrapperSettings()
    trainer = Trainer(
        plugins=DDPPlugin(start_method="spawn", find_unused_parameters=True, gradient_as_bucket_view=True),
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[settings],
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer.fit(_UnusedParameterNet(), DataLoader(data, batch_size=4))
    # Three steps on two ranks with a parameter outside the loss: only find_unused_parameters=True gets there.
    assert trainer.global_step == 3
    assert settings.seen == {
        "wrapper": "DistributedDataParallel",
        "find_unused_parameters": True,
        "gradient_as_bucket_view": True,
        "static_graph": False,
    }
