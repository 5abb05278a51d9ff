"""A tiny DDP job for the elastic-restart tests and the recovery benchmark, started by real torchrun agents.

Every worker appends JSON lines to ``<out>/events.jsonl`` (one ``write`` per line on an ``O_APPEND``
file: lines of several processes never interleave). What the tests and ``benchmarks/recovery.py`` read:

* ``start``   when the script began (``import_start_t``, a few tens of ms after the process was
  created) and when its imports were done (``imported_t``), its attempt (``TORCHELASTIC_RESTART_COUNT``), rank and world size;
* ``setup``   the process group is up (the ``setup`` hook);
* ``loaded``  a checkpoint was read (``on_load_checkpoint``) and which step it holds;
* ``resumed`` where training starts (``on_train_start``): the global step restored (0: fresh);
* ``step``    every optimizer step that completed: its global step and the sample indices this rank
  trained on in it;
* ``fault``   the moment a fault was injected (just before the kill, or the start of a hang);
* ``end``     ``fit`` returned.

Faults are injected on the first attempt only unless ``--fault-attempt`` says otherwise, so the
restarted workers run through:

* ``--fault kill``: rank ``--fault-rank`` SIGKILLs itself once step ``--fault-step`` has completed;
* ``--fault node``: that rank SIGKILLs its torchrun agent and every worker of it (a node dies);
* ``--fault hang``: that rank sleeps for ever after step ``--fault-step``, for the ``HangWatchdog``
  (``--watchdog SECONDS``) to catch.

``--fault`` may be given several times (``kind:rank:step[:attempt]``) for several faults at
different attempts; the attempt ``once`` fires at the first attempt that reaches the step with that
rank (a marker file in ``<out>`` remembers it), for runs whose attempts are not known in advance
(an elastic run whose first rendezvous may be completed by one agent alone). Rank 0 writes the final
weights to ``<out>/final.pt``.
"""

from __future__ import annotations

import time

_IMPORT_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from trainer_core import LightningModule, Trainer, seed_everything  # noqa: E402
from trainer_core.callbacks import Callback, ModelCheckpoint  # noqa: E402

IMPORTED = time.time()
FAULT_KINDS = ("kill", "node", "hang")


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Events:
    """Appends one JSON line per event to the shared events file."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.base = {
            "attempt": attempt(),
            "rank": int(os.environ.get("RANK", "0")),
            "world": int(os.environ.get("WORLD_SIZE", "1")),
            "pid": os.getpid(),
        }

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.time(), **self.base, **fields}) + "\n"
        os.write(self.fd, line.encode())


class Net(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Linear(6, 1)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen = index.tolist()
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))


ONCE = -1


def parse_fault(text: str) -> tuple[str, str, int, int]:
    """``kind:who:step[:attempt]``: ``who`` a global rank, or ``@NAME``: the worker whose agent's environment
    has ``ELASTIC_NODE=NAME`` (its rank is decided by the rendezvous); attempt 0 when left out, ``once``:
    the first attempt that gets there."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(
            f"--fault {text!r}: use kind:rank|@node:step[:attempt|once] with kind in {FAULT_KINDS}"
        )
    when = parts[3] if len(parts) == 4 else "0"
    return parts[0], parts[1], int(parts[2]), ONCE if when == "once" else int(when)


class Record(Callback):
    """The events of one worker, and the faults it is told to inject."""

    def __init__(
        self, events: Events, faults: list[tuple[str, str, int, int]], step_sleep: float, out: Path
    ) -> None:
        self.events = events
        self.step_sleep = step_sleep
        self.out = out
        me = {str(events.base["rank"]), "@" + os.environ.get("ELASTIC_NODE", "")}
        now = attempt()
        # This worker's faults of this attempt, by step: decided once, so a step costs one dict lookup.
        self.faults = {step: (kind, a) for kind, who, step, a in faults if who in me and a in (now, ONCE)}

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self.events.write("setup")

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.events.write("loaded", step=checkpoint.get("global_step"))

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.events.write("resumed", step=trainer.global_step, epoch=trainer.current_epoch)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self.events.write("step", step=step, epoch=trainer.current_epoch, samples=pl_module.seen)
        fault = self.faults.get(step)
        if fault is not None and self._due(step, fault[1]):
            self.inject(fault[0])
        if self.step_sleep:
            time.sleep(self.step_sleep)

    def _due(self, step: int, when: int) -> bool:
        if when != ONCE:
            return True
        try:  # the first worker to create the marker injects; a later attempt finds it there
            os.close(
                os.open(self.out / f"fault-{self.events.base['rank']}-{step}.done", os.O_CREAT | os.O_EXCL)
            )
        except FileExistsError:
            return False
        return True

    def inject(self, kind: str) -> None:
        self.events.write("fault", kind=kind)
        if kind == "hang":
            while True:
                time.sleep(3600)
        victims = [psutil.Process()]
        if kind == "node":
            agent = psutil.Process().parent()
            victims = [
                agent,
                *(p for p in agent.children(recursive=True) if p.pid != os.getpid()),
                victims[0],
            ]
        for process in victims:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        time.sleep(60)  # never reached: this process is among the victims


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="shared folder: events.jsonl, ckpts/, final.pt")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--max-epochs", type=int, default=-1)
    parser.add_argument("--every", type=int, default=2, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument(
        "--ckpt-path", default=None, help="fit(ckpt_path=...); default: none (automatic resume)"
    )
    parser.add_argument("--fault", type=parse_fault, action="append", default=[])
    parser.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds after every step (to slow a run)"
    )
    parser.add_argument(
        "--watchdog", type=float, default=0.0, help="HangWatchdog timeout in seconds (0: none)"
    )
    parser.add_argument(
        "--wait-world",
        type=int,
        default=0,
        help="until a fault has fired, a worker of a smaller world waits for its agent to restart it with more "
        "nodes instead of training (an elastic first rendezvous that one agent completed alone)",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    out = Path(args.out)
    events = Events(out / "events.jsonl")
    events.write("start", import_start_t=_IMPORT_START, imported_t=IMPORTED)
    if events.base["world"] < args.wait_world and not any(out.glob("fault-*.done")):
        # Outside fit, no handler of ours: the agent's SIGTERM ends this process at once.
        time.sleep(120)
        raise SystemExit(f"world size {events.base['world']}: no other node joined within 120 s")
    seed_everything(0, verbose=False)
    model = Net()
    callbacks: list[Any] = [
        Record(events, args.fault, args.step_sleep, out),
        ModelCheckpoint(
            dirpath=str(out / "ckpts"), every_n_train_steps=args.every, save_top_k=-1, save_last=True
        ),
    ]
    if args.watchdog:
        from trainer_core.callbacks.hang_watchdog import HangWatchdog

        callbacks.append(HangWatchdog(timeout=args.watchdog))
    trainer = Trainer(
        plugins=["ddp"],
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(out / "root"),
    )
    loader = DataLoader(dataset(args.samples), batch_size=args.batch_size, shuffle=True)
    if args.ckpt_path is None:
        trainer.fit(model, loader)
    else:
        trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    events.write("end", step=trainer.global_step)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final.pt")


if __name__ == "__main__":
    main()
