"""A training child for the kill tests: checkpoints every step until it is killed.

``run_child(folder, kind, max_steps)`` is what the killed process runs; ``kind`` picks the
checkpoint IO: ``"monolithic"`` (one ``torch.save`` file, atomic rename), ``"sharded"``
(``DistributedCheckpointIO``: a DCP folder swapped in whole) or ``"async"`` (``AsyncCheckpointIO``:
the write happens on a background thread while training goes on). Run as a script it trains
"for ever" with monolithic saves (the original kill test's child).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint

SAVE_KINDS = ("monolithic", "sharded", "async")


class Wide(LightningModule):
    """About 1 MB of weights plus Adam state, so a save takes long enough to be interrupted."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)),
        batch_size=8,
        shuffle=True,
    )


def checkpoint_io(kind: str) -> Any:
    from trainer_core.plugins.io import AsyncCheckpointIO, DistributedCheckpointIO, TorchCheckpointIO

    if kind == "monolithic":
        return TorchCheckpointIO()
    if kind == "sharded":
        return DistributedCheckpointIO()
    if kind == "async":
        return AsyncCheckpointIO()
    raise ValueError(f"unknown save kind {kind!r}; use one of {SAVE_KINDS}")


def trainer(
    dirpath: Optional[str], max_steps: int, kind: str = "monolithic", every_n_train_steps: int = 1
) -> Trainer:
    callbacks = []
    if dirpath is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=dirpath,
                every_n_train_steps=every_n_train_steps,
                monitor="step",
                mode="max",
                save_top_k=2,
                save_last=True,
            )
        )
    return Trainer(
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=dirpath is not None,
        plugins=[checkpoint_io(kind)],
        callbacks=callbacks,
    )


def run_child(folder: str, kind: str, max_steps: int) -> None:
    """The killed process's whole life: train ``max_steps`` steps, saving after every one."""
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    trainer(folder, max_steps, kind).fit(Wide(), loader())
    os._exit(0)  # skip interpreter teardown: the parent only cares whether it was killed


def final_weights(max_steps: int) -> dict[str, torch.Tensor]:
    """The weights of a run that is never interrupted (and never saves)."""
    seed_everything(0, verbose=False)
    model = Wide()
    trainer(None, max_steps).fit(model, loader())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    trainer(sys.argv[1], max_steps=100_000).fit(Wide(), loader())
