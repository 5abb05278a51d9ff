"""``Trainer.init_module``: where and in which dtype a module's tensors are created.

On one device the module is created on the process's device in the precision's dtype. With
``empty_init=True`` a sharding plugin creates it on the meta device (no memory), shards it, and only
then gives each rank memory for its own shards, initialised by each layer's ``reset_parameters``: the
weights must be the ones an ordinary build draws from the same random state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from boring import BoringModel, quiet_trainer, random_loader
from torch import nn

from trainer_core.callbacks import Callback
from trainer_core.plugins import FSDPPlugin

#: The seed the materialised layers draw from (set just before the plugin's setup).
INIT_SEED = 7


@pytest.fixture(autouse=True)
def _in_process_runs(no_process_group_left_behind: None) -> None:
    """The FSDP runs below start a one-rank process group in this process."""


def test_init_module_builds_on_the_device_in_the_precision_dtype() -> None:
    trainer = quiet_trainer(max_steps=1, precision="bf16-true")
    default = torch.get_default_dtype()
    with trainer.init_module():
        model = BoringModel(features=4)
    assert torch.get_default_dtype() == default  # restored on the way out
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    with quiet_trainer(max_steps=1).init_module():
        model = BoringModel(features=4)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


class _SeedBeforeSetup(Callback):
    """Seeds the global generator in ``setup``, which runs just before the plugin materialises the module;
    records the weights the run starts with."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        torch.manual_seed(INIT_SEED)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in pl_module.named_parameters()
        }


def test_empty_init_under_fsdp_materialises_the_weights_an_ordinary_build_draws() -> None:
    trainer = quiet_trainer(max_steps=2, plugins=FSDPPlugin(), callbacks=[_SeedBeforeSetup()])
    with trainer.init_module(empty_init=True):
        model = BoringModel(features=4)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    trainer.fit(model, random_loader(8, 4, batch_size=4))
    start = trainer.callbacks[0].start
    torch.manual_seed(INIT_SEED)
    expected = dict(BoringModel(features=4).named_parameters())
    assert set(start) == set(expected)
    for name, value in start.items():
        assert torch.equal(value, expected[name]), name
    assert not any(p.is_meta for p in model.parameters())
    # It trained: the weights moved from where they started.
    final = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in model.named_parameters()}
    assert any(not torch.equal(final[n], start[n]) for n in start)


class _RawScale(nn.Module):
    """A layer with a parameter and no ``reset_parameters``: nothing can initialise it after meta."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _WithRawScale(BoringModel):
    def __init__(self) -> None:
        super().__init__(features=4)
        self.raw = _RawScale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.raw(super().forward(x))


def test_empty_init_names_the_layers_it_cannot_initialise() -> None:
    trainer = quiet_trainer(max_steps=1, plugins=FSDPPlugin())
    with trainer.init_module(empty_init=True):
        model = _WithRawScale()
    with pytest.warns(
        UserWarning, match=r"no reset_parameters.*uninitialised: raw\. Give them reset_parameters"
    ):
        trainer.fit(model, random_loader(8, 4, batch_size=4))
