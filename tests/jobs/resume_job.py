"""A small training job used by the resume tests, runnable as a script in a fresh process.

It uses every source of randomness a real run has (shuffled data, dropout, a seeded init) and a
step-wise scheduler, so an inexact resume shows up as a different loss.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback


class ResumeModule(LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Dropout(0.25), nn.ReLU(), nn.Linear(hidden, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataloader(n: int = 100, batch_size: int = 8, shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    ds = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle)


class SaveAt(Callback):
    """Save once, either right after optimizer step ``step`` or at the end of epoch ``epoch``."""

    def __init__(
        self,
        path: str,
        step: Optional[int] = None,
        batch_idx: Optional[int] = None,
        epoch: Optional[int] = None,
        after_validation_step: Optional[int] = None,
    ) -> None:
        self.path, self.step, self.batch_idx, self.epoch = path, step, batch_idx, epoch
        self.after_validation_step = after_validation_step
        self.saved = False

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if (
            not self.saved
            and not trainer.sanity_checking
            and trainer.global_step == self.after_validation_step
        ):
            trainer.save_checkpoint(self.path)
            self.saved = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        hit_step = self.step is not None and trainer.global_step == self.step
        hit_batch = self.batch_idx is not None and trainer.total_batch_idx == self.batch_idx + 1
        if not self.saved and (hit_step or hit_batch):
            trainer.save_checkpoint(self.path)
            self.saved = True

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self.saved and self.epoch is not None and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            self.saved = True


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        max_epochs=3,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    kwargs.update(overrides)
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument(
        "--out", required=True, help="JSON file for the losses; the weights go next to it (.pt)"
    )
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--trainer-kwargs", default="{}", help="JSON of extra Trainer arguments")
    args = parser.parse_args()
    seed_everything(777)  # a different seed: everything must come from the checkpoint
    model = ResumeModule()
    extra = json.loads(args.trainer_kwargs)
    Trainer(**trainer_kwargs(accumulate_grad_batches=args.accumulate, **extra)).fit(
        model, dataloader(), dataloader(shuffle=False), ckpt_path=args.ckpt
    )
    with open(args.out, "w") as f:
        json.dump(model.losses, f)
    torch.save(model.state_dict(), args.out + ".pt")


if __name__ == "__main__":
    main()
