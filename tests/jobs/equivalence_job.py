"""A job script for tests/plugins/test_equivalence.py, started the way a user starts a script.

One launch trains several *cells* in sequence under one data-parallel plugin at 2 ranks (a
process start costs seconds; a fit on these small modules costs less than one). A cell is
``<module>-<optimizer>[-acc<N>][@<run>]``: ``functional-adam-acc2`` trains ``Functional`` with Adam
and ``accumulate_grad_batches=2``; ``@2`` repeats a cell (reproducibility). Every rank writes
``<cell>.rank<r>.pt``: its per-batch losses, its final full weights and buffers, the warnings the
fit raised, and (dropout) the masks it drew. The modules live here so that the test builds the
single-process reference from the very same classes.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback

N_SAMPLES = 96
SEED = 0
LEARNING_RATES = {"sgd": 0.1, "adam": 0.01}
DROPOUT = 0.3


# ---------------------------------------------------------------------- modules that are not plain chains
class Cell(LightningModule):
    """Regression on 8 features; ``training_step`` goes through ``self(x)``, as most users write it."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer_kind = optimizer
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = LEARNING_RATES[self.optimizer_kind]
        if self.optimizer_kind == "adam":
            return torch.optim.Adam(self.parameters(), lr=lr)
        return torch.optim.SGD(self.parameters(), lr=lr)


class Functional(Cell):
    """(a) Functional ops between submodules: nothing a wrapper could see as a layer."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.l1(x))
        x = F.gelu(self.l2(x) * 0.5)
        return self.head(x)


class Residual(Cell):
    """(b) A residual connection: the block's input is used twice."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        x = x + self.block(x)
        return self.head(torch.tanh(x))


class Shared(Cell):
    """(c) One module called twice in a forward: its gradient is the sum of both uses."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.inp(x))
        x = self.shared(self.shared(x))
        return self.head(torch.tanh(x))


class BatchNormNet(Cell):
    """(d) BatchNorm: its output depends on the other samples of the batch, its buffers on every batch."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bn(self.inp(x))))


class DropoutNet(Cell):
    """(e) Dropout: records the mask it drew per training batch; ``replay`` reuses given masks instead.

    Replaying the masks the ranks drew lets one process compute exactly the function the ranks
    trained together, so the comparison can be exact although the masks come from the RNG.
    """

    def __init__(self, optimizer: str = "sgd", replay: Optional[list[Tensor]] = None) -> None:
        super().__init__(optimizer)
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(DROPOUT)
        self.head = nn.Linear(16, 1)
        self.replay = replay
        self.masks: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.training and self.replay is not None:
            keep = self.replay[len(self.masks)]
            self.masks.append(keep)
            h = h * keep / (1 - DROPOUT)
        elif self.training:
            h = self.drop(h)
            # tanh of a random projection is never exactly 0, so a zero is a dropped unit.
            self.masks.append(h.detach() != 0)
        return self.head(h)


MODULES: dict[str, type[Cell]] = {
    "functional": Functional,
    "residual": Residual,
    "shared": Shared,
    "batchnorm": BatchNormNet,
    "dropout": DropoutNet,
}


def parse_cell(cell: str) -> tuple[str, str, int]:
    """``functional-adam-acc2@2`` -> (``functional``, ``adam``, 2)."""
    parts = cell.split("@")[0].split("-")
    accumulate = int(parts[2].removeprefix("acc")) if len(parts) > 2 else 1
    return parts[0], parts[1], accumulate


def build(cell: str) -> Cell:
    """The cell's module, initialised from the fixed seed (every rank and the reference alike)."""
    module, optimizer, _ = parse_cell(cell)
    seed_everything(SEED, verbose=False)
    return MODULES[module](optimizer)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = torch.sin(x[:, :1] * 2) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


# ---------------------------------------------------------------------- what every rank records
class Record(Callback):
    """Catches the warnings from ``setup`` (before the plugin wraps the model) to the end of training."""

    def __init__(self, out: str, cell: str) -> None:
        self.out = out
        self.cell = cell
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")  # count every warning, not only the first from each line

    def _stop(self) -> list[str]:
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None
        return [str(w.message) for w in self._caught]

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        caught = self._stop()
        weights = pl_module.state_dict()
        # FSDP: every rank takes part in gathering the full parameters.
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in weights.items()}
        masks = getattr(pl_module, "masks", None)
        result = {
            "losses": torch.tensor(pl_module.losses, dtype=torch.float64),
            "weights": {k: v.detach().clone() for k, v in weights.items() if isinstance(v, Tensor)},
            "warnings": caught,
            "masks": torch.stack(masks) if masks else None,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
        }
        torch.save(result, os.path.join(self.out, f"{self.cell}.rank{trainer.global_rank}.pt"))

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self._stop()


def make_plugin(name: str) -> Any:
    """A registered name, or ``fsdp_wrap``: FSDP with every ``nn.Linear`` sharded on its own (a unit used twice)."""
    if name == "fsdp_wrap":
        from trainer_core.plugins import FSDPPlugin

        return FSDPPlugin(auto_wrap_policy={nn.Linear})
    return name


def train(plugin: Any, cell: str, out: str, batch_size: int, steps: int, devices: int = 2) -> Cell:
    """Train one cell: ``steps`` optimizer steps on a shuffled loader of ``batch_size`` per rank."""
    model = build(cell)
    _, _, accumulate = parse_cell(cell)
    trainer = Trainer(
        plugins=[plugin],
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(out, cell)],
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=batch_size, shuffle=True))
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", required=True)
    parser.add_argument("--cells", required=True, help="comma-separated, trained in this order")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per cell")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for cell in args.cells.split(","):
        train(make_plugin(args.plugin), cell, str(out), args.batch_size, args.steps)


if __name__ == "__main__":
    main()
