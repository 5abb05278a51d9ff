"""The module of tests/checkpoint/test_lightning_checkpoint.py, and a job that resumes a Lightning checkpoint on 2 ranks.

``Steps`` is the whole of a small Lightning program: the same code is a PyTorch Lightning module
(``class LitNet(Steps, pytorch_lightning.LightningModule)``, in the test) and a trainer-core one
(:class:`CoreNet`), as a project moving over changes only its imports.

Run as a script it resumes ``--ckpt`` under ``--plugin`` on 2 ranks, every rank reading the same
batches (no distributed sampler): the averaged gradient is then each rank's own, bit for bit, and
the run must end on the weights of the one-process Lightning run that wrote the checkpoint and
went on. Each rank writes ``rank<r>.pt`` (weights, global step, epoch) into ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer

#: 10 training samples in batches of 2: 5 batches an epoch.
SAMPLES, BATCH_SIZE, FEATURES = 10, 2, 4


class Steps:
    """The steps of the program; ``optim`` picks Adam with StepLR, or SGD with momentum over two groups."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, optim: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        # (epoch, batch_idx) of every training batch: which batches a resumed run trained on.
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((int(self.current_epoch), batch_idx))
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        if self.hparams.optim == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
        # The output layer's group first: the optimizer's parameter order is not the module's.
        opt = torch.optim.SGD(
            [
                {"params": self.net[2].parameters(), "lr": 0.02},
                {"params": self.net[0].parameters()},
            ],
            lr=self.hparams.lr,
            momentum=0.9,
        )
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class CoreNet(Steps, LightningModule):
    pass


def data(seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=gen), torch.randn(SAMPLES, 1, generator=gen)
    )


def train_loader() -> DataLoader:
    return DataLoader(data(), batch_size=BATCH_SIZE)


def val_loader() -> DataLoader:
    return DataLoader(data(seed=1), batch_size=BATCH_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="ddp")
    parser.add_argument("--max-steps", type=int, required=True)
    args = parser.parse_args()
    trainer = Trainer(
        plugins=args.plugin,
        devices=2,
        max_steps=args.max_steps,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = CoreNet()
    trainer.fit(model, train_loader(), val_loader(), ckpt_path=args.ckpt)
    weights = {}
    for name, tensor in model.state_dict().items():
        weights[name] = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()
    record = {
        "weights": weights,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "seen": model.seen,
    }
    torch.save(record, Path(args.out) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
