"""A 2-rank DDP child for tests/core/test_torchmetrics.py: a torchmetrics ``Metric`` logged in validation.

Each rank sees half of the 20 validation samples; the logged ``val_acc`` must be the macro accuracy over
all 20, synced by the metric itself. Rank 0 writes the fit's last ``val_acc``, what ``validate()``
returned, its own half's accuracy, and the final weights (the test recomputes the value in one process).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.functional.classification import multiclass_accuracy

from trainer_core import LightningModule, Trainer, seed_everything

CLASSES = 3
FEATURES = 4


def dataset(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)
    )


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, CLASSES)
        self.val_acc = MulticlassAccuracy(CLASSES, average="macro")
        self.half: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.half.append((logits, y))
        self.val_acc.update(logits, y)
        # sync_dist is ignored for a Metric: the metric syncs its own state in compute().
        self.log("val_acc", self.val_acc, sync_dist=True)

    def on_validation_epoch_start(self) -> None:
        self.half = []

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    trainer = Trainer(
        plugins="ddp",
        devices=2,
        max_epochs=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Net()
    val = DataLoader(dataset(20, seed=2), batch_size=4)
    trainer.fit(model, DataLoader(dataset(16, seed=1), batch_size=4), val)
    fit_val_acc = float(trainer.callback_metrics["val_acc"])
    validated = trainer.validate(model, val, verbose=False)
    if trainer.global_rank == 0:
        logits = torch.cat([h[0] for h in model.half])
        y = torch.cat([h[1] for h in model.half])
        half = float(multiclass_accuracy(logits, y, num_classes=CLASSES, average="macro"))
        out = Path(args.out)
        torch.save(model.net.state_dict(), out.parent / "weights.pt")
        out.write_text(json.dumps({"fit_val_acc": fit_val_acc, "validate": validated, "rank0_half": half}))


if __name__ == "__main__":
    main()
