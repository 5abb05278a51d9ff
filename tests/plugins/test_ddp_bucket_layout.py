"""``DDPPlugin`` pins the gradient buckets a checkpoint saved into the wrapper a resume builds.

DDP reduces its first iteration in its initial buckets and then rebuilds them in the order the
gradients became ready; a wrapper built for a resume must reduce in the rebuilt ones from its first
iteration on, or gloo's ring all-reduce sums three or more ranks' gradients in another order
(``tests/checkpoint/test_resume_matrix.py`` compares whole runs at 3 and 4 ranks). Here, in one
process with a one-rank gloo group: the layout a trained wrapper saves is the layout the next
wrapper starts in, it stays so after a step, and a checkpoint without a layout changes nothing.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer_core.plugins import CheckpointIO, DDPPlugin
from trainer_core.plugins.ddp import _StepRouter
from trainer_core.plugins.ddp_comm_hooks import BUCKET_LAYOUT_KEY, bucket_layout

pytestmark = pytest.mark.timeout(60)
# About 100 bytes a bucket: the eight parameters below fill several, so their boundaries count too.
_DDP_KWARGS = {"bucket_cap_mb": 0.0001}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Defined in another order than the forward uses them: the gradients become ready out of order.
        self.c = nn.Linear(5, 5)
        self.a = nn.Linear(3, 4)
        self.d = nn.Linear(5, 1)
        self.b = nn.Linear(4, 5)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))).square().mean()


def _trained_wrapper() -> DistributedDataParallel:
    """A wrapper after two iterations: DDP rebuilds its buckets at the start of the second."""
    model = DistributedDataParallel(_StepRouter(Net()), **_DDP_KWARGS)
    for _ in range(2):
        model("training_step", torch.randn(2, 3)).backward()
    assert model._has_rebuilt_buckets
    return model


class HeldIO(CheckpointIO):
    """A checkpoint IO that holds one checkpoint dict in memory (the plugin reads its own key only)."""

    def __init__(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.checkpoint = checkpoint

    def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:
        return self.checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.checkpoint = {}


def _plugin_with(checkpoint: dict[str, Any]) -> DDPPlugin:
    """A plugin that has read ``checkpoint`` (as a resume does, before setup)."""
    plugin = DDPPlugin(checkpoint_io=HeldIO(checkpoint), **_DDP_KWARGS)
    plugin.load_checkpoint("resume.ckpt")
    return plugin


@pytest.fixture(autouse=True)
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``wrap_model`` past its one-process shortcut: the wrapper a resume at any world size builds."""
    monkeypatch.setattr(DDPPlugin, "world_size", property(lambda self: 2))


def plugin_wrap(plugin: DDPPlugin) -> DistributedDataParallel:
    model = plugin.wrap_model(Net())
    assert isinstance(model, DistributedDataParallel)
    return model


def test_the_saved_layout_is_the_resumed_wrappers_first() -> None:
    saved = bucket_layout(_trained_wrapper())
    fresh = bucket_layout(DistributedDataParallel(_StepRouter(Net()), **_DDP_KWARGS))
    assert saved != fresh  # else this test could not fail
    assert len(saved) > 1

    plugin = _plugin_with({"plugin_state": {BUCKET_LAYOUT_KEY: saved}})
    model = plugin_wrap(plugin)
    assert bucket_layout(model) == saved
    # The router names parameters only while DDP is built; afterwards they are the module's own.
    assert next(name for name, _ in model.named_parameters()) == "module.module.c.weight"
    # Already rebuilt: the next iterations keep the layout (DDP rebuilds once), and the plugin saves it.
    for _ in range(2):
        model("training_step", torch.randn(2, 3)).backward()
    plugin._model = model
    assert bucket_layout(model) == saved
    assert plugin.plugin_state_dict()[BUCKET_LAYOUT_KEY] == saved


def test_a_checkpoint_without_a_layout_leaves_ddp_its_own_buckets() -> None:
    fresh = bucket_layout(DistributedDataParallel(_StepRouter(Net()), **_DDP_KWARGS))
    model = plugin_wrap(_plugin_with({"plugin_state": {}}))
    assert bucket_layout(model) == fresh
    assert not getattr(model, "_has_rebuilt_buckets", False)


def test_a_layout_that_does_not_fit_the_model_is_ignored() -> None:
    fresh = bucket_layout(DistributedDataParallel(_StepRouter(Net()), **_DDP_KWARGS))
    model = plugin_wrap(_plugin_with({"plugin_state": {BUCKET_LAYOUT_KEY: [[0, 1], [2]]}}))
    assert bucket_layout(model) == fresh


def test_the_layout_is_used_once() -> None:
    saved = bucket_layout(_trained_wrapper())
    plugin = _plugin_with({"plugin_state": {BUCKET_LAYOUT_KEY: saved}})
    plugin_wrap(plugin)
    fresh = bucket_layout(DistributedDataParallel(_StepRouter(Net()), **_DDP_KWARGS))
    assert bucket_layout(plugin_wrap(plugin)) == fresh
