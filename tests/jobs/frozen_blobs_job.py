"""A LoRA-like run with FrozenBlobCheckpointIO, runnable as a script (2 DDP ranks) and imported by the tests.

Run as a script it trains on ``--devices`` ranks under DDP with ``ModelCheckpoint(save_top_k=2)``,
resumes from the mid-run checkpoint in the same folder, and writes what each rank saw to
``<out>/rank<r>.json``: whether the resumed weights equal the uninterrupted run's bit for bit, and the
blobs in the store.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint

FEATURES = 32


class LoRAModule(LightningModule):
    """A frozen two-layer base; a rank-2 adapter ``up(down(x))`` added to the first layer's output trains."""

    def __init__(self, features: int = FEATURES, rank: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.base = nn.Sequential(nn.Linear(features, features), nn.Tanh(), nn.Linear(features, 1))
        self.base.requires_grad_(False)
        self.down = nn.Linear(features, rank, bias=False)
        self.up = nn.Linear(rank, features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.base[1](self.base[0](x) + self.up(self.down(x)))
        return self.base[2](hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.05)


def loader(n: int = 64, batch_size: int = 4) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, FEATURES, generator=gen), torch.randn(n, 1, generator=gen))
    return DataLoader(data, batch_size=batch_size)


def fit(
    folder: Path,
    io: Any,
    max_steps: int,
    ckpt_path: Optional[str] = None,
    every: int = 2,
    **trainer_kwargs: Any,
) -> tuple[Trainer, LoRAModule]:
    """Train from a seeded start, saving every ``every`` steps into ``folder`` (the newest two kept)."""
    seed_everything(7)
    model = LoRAModule()
    callback = ModelCheckpoint(
        dirpath=str(folder), monitor="step", mode="max", save_top_k=2, every_n_train_steps=every
    )
    plugins = [p for p in (trainer_kwargs.pop("plugin", None), io) if p is not None]
    trainer = Trainer(
        max_epochs=-1,
        max_steps=max_steps,
        callbacks=[callback],
        plugins=plugins or None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model


def main() -> None:
    from trainer_core.plugins.io.frozen_io import FrozenBlobCheckpointIO

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    folder = out / "run"
    trainer, whole = fit(folder, FrozenBlobCheckpointIO(), 12, plugin="ddp", devices=args.devices)
    kept = sorted(p.name for p in folder.glob("*.ckpt"))
    trainer.plugin.barrier("listed")
    resumed_trainer, resumed = fit(
        folder,
        FrozenBlobCheckpointIO(),
        12,
        ckpt_path=str(folder / kept[0]),
        plugin="ddp",
        devices=args.devices,
    )
    exact = all(
        torch.equal(a, b)
        for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True)
    )
    blobs = sorted(p for p in os.listdir(folder / "blobs") if len(p) == 64)
    seen = {"exact": exact, "kept": kept, "blobs": blobs, "global_step": resumed_trainer.global_step}
    (out / f"rank{resumed_trainer.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
