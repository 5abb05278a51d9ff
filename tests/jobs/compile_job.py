"""A compiled submodule under 2 gloo ranks, for tests/checkpoint/test_compile.py.

``--plugin ddp|fsdp``: an uncompiled run trains 6 steps straight through, writing a checkpoint at
step 3 and one at the end (``plain_final.ckpt``); a second run, with ``net`` compiled (``"eager"``
backend: torch's own kernels, the same numbers), resumes from the step-3 file and writes
``compiled_final.ckpt``. Every rank writes ``rank<r>.json``: the largest difference between the two
runs' final parameters (its shards under FSDP) and the resumed run's step. Under FSDP the compiled
run also writes a sharded folder, whose stored weight names rank 0 lists in ``sharded_keys.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks.base import Callback

FEATURES, STEPS, SAVE_AT = 4, 6, 3
QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


class CompileModel(LightningModule):
    """``Linear -> Tanh -> Linear`` with Adam; ``compile`` names a backend to compile ``net`` with (``None``: none)."""

    def __init__(self, compile: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        if compile is not None:
            self.net = torch.compile(self.net, backend=compile)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(n: int) -> DataLoader:
    """``n`` random samples in order, 4 a batch."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, FEATURES, generator=gen), torch.randn(n, 1, generator=gen))
    return DataLoader(data, batch_size=4)


class SaveAt(Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _plugin(name: str, sharded: bool = False) -> Any:
    if name == "fsdp":
        from trainer_core.plugins.fsdp import FSDPPlugin

        return FSDPPlugin(state_dict_type="sharded") if sharded else FSDPPlugin()
    return name


def _fit(
    plugin: Any, compile: bool, out: Path, ckpt_path: Optional[Path], callbacks: list
) -> tuple[Trainer, Any]:
    seed_everything(7 if ckpt_path is None else 1234, verbose=False)
    model = CompileModel(compile="eager" if compile else None)
    trainer = Trainer(**QUIET, plugins=plugin, devices=2, max_steps=STEPS, callbacks=callbacks)
    # 48 samples, 4 a batch, 2 ranks: 6 steps an epoch, the save in its middle.
    trainer.fit(model, loader(48), ckpt_path=ckpt_path)
    return trainer, model


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin", choices=("ddp", "fsdp"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    mid = out / "plain_mid.ckpt"
    straight_trainer, straight = _fit(_plugin(args.plugin), False, out, None, [SaveAt(mid, SAVE_AT)])
    straight_trainer.save_checkpoint(out / "plain_final.ckpt")
    resumed_trainer, resumed = _fit(_plugin(args.plugin), True, out, mid, [])
    resumed_trainer.save_checkpoint(out / "compiled_final.ckpt")

    rank = resumed_trainer.global_rank
    # A rank's shard of a small tensor may be empty under FSDP.
    diffs = [
        float((_local(a) - _local(b)).abs().max())
        for a, b in zip(straight.parameters(), resumed.parameters())
        if _local(a).numel()
    ]
    result = {"max_abs_diff": max(diffs, default=0.0), "global_step": resumed_trainer.global_step}
    if args.plugin == "fsdp":
        sharded_trainer, _ = _fit(_plugin("fsdp", sharded=True), True, out, None, [])
        sharded_trainer.save_checkpoint(out / "compiled_sharded")
        if rank == 0:
            from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

            keys = DistributedCheckpointIO().stored_keys(str(out / "compiled_sharded"))
            weights = sorted(k.split(".", 1)[1] for k in keys if k.startswith("state_dict."))
            (out / "sharded_keys.json").write_text(json.dumps(weights))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
