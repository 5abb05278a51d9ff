"""One rule per concern in the plugins, checked in process (no process group, under a second in all).

Every plugin class shows its real arguments to ``inspect.signature`` (LightningCLI's YAML, ``help()``);
the registry, not ``__new__``, picks the pipeline variant of ``"model_parallel"``; one property says
whether ranks hold partial gradients and so which loss scaler runs; ``total_grad_norm`` is torch's
norm on one process; ``ParallelDims`` alone answers which share of the data a rank reads.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from trainer_core import plugins
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import ClusterEnvironment, ModelParallelPlugin, PipelineModelParallelPlugin
from trainer_core.plugins.grad_norm import clip_grads_by_total_norm, total_grad_norm
from trainer_core.plugins.parallel_dims import ParallelDims
from trainer_core.plugins.registry import plugin_from_name

# Each plugin class and arguments that only it takes: its signature must name them.
OWN_ARGUMENTS = {
    "TrainingTypePlugin": ["checkpoint_io"],
    "SingleDevicePlugin": ["device", "checkpoint_io"],
    "ParallelPlugin": [
        "start_method",
        "process_group_backend",
        "timeout",
        "cluster_environment",
        "checkpoint_io",
    ],
    "DDPPlugin": ["start_method", "timeout", "checkpoint_io"],
    "FSDPPlugin": ["auto_wrap_policy", "state_dict_type", "hybrid_shard"],
    "PipelinePlugin": ["split_points", "schedule", "n_microbatches", "data_parallel_size"],
    "ModelParallelPlugin": [
        "data_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "save_distributed_checkpoint",
        "start_method",
        "checkpoint_io",
    ],
    "PipelineModelParallelPlugin": ["tensor_parallel_size", "pipeline_parallel_size", "split_points"],
}


@pytest.mark.parametrize("name", sorted(OWN_ARGUMENTS))
def test_every_plugin_class_shows_its_real_arguments(name: str) -> None:
    parameters = inspect.signature(getattr(plugins, name)).parameters
    assert [n for n in OWN_ARGUMENTS[name] if n not in parameters] == []
    assert not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values())


def test_model_parallel_signature_is_its_init() -> None:
    parameters = inspect.signature(ModelParallelPlugin).parameters
    assert parameters["tensor_parallel_size"].default == "auto"
    assert parameters["pipeline_parallel_size"].default == 1
    assert "args" not in parameters and "kwargs" not in parameters


def test_the_registry_picks_the_pipeline_variant() -> None:
    sizes = {"data_parallel_size": 1, "tensor_parallel_size": 1}
    plain = plugin_from_name("model_parallel", save_distributed_checkpoint=False, **sizes)
    assert type(plain) is ModelParallelPlugin
    staged = plugin_from_name("model_parallel", pipeline_parallel_size=2, split_points=["layers.1"], **sizes)
    assert type(staged) is PipelineModelParallelPlugin
    assert staged.split_points == ["layers.1"] and staged.pipeline_parallel_size == 2


def test_model_parallel_with_pipeline_stages_names_the_class_to_use() -> None:
    with pytest.raises(MisconfigurationException) as raised:
        ModelParallelPlugin(pipeline_parallel_size=2, split_points=["layers.1"])
    message = str(raised.value)
    assert message.startswith("ModelParallelPlugin(pipeline_parallel_size=2): ")
    assert "PipelineModelParallelPlugin" in message and "plugins='model_parallel'" in message


class _Ranks(ClusterEnvironment):
    """Rank ``rank`` of ``world`` as the plugin sees it; nothing is started and no process group is made."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        return False  # passed explicitly, never picked by detect_environment

    def __init__(self, world: int, rank: int = 0) -> None:
        self._world, self._rank = world, rank

    def world_size(self) -> int:
        return self._world

    def global_rank(self) -> int:
        return self._rank

    def local_rank(self) -> int:
        return self._rank

    def node_rank(self) -> int:
        return 0


def _built(name: str, world: int, **kwargs: Any) -> Any:
    if name == "ddp_sharded":
        pytest.importorskip("fairscale")
    if name in ("single_device",):
        return plugin_from_name(name)
    return plugin_from_name(name, cluster_environment=_Ranks(world), **kwargs)


