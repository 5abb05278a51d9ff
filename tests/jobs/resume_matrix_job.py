"""The resume matrix of tests/checkpoint/test_resume_matrix.py: one plugin, several loaders and features, every writer.

Run as a user runs a script (``plugins="ddp"`` starts it again as rank 1). For each *scenario*
(a loader, dropout or not, a per-step or per-epoch scheduler, gradient accumulation or not) every
rank trains, in this one process group:

1. the uninterrupted run, ``MAX_STEPS`` optimizer steps: per step its loss and learning rate, and
   at the end its weights;
2. runs that write checkpoints in every way a user does (the ``WRITERS``): ``ModelCheckpoint``
   every few steps, at epoch ends, after validation, on a time interval, the ``last`` link, a
   ``save_checkpoint`` in an epoch-start hook, and ``save_checkpoint`` after ``fit`` was stopped by
   ``max_steps``, ``max_epochs``, ``EarlyStopping``, ``Timer`` and a pre-emption signal;
3. from each checkpoint, with fresh seeds, a resumed run to ``MAX_STEPS``.

Every run records, from inside each rank, its loss and learning rate per step and its final
weights (this rank's part of them) under ``<out>/<scenario>/``; ``written.json`` names the
checkpoint of each writer. The test compares the resumed runs with the uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, EarlyStopping, ModelCheckpoint, Timer

MAX_STEPS = 14
N_SAMPLES = 40
BATCH = 4
WRITERS = (
    "every_n_train_steps",
    "epoch_end",
    "after_validation",
    "train_time_interval",
    "last_link",
    "epoch_start",
    "after_max_steps",
    "after_max_epochs",
    "after_early_stopping",
    "after_timer",
    "after_preemption",
    "preemption_signal",
)
LOADERS = ("map", "stateful", "iterable")


class MatrixNet(LightningModule):
    def __init__(self, dropout: bool, scheduler: str) -> None:
        super().__init__()
        self.scheduler = scheduler
        layers: list[nn.Module] = [nn.Linear(6, 12), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(0.3))
        layers.append(nn.Linear(12, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # PipelinePlugin runs forward through its stages and this on the last one.
        return nn.functional.mse_loss(output, target)

    @property
    def head_name(self) -> str:
        return f"net.{len(self.net) - 1}"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        if self.scheduler == "step":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def _tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


class ShuffledStream(IterableDataset):
    """An iterable dataset that shuffles from the global RNG and gives each rank its own samples."""

    def __init__(self) -> None:
        self.x, self.y = _tensors(N_SAMPLES, 1)

    def __iter__(self) -> Any:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        order = torch.randperm(N_SAMPLES)
        for index in order[rank::world].tolist():
            yield self.x[index], self.y[index]


def train_loader(kind: str) -> Any:
    if kind == "iterable":
        return DataLoader(ShuffledStream(), batch_size=BATCH)
    dataset = TensorDataset(*_tensors(N_SAMPLES, 1))
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True)
    return DataLoader(dataset, batch_size=BATCH, shuffle=True)


def val_loader() -> DataLoader:
    return DataLoader(TensorDataset(*_tensors(2 * BATCH, 2)), batch_size=BATCH)


class Recorder(Callback):
    """Each optimizer step's loss and learning rate, and the final weights, written to ``<prefix>.rank<r>.*``.

    Written from inside the rank (``on_train_end``), so ranks that ``ddp_spawn`` starts record too.
    """

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.steps: dict[int, tuple[float, float]] = {}
        self.start: dict[str, int] = {}
        self._step_before = 0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        # Where the run starts: after a restore, the checkpoint's position.
        self.start = {"global_step": trainer.global_step, "total_batch_idx": trainer.total_batch_idx}

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_before:
            return  # a batch that only accumulated: its step's loss is recorded with the batch that steps
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.steps[trainer.global_step] = (float(loss), float(lr))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        rank = trainer.global_rank
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        record = {"start": self.start, "steps": self.steps}
        Path(f"{self.prefix}.rank{rank}.json").write_text(json.dumps(record))
        torch.save(_local_weights(pl_module), f"{self.prefix}.rank{rank}.pt")


class SaveAtEpochStart(Callback):
    """``trainer.save_checkpoint`` in ``on_train_epoch_start`` of the second epoch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            trainer.save_checkpoint(self.path)


