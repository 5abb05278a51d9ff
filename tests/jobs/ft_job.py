"""One replica group of a fault-tolerant run (``"ddp_ft"``), or the same job under ``"ddp"`` / one process.

Started by ``tests/reliability/test_fault_tolerance.py`` with the replica group in the environment
(``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``), or under torchrun for the
plain-DDP reference. Writes ``<out>/group<N>.json`` (every step's loss, weights digest and wall
time, the plugin's record of the steps) and ``<out>/group<N>.pt`` (the final weights).

Arguments: ``out max_steps [--plugin ddp_ft|ddp|single] [--step-sleep S] [--min-groups K]
[--ckpt-dir D] [--every K] [--resume PATH] [--hang-at STEP] [--batches N] [--lr-decay]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks import Callback, ModelCheckpoint


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Net(LightningModule):
    def __init__(self, step_sleep: float, hang_at: int, group: int, lr_decay: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.step_sleep = step_sleep
        self.hang_at = hang_at
        self.group = group
        self.lr_decay = lr_decay
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append([self.trainer.current_epoch, batch_idx, *index.tolist()])
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if self.hang_at >= 0 and self.trainer.global_step == self.hang_at:
            time.sleep(3600)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        if not self.lr_decay:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(Callback):
    """Every batch's step, loss, weights digest and time; the step also goes to a file the test watches."""

    def __init__(self, progress: Path) -> None:
        self.steps: list[dict] = []
        self.progress = progress

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "batch": batch_idx,
                "loss": float(outputs["loss"]) if outputs else None,
                "digest": digest(module.net),
                "time": time.time(),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "live": float(trainer.callback_metrics.get("ft/live_groups", -1)),
            }
        )
        with open(self.progress, "a") as f:
            f.write(json.dumps([trainer.global_step, trainer.current_epoch, batch_idx]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--plugin", default="ddp_ft")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--min-groups", type=int, default=1)
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--lr-decay", action="store_true")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--quorum-timeout", type=float, default=60.0)
    parser.add_argument("--watchdog", type=float, default=0.0)
    args = parser.parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", os.environ.get("RANK", "0")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    g = torch.Generator().manual_seed(1)
    n = args.batches * 2
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = TensorDataset(x, y, torch.arange(n))
    loader = DataLoader(data, batch_size=2, shuffle=True)

    if args.plugin == "ddp_ft":
        from datetime import timedelta

        from trainer_core.plugins import FaultTolerantDDPPlugin

        plugin = FaultTolerantDDPPlugin(
            min_replica_size=args.min_groups,
            timeout=timedelta(seconds=args.timeout),
            quorum_timeout=timedelta(seconds=args.quorum_timeout),
        )
        devices = 1
    elif args.plugin == "ddp":
        plugin, devices = "ddp", int(os.environ.get("WORLD_SIZE", "1"))
    else:
        plugin, devices = "single_device", 1
    record = Record(out / f"progress{group}.txt")
    callbacks = [record]
    if args.watchdog:
        from trainer_core.callbacks import HangWatchdog

        callbacks.append(HangWatchdog(timeout=args.watchdog))
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_top_k=-1, save_last=True
            )
        )
    trainer = Trainer(
        plugins=plugin,
        devices=devices,
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=True,
    )
    module = Net(args.step_sleep, args.hang_at, group, args.lr_decay)
    trainer.fit(module, loader, ckpt_path=args.resume)
    plugin_obj = trainer.plugin
    with torch.no_grad():
        final_loss = float(nn.functional.mse_loss(module.net(x), y))
    result = {
        "group": group,
        "final_loss": final_loss,
        "global_step": trainer.global_step,
        "steps": record.steps,
        "seen": module.seen,
        "steps_record": getattr(plugin_obj, "steps_record", None),
        "heal_seconds": getattr(plugin_obj, "heal_seconds", None),
        "digest": digest(module.net),
    }
    torch.save(module.net.state_dict(), out / f"group{group}.pt")
    (out / f"group{group}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
