"""A data-parallel training job run as a script (the way users run ``plugins="ddp"``).

Rank 0 writes what the tests compare: its losses, the final weights, the ranks it saw.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback


class Net(LightningModule):
    def __init__(self, fail_on_rank: int = -1) -> None:
        super().__init__()
        self.fail_on_rank = fail_on_rank
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.fail_on_rank and batch_idx == 2:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Ranks(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.seen = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "train_batches": trainer.num_training_batches,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
        }


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--fail-on-rank", type=int, default=-1)
    args = parser.parse_args()
    seed_everything(0, verbose=False)
    model = Net(fail_on_rank=args.fail_on_rank)
    ranks = Ranks()
    trainer = Trainer(
        plugins=args.plugin,
        devices=args.devices,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=args.accumulate,
        callbacks=[ranks],
    )
    trainer.fit(model, DataLoader(data(), batch_size=args.batch_size), DataLoader(data(32), batch_size=8))
    if trainer.is_global_zero:
        result = {
            "losses": model.losses,
            "ranks": ranks.seen,
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "pid": os.getpid(),
        }
        torch.save(model.state_dict(), args.out + ".pt")
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
