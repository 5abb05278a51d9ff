"""A 2-rank job for tests/core/test_profiler.py: ``SimpleProfiler`` under DDP on gloo, one report per rank.

Each rank trains 4 batches and records one action of its own (``rank<N>_only``) per batch, so a
report that holds another rank's action, or lost its own, shows up.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.plugins import DDPPlugin
from trainer_core.profilers import SimpleProfiler


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with self.trainer.profiler.profile(f"rank{self.global_rank}_only"):
            x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, generator=gen), torch.randn(16, 1, generator=gen))
    trainer = Trainer(
        plugins=DDPPlugin(),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        profiler=SimpleProfiler(dirpath=args.out, filename="perf"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=2))


if __name__ == "__main__":
    main()
