"""A 2-rank job for tests/callbacks/test_straggler.py: StragglerMonitor under real gloo ranks (``plugins="ddp"``).

One epoch of 20 optimizer steps, compared every 5, by two monitors: the default one (the time
between batches; it logs and warns) and one with ``time_forward=True`` (it only records). Every
rank's ``training_step`` sleeps BASE_S. Rank 1 is the straggler for the first DELAYED_STEPS steps:
it sleeps EXTRA_S more while loading each of the first 5 batches (between batches), while
``training_step`` logs with ``sync_dist=True`` (an all-reduce in the forward); then it sleeps
EXTRA_S more in ``training_step`` of the next 5 steps (the forward), which logs nothing; afterwards
nobody does. Validation runs after step 10 and at the end; rank 0 sleeps VALIDATION_S in it, which
must not make rank 0 look slow. Rank 0 logs to a CSV logger in ``--out``; every rank writes
``rank<r>.json`` with the hosts, the per-window times each monitor saw, and whether the training
loop calls the default monitor's ``on_before_backward``.

    python tests/jobs/straggler_job.py --out OUT [--plugin fsdp]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.straggler import StragglerMonitor, summarize
from trainer_core.loggers import CSVLogger

STEPS = 20
EVERY_N_STEPS = 5
FACTOR = 2.0
BASE_S = 0.02
EXTRA_S = 0.06
DELAYED_STEPS = 10
VALIDATION_S = 0.2


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(BASE_S)
        if self.global_rank == 1 and DELAYED_STEPS // 2 <= self.global_step < DELAYED_STEPS:
            time.sleep(EXTRA_S)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step < DELAYED_STEPS // 2:
            self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 0:
            time.sleep(VALIDATION_S)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RecordingOnly(StragglerMonitor):
    """A second monitor that neither logs nor warns (the first one's metrics keep their names)."""

    def report(self, trainer: Trainer, times: list[float]) -> None:
        self.summary = summarize(times, self.factor)


class RecordWindows(Callback):
    """After a monitor's comparison (it runs first), what it saw in each window."""

    def __init__(self, monitor: StragglerMonitor) -> None:
        self.monitor = monitor
        self.windows: list[list[float]] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % EVERY_N_STEPS == 0:
            self.windows.append(list(self.monitor.rank_times))


class SlowFirstBatches:
    """A collate function: on rank 1, the first DELAYED_STEPS // 2 batches take EXTRA_S more to load."""

    def __init__(self) -> None:
        self.loaded = 0

    def __call__(self, samples: list[Any]) -> Any:
        if torch.distributed.get_rank() == 1 and self.loaded < DELAYED_STEPS // 2:
            time.sleep(EXTRA_S)
        self.loaded += 1
        return default_collate(samples)


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="ddp", help="a registered plugin name (ddp, fsdp, ...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0, verbose=False)
    # The planted delay is 60 ms; 10 ms keeps a sub-millisecond wobble of a loaded machine (1.9 ms against a
    # 0.6 ms median, seen in make test) from naming rank 1 a second time after it recovered.
    monitor = StragglerMonitor(every_n_steps=EVERY_N_STEPS, factor=FACTOR, min_delay=0.01)
    forward = RecordingOnly(every_n_steps=EVERY_N_STEPS, factor=FACTOR, time_forward=True)
    records = [RecordWindows(monitor), RecordWindows(forward)]
    trainer = Trainer(
        plugins=args.plugin,
        devices=2,
        max_epochs=1,
        logger=CSVLogger(save_dir=str(out / "logs"), name="run"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        val_check_interval=DELAYED_STEPS,
        limit_val_batches=1,
        callbacks=[monitor, forward, *records],
    )
    # 2 samples a batch, STEPS batches per rank: one epoch is the whole run.
    train = DataLoader(data(4 * STEPS), batch_size=2, collate_fn=SlowFirstBatches())
    trainer.fit(Model(), train, DataLoader(data(4), batch_size=2))
    before_backward = trainer.hook_runner.batch.on_before_backward
    result = {
        "rank": trainer.global_rank,
        "hosts": monitor.hosts,
        "windows": records[0].windows,
        "forward_windows": records[1].windows,
        "default_times_backward": any(getattr(fn, "func", fn).__self__ is monitor for fn in before_backward),
        "forward_times_backward": any(getattr(fn, "func", fn).__self__ is forward for fn in before_backward),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
