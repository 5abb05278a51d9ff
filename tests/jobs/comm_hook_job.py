"""DDP communication hooks, written as a user writes them: ``DDPPlugin(ddp_comm_hook=..., ddp_comm_state=...)``.

Run as a user runs a script (``python comm_hook_job.py CASE --out DIR``); the plugin's launcher starts
rank 1. Every rank saves what ``tests/extending/test_ddp_comm_hook.py`` compares to ``DIR/rank<r>.pt``.

* ``count``: a hook that counts its calls and then all-reduces as DDP does (torch's ``allreduce_hook``),
  24 steps, with small buckets; then the same run without a hook. Records every call (bucket index,
  last bucket of the step), DDP's bucket layout, and both runs' weights.
* ``powersgd``: PowerSGD (rank 1, from step 2) on a small regression, 24 steps, a checkpoint at
  step 12, and the run resumed from it: once for a model whose bucket DDP keeps as it is (with also a
  resume by a plugin that does not restore its state), once for one whose bucket DDP rebuilds.
  One bucket each: on gloo, PowerSGD with several buckets can hang (its all-reduces interleave).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback
from trainer_core.plugins import DDPPlugin

STEPS = 24
SAVE_AT = 12
#: Small enough that DDP's rebuilt layout has two buckets (its first iteration reduces in one).
BUCKET_CAP_MB = 0.0002

calls: list[tuple[int, bool]] = []


def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Count the call, then reduce as DDP does by default.

    Unannotated: torch compares a hook's annotations with its own classes, and this module's are strings.
    """
    calls.append((bucket.index(), bucket.is_last()))
    return allreduce_hook(state, bucket)


class Regression(LightningModule):
    """A small regression: an MLP to one output, or (``hidden=0``) one weight matrix to ``outputs`` outputs."""

    def __init__(self, hidden: int = 32, outputs: int = 1) -> None:
        super().__init__()
        if hidden:
            self.net: nn.Module = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, outputs))
        else:
            self.net = nn.Linear(16, outputs, bias=False)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).square().sum(dim=1).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.03, momentum=0.5)


def data(outputs: int = 1) -> DataLoader:
    """64 samples of a linear map of rank one: what PowerSGD at rank 1 compresses with little loss."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) @ torch.randn(1, outputs, generator=g)
    y = y / y.std()
    return DataLoader(TensorDataset(x, y), batch_size=4)


class SaveAt(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.path)


class Layout(Callback):
    """DDP's gradient buckets, read from the wrapper at the end of training (before it is taken down)."""

    def __init__(self) -> None:
        self.layout: dict[str, Any] = {}

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        data = trainer.strategy.model._get_ddp_logging_data()
        self.layout = {key: value for key, value in data.items() if "bucket" in key}


class NoPluginStateRestore(DDPPlugin):
    """DDP that ignores the checkpoint's plugin state: the PowerSGD state starts afresh on resume."""

    def load_plugin_state_dict(self, state: dict[str, Any]) -> None:
        pass


def fit(
    plugin: DDPPlugin, callbacks: Any = (), ckpt_path: Any = None, hidden: int = 32, outputs: int = 1
) -> Regression:
    seed_everything(0)
    module = Regression(hidden, outputs)
    trainer = Trainer(
        plugins=[plugin],
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, data(outputs), ckpt_path=ckpt_path)
    return module


def count_case() -> dict[str, Any]:
    layout = Layout()
    hooked = fit(DDPPlugin(ddp_comm_hook=counting_hook, bucket_cap_mb=BUCKET_CAP_MB), [layout])
    plain = fit(DDPPlugin(bucket_cap_mb=BUCKET_CAP_MB))
    return {
        "calls": list(calls),
        "layout": layout.layout,
        "hooked": hooked.state_dict(),
        "plain": plain.state_dict(),
        "losses": hooked.losses,
    }


def powersgd_state() -> PowerSGDState:
    return PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)


#: The models of the PowerSGD case, each in one bucket: DDP keeps the bucket of one weight matrix as it is;
#: it rebuilds the MLP's after the first iteration, in the order the gradients are ready (the reverse).
POWERSGD_MODELS = {"kept": {"hidden": 0, "outputs": 16}, "rebuilt": {"hidden": 32, "outputs": 1}}


def powersgd_case(out: Path) -> dict[str, Any]:
    """Stopped at step 12 and resumed, against the run that went on: with buckets DDP keeps, and with rebuilt ones."""
    messages = LogRecords()
    logging.getLogger("trainer_core").addHandler(messages)
    facts: dict[str, Any] = {}
    for layout, model in POWERSGD_MODELS.items():
        ckpt = str(out / f"{layout}.ckpt")
        state, resumed_state = powersgd_state(), powersgd_state()
        full = fit(
            DDPPlugin(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook),
            [SaveAt(ckpt)],
            **model,
        )
        messages.records.clear()
        plugin = DDPPlugin(ddp_comm_state=resumed_state, ddp_comm_hook=powerSGD_hook)
        resumed = fit(plugin, ckpt_path=ckpt, **model)
        facts[layout] = {
            "losses": full.losses,
            "full": full.state_dict(),
            "resumed": resumed.state_dict(),
            "iters": [state.iter, resumed_state.iter],
            "messages": [m for m in messages.records if "PowerSGD" in m],
        }
    plugin = NoPluginStateRestore(ddp_comm_state=powersgd_state(), ddp_comm_hook=powerSGD_hook)
    facts["kept"]["without_plugin_state"] = fit(
        plugin, ckpt_path=str(out / "kept.ckpt"), **POWERSGD_MODELS["kept"]
    ).state_dict()
    return facts


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["count", "powersgd"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    facts = count_case() if args.case == "count" else powersgd_case(out)
    rank = torch.distributed.get_rank()
    torch.save(facts, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
