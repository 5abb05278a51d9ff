"""SWA and EMA under 2 gloo ranks, for tests/callbacks/test_weight_averaging.py; also its shared module and data.

``--plugin ddp|fsdp``: for each of ``StochasticWeightAveraging`` and ``EMAWeightAveraging`` one run
goes straight through (writing a checkpoint in the middle of an epoch of the averaging phase) and
one resumes from that checkpoint with another seed. Every rank compares its own parameters (its
shards under FSDP) of both runs and writes ``rank<r>.json``: the largest difference (0 when the
resume is exact) and how far the final, averaged weights lie from the last trained ones (more than
0 when the average was applied). Rank 0 also writes the EMA run's final full weights.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks.base import Callback

FEATURES = 4


class SwaModel(LightningModule):
    """``Linear -> [BatchNorm1d] -> Tanh -> Linear``, SGD, and optionally a StepLR halving the rate every epoch."""

    def __init__(self, batch_norm: bool = False, scheduler: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(FEATURES, 8)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(8))
        self.net = nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 1))
        self.scheduler = scheduler
        self.lr = lr
        self.trainer_lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def on_train_epoch_end(self) -> None:
        self.trainer_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int = 24, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size, shuffle=shuffle)


class SaveAt(Callback):
    """Save once, right after optimizer step ``step`` (after the averaging callbacks listed before it)."""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step, self.saved = path, step, False

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.saved and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self.saved = True


class LastTrained(Callback):
    """The parameters (this rank's values) after the last optimizer step, before any average replaces them."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.weights = [_local(p).clone() for p in pl_module.parameters()]


def fit_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def trainer_for(**overrides: Any) -> Trainer:
    return Trainer(**fit_kwargs(**overrides))


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _plugin(name: str) -> Any:
    if name == "fsdp":
        from trainer_core.plugins import FSDPPlugin

        return FSDPPlugin()
    return name


def _callback(name: str) -> Callback:
    from trainer_core.callbacks.stochastic_weight_avg import StochasticWeightAveraging
    from trainer_core.callbacks.weight_averaging import EMAWeightAveraging

    if name == "swa":
        return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2)
    return EMAWeightAveraging(decay=0.7)


def _run(
    plugin: str, name: str, out: Path, ckpt_path: Optional[str], seed: int
) -> tuple[SwaModel, LastTrained]:
    seed_everything(seed, verbose=False)
    model = SwaModel(batch_norm=False, scheduler=True)
    last = LastTrained()
    callbacks = [last, _callback(name)]
    if ckpt_path is None:
        # 32 samples, 4 per batch, 2 ranks: 4 steps per epoch; step 6 is in the middle of epoch 1.
        callbacks.append(SaveAt(str(out / f"{name}_mid.ckpt"), step=6))
    trainer = Trainer(**fit_kwargs(plugins=_plugin(plugin), devices=2, max_epochs=3, callbacks=callbacks))
    trainer.fit(model, loader(32, shuffle=True), ckpt_path=ckpt_path)
    return model, last


def _largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest element-wise difference; a rank's shard of a small tensor may be empty under FSDP."""
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin", choices=("ddp", "fsdp", "zero", "ddp_sharded"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    rank = 0
    for name in ("swa", "ema"):
        straight, last = _run(args.plugin, name, out, None, seed=7)
        resumed, _ = _run(args.plugin, name, out, str(out / f"{name}_mid.ckpt"), seed=1234)
        rank = straight.global_rank
        final = [_local(p) for p in straight.parameters()]
        again = [_local(p) for p in resumed.parameters()]
        result[name] = {
            "max_abs_diff": _largest(final, again),
            "averaged_moved": _largest(final, last.weights),
        }
        if name == "ema":
            full = {
                n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in straight.state_dict().items()
            }
            if rank == 0:
                torch.save(full, out / "ema_final.pt")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
