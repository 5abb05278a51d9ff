"""What most tests share: a tiny regression module, its random data, and a Trainer that keeps quiet.

Lightning's tests have their ``BoringModel``; this is ours. Every number a test compares bit for bit
depends on the arguments here (the layer sizes, the data's shape and seed, the batch size), so a test
that needs other numbers passes them, and a test whose module does something the test is about (logs,
records the learning rate, sleeps, fails on purpose) keeps that module next to its tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer

#: Trainer arguments that keep a test's run from writing or printing anything it did not ask for.
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def quiet_trainer(**kwargs: Any) -> Trainer:
    """``Trainer(**kwargs)`` with the :data:`QUIET` defaults; a keyword given here overrides them."""
    return Trainer(**{**QUIET, **kwargs})


def fast_trainer(**kwargs: Any) -> Trainer:
    """A :func:`quiet_trainer` for one epoch without the sanity check: the run of most unit tests."""
    return quiet_trainer(**{"max_epochs": 1, "num_sanity_val_steps": 0, **kwargs})


def random_data(n: int, features: int, seed: int = 0) -> TensorDataset:
    """``n`` random inputs of ``features`` values and a random target each.

    Drawn from a generator of their own, so the data is the same whatever the test seeded before, and
    drawing it leaves the global RNG (which decides the initial weights) untouched.
    """
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=gen), torch.randn(n, 1, generator=gen))


def random_loader(n: int, features: int, batch_size: int = 1, seed: int = 0) -> DataLoader:
    """:func:`random_data` in order (no shuffling), ``batch_size`` samples a batch."""
    return DataLoader(random_data(n, features, seed), batch_size=batch_size)


class BoringModel(LightningModule):
    """A regression from ``features`` inputs to one output, trained on the mean squared error.

    ``net`` is ``Linear -> Tanh -> Linear`` through ``hidden`` units. The optimizer is Adam by default
    so that a checkpoint carries optimizer state: a resume that lost it would not continue exactly.
    """

    def __init__(
        self,
        features: int = 4,
        hidden: int = 8,
        optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
        lr: float = 0.01,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.optimizer_class = optimizer
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return self.optimizer_class(self.parameters(), lr=self.lr)
