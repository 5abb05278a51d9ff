"""trainer-core: a Lightning-style trainer whose distributed behaviour lives in training-type plugins."""

import logging
from typing import Any

from trainer_core.__about__ import __version__
from trainer_core.datamodule import LightningDataModule
from trainer_core.module import LightningModule
from trainer_core.optim import get_lr
from trainer_core.precision import Precision
from trainer_core.seed import seed_everything
from trainer_core.trainer import Trainer
from trainer_core.utilities import cli_lightning_logo

# Messages for the user ("Seed set to 42") print by default, as Lightning's do.
_logger = logging.getLogger(__name__)
if not _logger.handlers:
    _logger.addHandler(logging.StreamHandler())
    _logger.setLevel(logging.INFO)
    _logger.propagate = False


def __getattr__(name: str) -> Any:
    # Lightning exports ``Callback`` at the top level; the callbacks layer loads when it is asked for
    # (the core imports it at import time only through trainer_core.connectors).
    if name == "Callback":
        from trainer_core.callbacks import Callback

        return Callback
    raise AttributeError(f"module 'trainer_core' has no attribute {name!r}")


__all__ = [
    "Callback",
    "LightningDataModule",
    "LightningModule",
    "Precision",
    "Trainer",
    "__version__",
    "cli_lightning_logo",
    "get_lr",
    "seed_everything",
]
