"""A training child for the kill tests: checkpoints every step until it is killed."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint


class Wide(LightningModule):
    """About 4 MB of weights plus Adam state, so a save takes long enough to be interrupted."""

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
        TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)), batch_size=8
    )


def trainer(dirpath: str, max_steps: int) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=dirpath,
                every_n_train_steps=1,
                monitor="step",
                mode="max",
                save_top_k=2,
                save_last=True,
            )
        ],
    )


if __name__ == "__main__":
    seed_everything(0, verbose=False)
    trainer(sys.argv[1], max_steps=100_000).fit(Wide(), loader())
