"""A job script for tests/plugins/test_pipeline_split.py: modules whose forward is not a plain chain of submodules.

Run the way users run ``plugins="pipeline"`` (rank 0 is this process; the Trainer starts rank 1).
Every rank writes ``rank<r>.json`` into ``--out``: the loss reported after each step and the stages
it held; rank 0 also writes ``final.ckpt`` (the whole module, gathered under its original names).
``run(...)`` also trains in the calling process, which is how the tests get the single-device run.
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
from trainer_core.callbacks import Callback
from trainer_core.errors import MisconfigurationException

LR = 0.05
N_SAMPLES = 32
BATCH_SIZE = 8
WIDTH = 8


class SplitNet(LightningModule):
    """Four ``Linear`` layers and a head; subclasses differ only in what ``forward`` does between them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        self.head = nn.Linear(WIDTH, 1)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    # Used by the single-device run; the pipeline calls forward and loss_fn instead.
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class TanhNet(SplitNet):
    """The forward of issue 13: a functional activation between the split submodules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class ResidualNet(SplitNet):
    """A residual connection around every layer, and a skip from the first layer's output to the head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        first = x
        for layer in self.layers[1:]:
            x = x + torch.tanh(layer(x))
        return self.head(x * first)


class SharedNet(SplitNet):
    """``layers.1`` runs twice, back to back: tied weights inside one stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = torch.tanh(self.layers[1](x))
        x = torch.tanh(self.layers[1](x))
        for layer in self.layers[2:]:
            x = torch.tanh(layer(x))
        return self.head(x)


class SharedAcrossStagesNet(SplitNet):
    """``layers.0`` runs at the start and again before the head: with a split between, two stages use it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return self.head(torch.tanh(self.layers[0](x)))


class BranchNet(SplitNet):
    """Control flow on tensor values, which the tracer cannot capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.sum() > 0:
                x = torch.tanh(x)
        return self.head(x)


class BatchNormNet(SplitNet):
    """Batch norm between layers: batch statistics (and updated running ones) in training, running ones in evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = torch.tanh(self.norm(self.layers[1](x)))
        for layer in self.layers[2:]:
            x = torch.tanh(layer(x))
        return self.head(x)


class ManualChainNet(SplitNet):
    """A chain of submodules that declares its stages itself: nothing is traced."""

    pipeline_manual_split = True

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


MODELS = {
    cls.__name__: cls
    for cls in (
        TanhNet,
        ResidualNet,
        SharedNet,
        SharedAcrossStagesNet,
        BranchNet,
        BatchNormNet,
        ManualChainNet,
    )
}


def data(n: int = N_SAMPLES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, 1, generator=g))


class Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.out / "final.ckpt")
        plugin = trainer.strategy
        record = {
            "losses": self.losses,
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
            "stage_ids": getattr(plugin, "stage_ids", [0]),
            "part_parameters": [[n for n, _ in part.named_parameters()] for part in plugin.model_parts],
            "part_buffers": [[n for n, _ in part.named_buffers()] for part in plugin.model_parts],
            # The manual split stands nn.Identity in for the layers a stage lacks; the traced one has none.
            "identity_layers": [
                [n for n, m in part.named_modules() if isinstance(m, nn.Identity)]
                for part in plugin.model_parts
            ],
        }
        with open(self.out / f"rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


def run(
    out: Path,
    model: str,
    plugin: str = "pipeline",
    split: Optional[list[str]] = None,
    schedule: str = "1F1B",
    n_microbatches: int = 4,
    max_steps: int = 4,
) -> LightningModule:
    """Train ``model`` under ``plugin``; every rank writes its record into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0, verbose=False)
    module = MODELS[model]()
    if plugin == "pipeline":
        from trainer_core.plugins import PipelinePlugin

        plugins: Any = [
            PipelinePlugin(split_points=split or [], schedule=schedule, n_microbatches=n_microbatches)
        ]
        devices = 2
    else:
        plugins, devices = ["single_device"], 1
    trainer = Trainer(
        plugins=plugins,
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Record(out)],
        default_root_dir=str(out / "root"),
    )
    trainer.fit(
        module,
        DataLoader(data(), batch_size=BATCH_SIZE),
        DataLoader(data(BATCH_SIZE, seed=1), batch_size=BATCH_SIZE),
    )
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--plugin", default="pipeline", choices=["pipeline", "single_device"])
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--split", default="layers.2", help="comma-separated split points")
    parser.add_argument("--n-microbatches", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    try:
        run(
            out,
            args.model,
            args.plugin,
            [p for p in args.split.split(",") if p],
            args.schedule,
            args.n_microbatches,
            args.max_steps,
        )
    except MisconfigurationException as err:
        # Each rank leaves its own refusal: a rank the launcher ends first may print nothing.
        out.mkdir(parents=True, exist_ok=True)
        (out / f"refused.rank{os.environ.get('RANK', os.environ.get('LOCAL_RANK', '0'))}.txt").write_text(
            str(err)
        )
        raise


if __name__ == "__main__":
    main()
