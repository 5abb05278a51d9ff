"""A job script for tests/plugins/test_optimizer_in_backward.py: one process, or 2 ranks under FSDP.

It trains ``Net`` (three Linear layers, AdamW with weight decay, a per-step StepLR) on 160 fixed
samples, optionally stepping in backward, optionally saving a checkpoint at ``--save-at`` steps
and resuming from ``--resume``. At the end every rank writes ``rank<r>.json``: its losses (as
``{global_step: loss}``), the learning rates its per-parameter optimizers stepped with, and the
largest number of gradients that existed at once during any backward; global rank 0 writes the
final checkpoint (the plugin's full state) to ``final.ckpt``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, get_lr, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint

N_SAMPLES = 160
LR = 0.02


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N_SAMPLES, 8, generator=g), torch.randn(N_SAMPLES, 1, generator=g))


class Record(Callback):
    """Losses, the learning rate each step ran with, and how many gradients ever existed at once."""

    def __init__(self, final_path: str) -> None:
        self.final_path = final_path
        self.losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}
        self.most_gradients_at_once = 0
        self._handles: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = list(pl_module.parameters())

        def count(_: torch.Tensor) -> None:
            held = sum(p.grad is not None for p in params)
            self.most_gradients_at_once = max(self.most_gradients_at_once, held + 1)

        # A tensor hook fires when a parameter's gradient is computed, before it lands in ``.grad``.
        self._handles = [p.register_hook(count) for p in params]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self.losses[step] = float(outputs["loss"])
        stepped = trainer.plugin.in_backward_optimizer
        # What the parameters stepped with: the per-parameter optimizers, or the one optimizer.
        self.lrs[step] = get_lr(stepped) if stepped is not None else self.lr_before_step

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.lr_before_step = get_lr(pl_module.optimizers())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        trainer.save_checkpoint(self.final_path)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the job; returns what it writes to ``rank<r>.json`` (tests call it in-process too)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="single_device")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--in-backward", action="store_true")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    record = Record(str(out / "final.ckpt"))
    callbacks: list[Callback] = [record]
    if args.save_at:
        callbacks.append(
            ModelCheckpoint(dirpath=str(out / "ckpts"), every_n_train_steps=args.save_at, save_top_k=-1)
        )
    trainer = Trainer(
        plugins=[args.plugin],
        devices=args.devices,
        max_steps=args.max_steps,
        optimizer_in_backward=args.in_backward,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.save_at),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    model = Net()
    trainer.fit(model, DataLoader(data(), batch_size=args.batch_size), ckpt_path=args.resume)
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = {
        "losses": record.losses,
        "lrs": record.lrs,
        "most_gradients_at_once": record.most_gradients_at_once,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
