"""trainer-core: a Lightning-style trainer whose distributed behaviour lives in training-type plugins."""

from trainer_core.__about__ import __version__
from trainer_core.datamodule import LightningDataModule
from trainer_core.module import LightningModule
from trainer_core.seed import seed_everything
from trainer_core.trainer import Trainer

__all__ = ["LightningDataModule", "LightningModule", "Trainer", "__version__", "seed_everything"]
