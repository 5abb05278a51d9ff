"""A 2-rank job for tests/callbacks/test_prediction_writer.py: ``trainer.predict`` under ``"ddp"`` (gloo) with a
prediction writer that writes one file per rank.

Each sample's input holds its own index, and the module predicts ``10 * index``, so the files say
both which samples a rank predicted and whether the prediction belongs to that index.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks.prediction_writer import BasePredictionWriter

SAMPLES = 11  # odd: the ranks get 6 and 5 samples


def dataset() -> TensorDataset:
    index = torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(index)


class TimesTen(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(10.0))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return batch[0].squeeze(1) * self.scale.detach()


class PerRankWriter(BasePredictionWriter):
    """Per batch: ``batch_<rank>_<i>.pt``; at the end: ``epoch_<rank>.pt`` (Lightning's documented use)."""

    def __init__(self, out: Path) -> None:
        super().__init__("batch_and_epoch")
        self.out = out

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        torch.save(
            {"prediction": prediction, "indices": batch_indices, "inputs": batch[0].squeeze(1)},
            self.out / f"batch_{trainer.global_rank}_{batch_idx}.pt",
        )

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        torch.save(
            {"predictions": predictions, "indices": batch_indices},
            self.out / f"epoch_{trainer.global_rank}.pt",
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        plugins="ddp",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[PerRankWriter(out)],
    )
    returned = trainer.predict(
        TimesTen(), DataLoader(dataset(), batch_size=2, shuffle=True), return_predictions=False
    )
    assert returned is None


if __name__ == "__main__":
    main()
