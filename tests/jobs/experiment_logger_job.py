"""A 2-rank DDP child for tests/loggers/test_mlflow.py and test_wandb.py: an experiment logger on every rank.

Each rank logs ``rank_tag = 100 * rank + step``, not synchronised, so a value from any rank but 0 in the
run shows that another rank wrote; the run must be made once, by rank 0.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything


class Net(LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("rank_tag", float(100 * self.global_rank + self.trainer.global_step))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mlflow", help="tracking URI: log with MLFlowLogger(experiment_name='ddp')")
    parser.add_argument("--wandb", help="folder: log with WandbLogger(offline=True, save_dir=...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    if args.mlflow:
        from trainer_core.loggers.mlflow import MLFlowLogger

        logger: Any = MLFlowLogger(experiment_name="ddp", tracking_uri=args.mlflow)
    else:
        from trainer_core.loggers.wandb import WandbLogger

        logger = WandbLogger(offline=True, save_dir=args.wandb, project="ddp")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer = Trainer(
        plugins="ddp",
        devices=2,
        max_epochs=1,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
