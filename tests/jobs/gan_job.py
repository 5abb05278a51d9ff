"""A GAN-style job: manual optimization with two optimizers and two schedulers, run as a script.

Each rank writes its losses and final weights; ``--save-at`` writes a checkpoint after that many
batches, ``--resume`` continues from one.
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


class TinyGAN(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.losses: list[list[float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        noise = torch.randn(real.shape[0], 4)
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_d)
        fake = self.generator(noise).detach()
        d_loss = bce(self.discriminator(real), torch.ones(len(real), 1)) + bce(
            self.discriminator(fake), torch.zeros(len(real), 1)
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self.generator(noise)), torch.ones(len(real), 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        sched_g.step()
        sched_d.step()
        self.losses.append([d_loss.item(), g_loss.item()])

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=1e-2, momentum=0.9)
        return [opt_g, opt_d], [
            torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.8),
            torch.optim.lr_scheduler.LambdaLR(opt_d, lambda step: 1.0 / (1.0 + 0.1 * step)),
        ]


class SaveAfterBatches(Callback):
    def __init__(self, path: str, batches: int) -> None:
        self.path, self.batches = path, batches

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.total_batch_idx == self.batches:
            trainer.save_checkpoint(self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="single_device")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seed_everything(0 if args.resume is None else 123, verbose=False)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(96, 8, generator=g) * 0.5 + 1.0)
    callbacks = [SaveAfterBatches(os.path.join(args.out, "stop.ckpt"), args.save_at)] if args.save_at else []
    plugin: Any = args.plugin
    if args.plugin in ("ddp", "zero"):
        from trainer_core.plugins import DDPPlugin, ZeroPlugin

        # Each optimizer's step leaves the other model's parameters without gradients.
        plugin = (DDPPlugin if args.plugin == "ddp" else ZeroPlugin)(find_unused_parameters=True)
    trainer = Trainer(
        plugins=plugin,
        devices=args.devices,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = TinyGAN()
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)
    rank = trainer.global_rank
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": model.losses, "global_step": trainer.global_step}, f)
    torch.save(model.state_dict(), os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
