"""``SingleDevicePlugin`` on its own: one process, the base plugin's rules with no collective.

In process: the device it runs on (given, or picked by the Trainer), the collectives as identities,
the optimizer state as the optimizer's own, the module's state dict by plain names, and files
written through its ``checkpoint_io``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainer_core.plugins import CheckpointIO, SingleDevicePlugin, TorchCheckpointIO


def test_the_device_is_the_cpu_unless_picked_or_given() -> None:
    plugin = SingleDevicePlugin()
    assert plugin.root_device == torch.device("cpu")
    plugin.set_default_device("meta")
    assert plugin.root_device == torch.device("meta")
    # A device the user names wins over the Trainer's pick.
    given = SingleDevicePlugin(device="cpu")
    given.set_default_device("meta")
    assert given.root_device == torch.device("cpu")


def test_one_process_at_rank_zero_without_a_data_split() -> None:
    plugin = SingleDevicePlugin()
    assert (plugin.global_rank, plugin.local_rank, plugin.node_rank, plugin.world_size) == (0, 0, 0, 1)
    assert plugin.is_global_zero and plugin.distributed_sampler_kwargs is None
    assert plugin.parallel_dims is None and plugin.metrics_group is None
    loader = torch.utils.data.DataLoader(list(range(4)))
    assert plugin.process_dataloader(loader, "train", True) is loader


def test_collectives_give_this_processs_values() -> None:
    plugin = SingleDevicePlugin()
    value = torch.tensor(2.5)
    assert plugin.reduce(value, reduce_op="sum") is value
    assert plugin.all_gather(torch.tensor([1, 2])).tolist() == [[1, 2]]
    assert plugin.all_gather_object({"a": 1}) == [{"a": 1}]
    assert plugin.broadcast("x") == "x"
    assert plugin.reduce_boolean_decision(False) is False and plugin.reduce_boolean_decision(True, all=False)
    plugin.barrier("nothing to wait for")


def test_the_model_is_the_users_module_on_the_device() -> None:
    plugin = SingleDevicePlugin()
    module = nn.Linear(2, 1)
    plugin.connect(module)
    assert plugin.lightning_module is module and plugin.model is module and plugin.model_parts == [module]
    assert plugin.wrap_model(module) is module
    plugin.model_to_device()
    assert module.weight.device == torch.device("cpu")
    batch = {"x": torch.ones(2)}
    assert plugin.batch_to_device(batch)["x"].device == torch.device("cpu")
    # The torch scaler of "16-mixed": this process holds every gradient.
    assert type(plugin.grad_scaler()) is torch.amp.GradScaler


def test_state_round_trips_through_the_plugin() -> None:
    torch.manual_seed(0)
    source, target = nn.Linear(3, 2), nn.Linear(3, 2)
    plugin = SingleDevicePlugin()
    plugin.connect(source)
    optimizer = torch.optim.Adam(source.parameters(), lr=0.1)
    source(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = plugin.lightning_module_state_dict()
    assert list(state) == ["weight", "bias"]
    # A plain optimizer's state is its own on the one rank; checkpoints store it by parameter name.
    assert plugin.optimizer_state(optimizer)["state"].keys() == {0, 1}
    named = plugin.named_optimizer_state(optimizer)
    assert sorted(named["state"]) == ["bias", "weight"]
    assert torch.equal(named["state"]["weight"]["exp_avg"], optimizer.state[source.weight]["exp_avg"])

    loader = SingleDevicePlugin()
    loader.connect(target)
    loader.load_model_state_dict(state)
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
    target_optimizer = torch.optim.Adam(target.parameters(), lr=0.1)
    prepared = loader.prepare_optimizer_state(target_optimizer, named, "x.ckpt")
    loader.load_optimizer_state_dict(target_optimizer, prepared)
    assert torch.equal(
        target_optimizer.state[target.weight]["exp_avg"], optimizer.state[source.weight]["exp_avg"]
    )
    assert target_optimizer.state[target.bias]["step"].item() == 1.0
    assert target_optimizer.param_groups[0]["lr"] == 0.1


def test_a_misshaped_optimizer_state_is_refused_before_loading(tmp_path: Path) -> None:
    plugin = SingleDevicePlugin()
    module = nn.Linear(3, 2)
    plugin.connect(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    named = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["weight"]}]}
    with pytest.raises(Exception, match="bias") as raised:
        plugin.prepare_optimizer_state(optimizer, named, str(tmp_path / "bad.ckpt"))
    assert "bad.ckpt" in str(raised.value)


class _MemoryIO(CheckpointIO):
    """Checkpoints kept in a dict: what the plugin hands its IO, and what it gets back."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.files[str(path)] = checkpoint

    def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:
        return self.files[str(path)]

    def remove_checkpoint(self, path: Any) -> None:
        del self.files[str(path)]


def test_checkpoint_files_go_through_its_checkpoint_io() -> None:
    assert isinstance(SingleDevicePlugin().checkpoint_io, TorchCheckpointIO)
    io = _MemoryIO()
    plugin = SingleDevicePlugin(checkpoint_io=io)
    checkpoint = {"epoch": 1}
    plugin.save_checkpoint(checkpoint, "memory://one.ckpt")
    assert io.files == {"memory://one.ckpt": checkpoint}
    assert plugin.load_checkpoint("memory://one.ckpt") is checkpoint
    plugin.remove_checkpoint("memory://one.ckpt")
    assert io.files == {}
