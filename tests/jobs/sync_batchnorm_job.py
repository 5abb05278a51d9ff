"""A 2-rank job for tests/core/test_trainer_args.py: ``Trainer(sync_batchnorm=...)`` under DDP on gloo.

A small network with a BatchNorm layer trains 4 steps on 4 samples per rank (8 per step together),
once with ``sync_batchnorm=True`` and once without, in the same processes; rank 0 writes its weights
and running statistics to ``<out>/sync.pt`` and ``<out>/plain.pt``, with the class names its
BatchNorm layer had during training and after ``fit``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.plugins import DDPPlugin, FSDPPlugin

FEATURES = 3
SAMPLES = 32
BATCH_PER_RANK = 4


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    # Each sample shifted differently, so that the two halves of a batch have different statistics.
    x = torch.randn(SAMPLES, FEATURES, generator=gen) * 2 + torch.arange(SAMPLES).unsqueeze(1) * 0.1
    return TensorDataset(x, torch.randn(SAMPLES, 1, generator=gen))


class BatchNormNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
        self.layer_during_training = ""

    def on_train_start(self) -> None:
        self.layer_during_training = type(self.net[1]).__name__

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(out: Path, sync: bool, plugin: str) -> None:
    seed_everything(0)
    model = BatchNormNet()
    trainer = Trainer(
        plugins=FSDPPlugin() if plugin == "fsdp" else DDPPlugin(),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        sync_batchnorm=sync,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data(), batch_size=BATCH_PER_RANK))
    # FSDP leaves the parameters sharded: every rank takes part in gathering them.
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "state": state,
                "layer_during_training": model.layer_during_training,
                "layer_after_fit": type(model.net[1]).__name__,
                "global_step": trainer.global_step,
            },
            out / ("sync.pt" if sync else "plain.pt"),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="ddp", choices=("ddp", "fsdp"))
    args = parser.parse_args()
    out = Path(args.out)
    run(out, sync=True, plugin=args.plugin)
    run(out, sync=False, plugin=args.plugin)


if __name__ == "__main__":
    main()
