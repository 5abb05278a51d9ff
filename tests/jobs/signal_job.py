"""A training child for tests/reliability/test_signals.py: trains until done, or until a pre-emption signal.

Every rank writes into ``--out``: ``pid.rank<r>`` when training starts, ``ready`` (rank 0) once
``--ready-step`` steps are done (after which each step sleeps ``--slow`` seconds, so a signal sent
then lands mid-training), ``saved.rank<r>.json`` with the step of every checkpoint it took part in,
and, when training ends normally, ``final.rank<r>.pt`` (weights) and ``losses.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint


class Net(LightningModule):
    """Dropout and a shuffled loader: an exact resume must restore the RNGs and the sampler too."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.trainer.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(Callback):
    def __init__(self, out: Path, ready_step: int, slow: float) -> None:
        self.out = out
        self.ready_step = ready_step
        self.slow = slow

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        (self.out / f"pid.rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.ready_step and trainer.global_step >= self.ready_step:
            if trainer.global_step == self.ready_step and trainer.is_global_zero:
                (self.out / "ready").write_text(str(trainer.global_step))
            time.sleep(self.slow)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        path = self.out / f"saved.rank{trainer.global_rank}.json"
        steps = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*steps, trainer.global_step]))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        rank = trainer.global_rank
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            self.out / f"final.rank{rank}.pt",
        )
        (self.out / f"losses.rank{rank}.json").write_text(json.dumps(pl_module.losses))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--ready-step", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--plugin", default=None, help="default: single_device for 1 device, else ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    trainer = Trainer(
        plugins=args.plugin or ("single_device" if args.devices == 1 else "ddp"),
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Record(out, args.ready_step, args.slow),
            # Only the pre-emption checkpoint is written: its step is the one the signal stopped.
            ModelCheckpoint(dirpath=str(out / "ckpts"), save_top_k=0, save_last=False),
        ],
        default_root_dir=str(out),
    )
    trainer.fit(Net(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
