"""Lightning's ``lightning.pytorch.core``: the module, the data module and the optimizer wrapper, by those paths."""

from __future__ import annotations

from trainer_core.core.optimizer import LightningOptimizer
from trainer_core.datamodule import LightningDataModule
from trainer_core.module import LightningModule

__all__ = ["LightningDataModule", "LightningModule", "LightningOptimizer"]
