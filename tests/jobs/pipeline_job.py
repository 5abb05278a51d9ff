"""A pipeline-parallel job script for tests/plugins/test_pipeline.py, run the way users run ``plugins="pipeline"``.

Every rank writes ``rank<r>.json`` into ``--out``: the loss the run reported after each step (on
every rank), the learning rate after each step, the validation loss, the stages the rank held and
which of the module's layers it materialised. ``--save-at`` writes checkpoints at those global steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback

LR = 0.01
N_LAYERS = 6
N_SAMPLES = 64
N_VAL = 16


class PipeNet(LightningModule):
    """Six ``Linear(8, 8) + Tanh`` blocks and a head: ``forward`` is a chain of submodules, as a pipeline needs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(N_LAYERS)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    # Used by the single-device run ("pp 1"); the pipeline calls forward and loss_fn instead.
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("test_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data(n: int = N_SAMPLES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


class Record(Callback):
    def __init__(self, out: Path, save_at: list[int]) -> None:
        self.out = out
        self.save_at = save_at
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.steps: list[int] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.steps.append(trainer.global_step)
        if trainer.global_step in self.save_at:
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}.ckpt")

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        plugin = trainer.strategy
        result = {
            "losses": self.losses,
            "lrs": self.lrs,
            "steps": self.steps,
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
            "world_size": trainer.world_size,
            "stage_ids": getattr(plugin, "stage_ids", [0]),
            "parts": len(plugin.model_parts),
            "optimizers_per_part": len(getattr(trainer.optimizers[0], "optimizers", [None])),
            "materialised": sorted(
                name for name, p in pl_module.named_parameters() if p.device.type != "meta"
            ),
        }
        with open(self.out / f"rank{trainer.global_rank}.json", "w") as f:
            json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="pipeline", choices=["pipeline", "single_device"])
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--split", default="layers.3", help="comma-separated split points")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--n-microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--save-at", default="", help="comma-separated global steps to save a checkpoint at")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--sharded", action="store_true", help="DistributedCheckpointIO")
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val (by norm)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--meta-init", action="store_true", help="build the module on the meta device")
    parser.add_argument("--then-evaluate", action="store_true", help="trainer.validate and .test after fit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    seed_everything(0, verbose=False)
    if args.meta_init:
        # No rank allocates the whole model: each materialises only the layers it holds.
        with torch.device("meta"):
            model = PipeNet()
    else:
        model = PipeNet()
    plugins: list[Any]
    if args.plugin == "single_device":
        plugins = ["single_device"]
        devices = 1
    else:
        from trainer_core.plugins import PipelinePlugin

        plugins = [
            PipelinePlugin(
                split_points=[p for p in args.split.split(",") if p],
                schedule=args.schedule,
                n_microbatches=args.n_microbatches,
                data_parallel_size=args.dp,
            )
        ]
        devices = args.devices
    if args.sharded:
        from trainer_core.plugins import DistributedCheckpointIO

        plugins.append(DistributedCheckpointIO())
    save_at = [int(s) for s in args.save_at.split(",") if s]
    trainer = Trainer(
        plugins=plugins,
        devices=devices,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        callbacks=[Record(out, save_at)],
        default_root_dir=str(out / "root"),
    )
    trainer.fit(
        model,
        DataLoader(data(), batch_size=args.batch_size),
        DataLoader(data(N_VAL, seed=1), batch_size=args.batch_size),
        ckpt_path=args.resume,
    )
    if args.then_evaluate:
        val_loader = DataLoader(data(N_VAL, seed=1), batch_size=args.batch_size)
        metrics = {
            "validate": trainer.validate(model, val_loader, verbose=False),
            "test": trainer.test(model, val_loader, verbose=False),
        }
        with open(out / f"evaluate{trainer.global_rank}.json", "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
