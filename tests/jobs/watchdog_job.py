"""A training child for tests/reliability/test_watchdog.py: one rank hangs, the HangWatchdog must end the job.

``python watchdog_job.py --out DIR --devices 2 --hang-rank 1 --hang-batch 3 --timeout 3`` trains a tiny
module under ``plugins="ddp"`` (gloo) with a :class:`HangWatchdog`; at batch ``--hang-batch`` rank
``--hang-rank`` sleeps forever inside ``training_step`` (``--hang-in step``; ``gil``: in C code that
holds the GIL) or inside the checkpoint write (``--hang-in save``: the batch's checkpoint), while the other ranks wait for it in the
gradient all-reduce or the save's barrier. The collective timeout is ``--ddp-timeout`` (long), so
only the watchdog can end the job early.

Every rank writes into ``--out``: ``pid.rank<r>`` when training starts, and the hanging rank
``fault.time`` (``time.time()``) when it starts to hang.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks.hang_watchdog import HangWatchdog
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.plugins.io import TorchCheckpointIO


def hang_forever(out: Path) -> None:
    """The hanging rank's last act: say when, then sleep in a frame the stack dump must show."""
    (out / "fault.time").write_text(repr(time.time()))
    while True:
        time.sleep(3600)


def hang_holding_the_gil(out: Path) -> None:
    """Sleep in C without releasing the GIL (``PyDLL`` keeps it): no Python thread of this process runs again."""
    time.sleep(1.5)  # long enough for the watchdog thread to have seen this step: it will not see it again
    (out / "fault.time").write_text(repr(time.time()))
    ctypes.PyDLL(None).sleep(3600)


class Net(LightningModule):
    def __init__(self, out: Path, hang_rank: int, hang_batch: int, hang_in: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out = out
        self.hang_rank = hang_rank
        self.hang_batch = hang_batch
        self.hang_in = hang_in

    def on_train_start(self) -> None:
        (self.out / f"pid.rank{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.hang_rank and batch_idx == self.hang_batch:
            if self.hang_in == "step":
                hang_forever(self.out)
            elif self.hang_in == "gil":
                hang_holding_the_gil(self.out)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class HangingIO(TorchCheckpointIO):
    """Writes normally, except on the hanging rank at the hanging step's checkpoint."""

    def __init__(self, out: Path, hang_rank: int, hang_step: int) -> None:
        super().__init__()
        self.out = out
        self.hang_rank = hang_rank
        self.hang_step = hang_step

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        if (
            int(os.environ.get("LOCAL_RANK", "0")) == self.hang_rank
            and checkpoint["global_step"] == self.hang_step
        ):
            hang_forever(self.out)
        super().save_checkpoint(checkpoint, path, storage_options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hang-rank", type=int, default=1)
    parser.add_argument("--hang-batch", type=int, default=3)
    parser.add_argument("--hang-in", choices=("step", "save", "gil"), default="step")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--checkpoint-timeout", type=float, default=4.0)
    parser.add_argument("--ddp-timeout", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    # The first optimizer imports torch._dynamo, seconds on a loaded 2-core machine: not inside the
    # setup the tests give a short checkpoint_timeout.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    plugins: list[Any] = []
    callbacks: list[Any] = [HangWatchdog(timeout=args.timeout, checkpoint_timeout=args.checkpoint_timeout)]
    if args.devices > 1:
        from trainer_core.plugins import DDPPlugin

        plugins.append(DDPPlugin(timeout=timedelta(seconds=args.ddp_timeout)))
    if args.hang_in == "save":
        # The checkpoint of step hang_batch + 1 (written after that batch) hangs on the hanging rank.
        plugins.append(HangingIO(out, args.hang_rank, args.hang_batch + 1))
        callbacks.append(ModelCheckpoint(dirpath=str(out / "ckpts"), every_n_train_steps=1, save_top_k=-1))
    trainer = Trainer(
        plugins=plugins,
        devices=args.devices,
        max_steps=50,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.hang_in == "save",
        callbacks=callbacks,
    )
    trainer.fit(Net(out, args.hang_rank, args.hang_batch, args.hang_in), DataLoader(data, batch_size=4))
    (out / f"finished.rank{trainer.global_rank}").write_text("")


if __name__ == "__main__":
    main()
