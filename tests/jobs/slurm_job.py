"""A SLURM job for tests/reliability/test_slurm_requeue.py: trains until done, or until its requeue signal.

The test starts it with SLURM's variables in its environment, as ``sbatch``/``srun`` would, and a fake
``scontrol`` first on the PATH. ``--signal-at-step N`` makes rank ``--signal-rank`` send itself
``--signal`` after step N, the way SLURM signals a job before its time limit. The files it writes into
``--out`` are those of ``signal_job.py`` (its model and recording callback): ``saved.rank<r>.json``
with the step of every checkpoint, and, when training ends, ``final.rank<r>.pt`` and
``losses.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any, Optional

import torch
from signal_job import Net, Record
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint
from trainer_core.plugins.environments import SLURMEnvironment


class SignalSelf(Callback):
    """After step ``step``, rank ``rank`` sends itself ``signum`` (once)."""

    def __init__(self, step: int, rank: int, signum: int) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


def main(argv: Optional[list[str]] = None) -> None:
    """Run the job; ``argv``: its arguments (a test computing a reference in its own process passes them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--signal-at-step", type=int, default=0, help="0: never")
    parser.add_argument("--signal", default="SIGUSR1")
    parser.add_argument("--signal-rank", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.0, help="seconds each step sleeps (several ranks)")
    parser.add_argument(
        "--requeue-signal", default=None, help="pass SLURMEnvironment(requeue_signal=...) in plugins"
    )
    parser.add_argument("--no-auto-requeue", action="store_true")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    plugins: list[Any] = ["single_device" if args.devices == 1 else "ddp"]
    if args.requeue_signal is not None or args.no_auto_requeue:
        plugins.append(
            SLURMEnvironment(auto_requeue=not args.no_auto_requeue, requeue_signal=args.requeue_signal)
        )
    callbacks: list[Callback] = [
        Record(out, 1 if args.slow else 0, args.slow),
        # Only the pre-emption checkpoint is written: its step is the one the signal stopped.
        ModelCheckpoint(dirpath=str(out / "ckpts"), save_top_k=0, save_last=False),
    ]
    if args.signal_at_step:
        callbacks.append(SignalSelf(args.signal_at_step, args.signal_rank, getattr(signal, args.signal)))
    trainer = Trainer(
        plugins=plugins,
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    trainer.fit(Net(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
