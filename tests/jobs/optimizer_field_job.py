"""Sharded plugin subclasses that add a field to the optimizer state, as a user writes them.

One rank of a gloo group, started with RANK/WORLD_SIZE (as torchrun starts it). For each plugin of
``--plugins`` (``ddp_sharded``: fairscale OSS; ``zero``: torch ZeroRedundancyOptimizer) it trains 4 steps
uninterrupted, saving a checkpoint after step 2, then trains a fresh model from that checkpoint to
step 4. ``DIR/rank<r>_<plugin>.pt`` records the weights of both runs, the field each resume handed to
``load_optimizer_state_dict``, and (after the first run) whether the plugin's consolidation gives what
the sharded optimizer's own ``consolidate_state_dict`` + ``state_dict`` give.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback
from trainer_core.plugins import DDPShardedPlugin, ZeroPlugin

RANK = int(os.environ.get("RANK", 0))
FIELD = "my_counter"


class FieldMixin:
    """Adds ``{"my_counter": tensor([global step])}`` to the state rank 0 writes; records what a resume reads."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loaded: list[Any] = []

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # On every rank, as a user writes it: rank 0's goes to the file (the others hold no state of the optimizer).
        return {
            **super().optimizer_state(optimizer),
            FIELD: torch.tensor([self.lightning_module.global_step]),
        }

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict.get(FIELD))
        super().load_optimizer_state_dict(optimizer, state_dict)


class CountingShardedPlugin(FieldMixin, DDPShardedPlugin):
    pass


class CountingZeroPlugin(FieldMixin, ZeroPlugin):
    pass


PLUGINS = {"ddp_sharded": CountingShardedPlugin, "zero": CountingZeroPlugin}


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 6)
        self.head = nn.Linear(6, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.layer(x))), y)

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


class SaveAfterStep(Callback):
    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(
        TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8
    )


def fit(plugin: Any, model: Net, callbacks: list[Callback], ckpt_path: Any = None) -> Trainer:
    trainer = Trainer(
        plugins=[plugin],
        devices=2,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


def consolidation_facts(trainer: Trainer) -> dict[str, Any]:
    """The plugin's gathered state against the optimizer's own consolidation (both collectives)."""
    from trainer_core.plugins.consolidate import gather_sharded_state

    optimizer = trainer.optimizers[0]
    gathered = gather_sharded_state(optimizer, torch.device("cpu"))
    to = {"to": 0} if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else {"recipient_rank": 0}
    optimizer.consolidate_state_dict(**to)
    own = optimizer.state_dict() if RANK == 0 else {}
    return {"gathered": gathered, "own": own}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugins", nargs="+", default=list(PLUGINS))
    args = parser.parse_args()
    out = Path(args.out)
    for name in args.plugins:
        path = str(out / f"{name}.ckpt")
        seed_everything(0, verbose=False)
        model = Net()
        straight = fit(PLUGINS[name](), model, [SaveAfterStep(path, 2)])
        facts = consolidation_facts(straight)
        seed_everything(1, verbose=False)  # another init: everything must come from the checkpoint
        resumed_model = Net()
        plugin = PLUGINS[name]()
        fit(plugin, resumed_model, [], ckpt_path=path)
        torch.save(
            {
                "straight": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "resumed": {k: v.detach().clone() for k, v in resumed_model.state_dict().items()},
                "loaded": plugin.loaded,
                "straight_loaded": straight.plugin.loaded,
                **facts,
            },
            out / f"rank{RANK}_{name}.pt",
        )


if __name__ == "__main__":
    main()