class SignalAtStart(Callback):
    """Sends this process SIGTERM before the first batch: the pre-emption path saves and ends ``fit``.

    Several ranks agree on the step to stop at after the first batch and then about once a
    second, so the signal comes before that first agreement to land at a known step.
    """

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.total_batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def _plugin(name: str, dropout: bool) -> Any:
    from trainer_core.plugins import FSDPPlugin, PipelinePlugin

    if name == "pipeline":
        # Two stages on the two ranks: the body (with its dropout) and the head, two micro-batches.
        return PipelinePlugin(split_points=[MatrixNet(dropout, "step").head_name], n_microbatches=2)
    if name == "fsdp_full":
        return FSDPPlugin(state_dict_type="full")
    if name == "fsdp_sharded":
        return FSDPPlugin(state_dict_type="sharded")
    return name


def _local_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers (its own shard under FSDP), detached copies."""
    out = {}
    for name, tensor in module.state_dict().items():
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if not tensor.is_meta:  # a pipeline rank holds its own stages' tensors only
            out[name] = tensor.detach().clone()
    return out


class Scenario:
    def __init__(
        self, args: argparse.Namespace, loader: str, dropout: bool, scheduler: str, accumulate: int
    ) -> None:
        self.args = args
        self.loader = loader
        self.dropout = dropout
        self.scheduler = scheduler
        self.accumulate = accumulate
        self.name = f"{loader}-{'dropout' if dropout else 'plain'}-{scheduler}-acc{accumulate}"
        self.folder = Path(args.out) / self.name

    def trainer(self, callbacks: list[Callback], **overrides: Any) -> Trainer:
        kwargs: dict[str, Any] = {
            "plugins": _plugin(self.args.plugin, self.dropout),
            "devices": self.args.devices,
            "max_steps": MAX_STEPS,
            "accumulate_grad_batches": self.accumulate,
            "val_check_interval": 3,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(self.folder),
            "callbacks": callbacks,
        }
        kwargs.update(overrides)
        if not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
            kwargs["enable_checkpointing"] = False
        return Trainer(**kwargs)

    def fit(self, trainer: Trainer, seed: int, ckpt_path: Optional[str] = None) -> MatrixNet:
        seed_everything(seed, verbose=False)
        model = MatrixNet(self.dropout, self.scheduler)
        trainer.fit(model, train_loader(self.loader), val_loader(), ckpt_path=ckpt_path)
        return model

    def run(self) -> None:
        self.fit(self.trainer([Recorder(self.folder / "reference")]), seed=7)
        written = self.write_checkpoints()
        (self.folder / "written.json").write_text(json.dumps(written))
        for writer, path in written.items():
            if not self.wanted(writer):
                continue
            if path is not None and os.path.exists(path):
                self.fit(self.trainer([Recorder(self.folder / writer)]), seed=1234, ckpt_path=path)

    def wanted(self, writer: str) -> bool:
        """Whether the run resumes from ``writer``'s checkpoint (``--resume-only``; all by default)."""
        return not self.args.resume_only or writer in self.args.resume_only.split(",")

    def write_checkpoints(self) -> dict[str, Optional[str]]:
        """Every way of writing a checkpoint; the path each wrote (``None`` where none was written)."""
        f = self.folder
        by_steps = ModelCheckpoint(
            dirpath=str(f / "steps"),
            filename="s{step}",
            every_n_train_steps=4,
            save_top_k=-1,
            save_last="link",
        )
        by_epoch = ModelCheckpoint(
            dirpath=str(f / "epochs"),
            filename="e{epoch}",
            every_n_epochs=1,
            save_top_k=-1,
            save_on_train_epoch_end=True,
        )
        by_val = ModelCheckpoint(
            dirpath=str(f / "val"), filename="v{step}", monitor="val_loss", save_top_k=-1
        )
        by_time = ModelCheckpoint(
            dirpath=str(f / "time"),
            filename="t{step}",
            train_time_interval=timedelta(microseconds=1),
            save_top_k=1,
        )
        at_start = str(f / "epoch_start.ckpt")
        stop_at = 6  # optimizer steps: mid-epoch for every plugin and accumulation here
        trainer = self.trainer(
            [by_steps, by_epoch, by_val, by_time, SaveAtEpochStart(at_start)], max_steps=stop_at * 2
        )
        self.fit(trainer, seed=7)
        written: dict[str, Optional[str]] = {
            "every_n_train_steps": _first(f / "steps"),
            "epoch_end": _first(f / "epochs"),
            "after_validation": _first(f / "val"),
            "train_time_interval": by_time.best_model_path or None,
            "last_link": str(f / "steps" / "last.ckpt"),
            "epoch_start": at_start,
            # Also the checkpoint the pre-emption itself writes (below).
            "preemption_signal": None,
        }

        def after(name: str, trainer: Trainer) -> None:
            if not (self.wanted(name) or (name == "after_preemption" and self.wanted("preemption_signal"))):
                return
            path = str(f / f"{name}.ckpt")
            try:
                self.fit(trainer, seed=7)
            except SystemExit as stop:  # the pre-emption's clean exit
                assert stop.code == 0, stop.code
            trainer.save_checkpoint(path)
            written[name] = path

        if self.args.plugin == "ddp_spawn":
            self.spawn_refuses_to_save_after_fit(stop_at)
            return written
        after("after_max_steps", self.trainer([], max_steps=stop_at))
        after("after_max_epochs", self.trainer([], max_epochs=1, max_steps=-1))
        # Better than any loss: stops at the first validation, in the middle of the first epoch.
        early = EarlyStopping(monitor="val_loss", stopping_threshold=1e9, check_on_train_epoch_end=False)
        after("after_early_stopping", self.trainer([early]))
        after("after_timer", self.trainer([Timer(duration=timedelta(microseconds=1), verbose=False)]))
        after("after_preemption", self.trainer([SignalAtStart()], default_root_dir=str(f / "preempt")))
        written["preemption_signal"] = str(f / "preempt" / "checkpoints" / "preempted.ckpt")
        return written

    def spawn_refuses_to_save_after_fit(self, stop_at: int) -> None:
        """After a ``ddp_spawn`` fit the ranks are gone: a full checkpoint is refused, weights alone are written."""
        from trainer_core.errors import MisconfigurationException

        trainer = self.trainer([], max_steps=stop_at)
        self.fit(trainer, seed=7)
        try:
            trainer.save_checkpoint(str(self.folder / "refused.ckpt"))
        except MisconfigurationException as err:
            (self.folder / "refused.txt").write_text(str(err))
        trainer.save_checkpoint(str(self.folder / "weights.ckpt"), weights_only=True)