@pytest.mark.parametrize(
    ("name", "partial"),
    [
        ("single_device", False),
        ("ddp", False),
        ("zero", False),
        ("ddp_sharded", True),
        ("fsdp", True),
        ("pipeline", True),
        ("model_parallel", True),
    ],
)
def test_holding_partial_gradients_picks_the_sharded_scaler(name: str, partial: bool) -> None:
    plugin = _built(name, 2)
    assert plugin.holds_partial_gradients is partial
    scaler = plugin.grad_scaler()
    assert isinstance(scaler, ShardedGradScaler) is partial
    assert isinstance(scaler, torch.amp.GradScaler)


def test_one_process_needs_no_sharded_scaler() -> None:
    plugin = _built("fsdp", 1)
    assert plugin.holds_partial_gradients
    assert type(plugin.grad_scaler()) is torch.amp.GradScaler


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_total_grad_norm_is_torchs_clip_grad_norm_on_one_process(
    norm_type: float, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)
    model(torch.randn(4, 7, dtype=dtype)).pow(2).sum().backward()
    reference = copy.deepcopy(model)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        theirs.grad = ours.grad.clone()
    grads = [p.grad for p in model.parameters()]
    assert torch.equal(total_grad_norm(grads, norm_type), torch.nn.utils.get_total_norm(grads, norm_type))
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
    assert expected > 0.05  # clipping acts
    got = clip_grads_by_total_norm(grads, 0.05, norm_type)
    assert torch.equal(got, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_the_plugin_clips_as_torch_on_one_process(algorithm: str) -> None:
    """The base plugin's one clipping rule: by norm as ``clip_grad_norm_``, by value as ``clip_grad_value_``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    reference = copy.deepcopy(model)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        theirs.grad = ours.grad.clone()
    clip = torch.nn.utils.clip_grad_norm_ if algorithm == "norm" else torch.nn.utils.clip_grad_value_
    clip(reference.parameters(), 0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin_from_name("single_device").clip_gradients(optimizer, 0.01, algorithm)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad)
    assert model.weight.grad.abs().max() <= 0.01


@pytest.mark.parametrize(
    ("layout", "rank", "expected"),
    [
        ({"world_size": 4}, 3, {"num_replicas": 4, "rank": 3}),
        ({"world_size": 4, "tp": 2}, 3, {"num_replicas": 2, "rank": 1}),
        ({"world_size": 4, "tp": 2}, 2, {"num_replicas": 2, "rank": 1}),
        ({"world_size": 8, "pp": 2, "tp": 2}, 5, {"num_replicas": 2, "rank": 0}),
        ({"world_size": 8, "pp": 2, "tp": 2}, 7, {"num_replicas": 2, "rank": 1}),
        ({"world_size": 4, "pp": 2}, 2, {"num_replicas": 2, "rank": 0}),
        ({"world_size": 4, "dp_replicate": 2, "dp_shard": 2}, 3, {"num_replicas": 4, "rank": 3}),
    ],
)
def test_parallel_dims_gives_the_sampler_arguments(
    layout: dict[str, int], rank: int, expected: dict[str, int]
) -> None:
    dims = ParallelDims(**layout)
    assert dims.distributed_sampler_kwargs(rank) == expected
    assert dims.dp_rank(rank) == expected["rank"]


@pytest.mark.parametrize(
    ("name", "world", "rank", "kwargs", "expected"),
    [
        ("ddp", 4, 3, {}, {"num_replicas": 4, "rank": 3}),
        ("fsdp", 4, 1, {"hybrid_shard": (2, 2)}, {"num_replicas": 4, "rank": 1}),
        (
            "model_parallel",
            4,
            3,
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            {"num_replicas": 2, "rank": 1},
        ),
        ("pipeline", 4, 3, {"split_points": ["b"], "data_parallel_size": 2}, {"num_replicas": 2, "rank": 1}),
    ],
)
def test_plugins_ask_parallel_dims_for_the_sampler_arguments(
    name: str, world: int, rank: int, kwargs: dict[str, Any], expected: dict[str, int]
) -> None:
    plugin = plugin_from_name(name, cluster_environment=_Ranks(world, rank), **kwargs)
    plugin.configure_devices("cpu", world, 1)
    assert plugin.distributed_sampler_kwargs == expected
    assert plugin.distributed_sampler_kwargs == plugin.parallel_dims.distributed_sampler_kwargs(rank)
