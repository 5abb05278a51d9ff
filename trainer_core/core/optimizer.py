"""``LightningOptimizer`` where Lightning keeps it (``lightning.pytorch.core.optimizer``); defined in ``trainer_core.optim``."""

from __future__ import annotations

from trainer_core.optim import LightningOptimizer

__all__ = ["LightningOptimizer"]