def _first(folder: Path) -> Optional[str]:
    """The checkpoint in ``folder`` written first (the smallest number in its name), if any."""
    found = [p for p in folder.glob("*.ckpt") if p.name != "last.ckpt"] if folder.exists() else []
    if not found:
        return None
    return str(min(found, key=lambda p: int("".join(ch for ch in p.stem if ch.isdigit()) or 0)))


def _resume_as_before() -> None:
    """DDP's resumed wrapper in its first buckets, and FSDP's checkpoints without the cycle's gradients."""
    from trainer_core.plugins import FSDPPlugin, ddp

    ddp._PIN_BUCKETS = False
    FSDPPlugin.accumulated_gradients = lambda self, module: {}  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--scenarios",
        required=True,
        help="comma-separated loader:dropout:scheduler:accumulate, e.g. map:1:step:1,iterable:0:epoch:2",
    )
    parser.add_argument(
        "--resume-only", default="", help="comma-separated writers to resume from (default: all)"
    )
    parser.add_argument(
        "--as-before",
        action="store_true",
        help="resume as before exactness at every world size (benchmarks/resume_exact.py measures the change): "
        "DDP in its own first buckets, FSDP without the gradients of an unfinished accumulation cycle",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.as_before:
        _resume_as_before()
    for spec in args.scenarios.split(","):
        loader, dropout, scheduler, accumulate = spec.split(":")
        Scenario(args, loader, dropout == "1", scheduler, int(accumulate)).run()


if __name__ == "__main__":
    main()
