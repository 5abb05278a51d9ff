"""A 2-rank job for tests/callbacks/test_callbacks_distributed.py: the built-in callbacks under real gloo ranks.

One run uses EarlyStopping on a metric each rank sees differently (not synced), ModelCheckpoint
with sharded (folder) checkpoints and ``save_last="link"``, LearningRateMonitor with a CSV logger,
and GradientAccumulationScheduler. Every rank writes ``rank<r>.json`` into ``--out`` with what it
saw at the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import (
    Callback,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    Timer,
)
from trainer_core.loggers import CSVLogger
from trainer_core.plugins import FSDPPlugin

# Per epoch: the synced score ModelCheckpoint ranks by (identical on both ranks).
VAL_SCORES = [0.5, 0.3, 0.4, 0.2, 0.6, 0.6]
# Per rank and epoch: what EarlyStopping watches. Rank 0 keeps improving; rank 1 stops improving
# after epoch 1, so with patience=2 it wants to stop at epoch 3 and rank 0 never would.
RANK_SCORES = {0: [5.0, 4.0, 3.0, 2.0, 1.0, 0.5], 1: [5.0, 4.0, 4.5, 4.2, 4.1, 4.0]}


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.steps_per_epoch: dict[int, int] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        epoch = self.current_epoch
        self.log("val_score", VAL_SCORES[epoch], sync_dist=True)
        # Deliberately not synced: each rank sees its own value.
        self.log("rank_score", RANK_SCORES[self.global_rank][epoch])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class Record(Callback):
    def __init__(self) -> None:
        self.steps_at_epoch_end: list[int] = []
        self.accumulate: list[int] = []

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.steps_at_epoch_end.append(trainer.global_step)
        self.accumulate.append(trainer.accumulate_grad_batches)


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


class SlowModel(Model):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        return super().training_step(batch, batch_idx)


class StartLate(Callback):
    """Rank 0 starts its clock DELAY seconds after rank 1 (the ranks then run in lockstep)."""

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            time.sleep(DELAY)


STEP_SECONDS = 0.02
DELAY = 0.5
DURATION = 0.9


def timer_run(out: Path) -> None:
    """Timer under DDP: rank 1's clock is DELAY ahead; both ranks must stop at the same step."""
    from trainer_core.callbacks import RichProgressBar

    rank = int(os.environ.get("LOCAL_RANK", 0))
    bar_file = open(out / f"bar.rank{rank}.txt", "w")
    timer = Timer(duration=timedelta(seconds=DURATION))
    trainer = Trainer(
        plugins="ddp",
        devices=2,
        max_epochs=100,
        logger=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=[
            RichProgressBar(console_kwargs={"file": bar_file, "force_terminal": True, "width": 120}),
            StartLate(),
            timer,
            ModelCheckpoint(dirpath=str(out / "ckpts"), save_last=True),
        ],
    )
    trainer.fit(SlowModel(), DataLoader(data(), batch_size=4), DataLoader(data(8), batch_size=4))
    bar_file.close()
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "elapsed": timer.time_elapsed("train"),
    }
    with open(out / f"timer.rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--timer", action="store_true", help="the Timer run instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0, verbose=False)
    if args.timer:
        timer_run(out)
        return
    early = EarlyStopping(monitor="rank_score", patience=2, mode="min")
    checkpoint = ModelCheckpoint(
        dirpath=str(out / "ckpts"), monitor="val_score", save_top_k=2, save_last="link"
    )
    lr_monitor = LearningRateMonitor(logging_interval="epoch")
    record = Record()
    trainer = Trainer(
        plugins=[FSDPPlugin(state_dict_type="sharded")],
        devices=2,
        max_epochs=args.max_epochs,
        logger=CSVLogger(save_dir=str(out / "logs"), name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=[early, lr_monitor, GradientAccumulationScheduler({1: 2}), record, checkpoint],
    )
    model = Model()
    trainer.fit(
        model, DataLoader(data(), batch_size=4), DataLoader(data(8), batch_size=4), ckpt_path=args.resume
    )
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "stopped_epoch": early.stopped_epoch,
        "wait_count": early.wait_count,
        "steps_at_epoch_end": record.steps_at_epoch_end,
        "accumulate": record.accumulate,
        "lrs": lr_monitor.lrs,
        "best_model_path": checkpoint.best_model_path,
        "best_k_models": {k: float(v) for k, v in checkpoint.best_k_models.items()},
        "last_model_path": checkpoint.last_model_path,
        "ckpt_path": trainer.ckpt_path,
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
