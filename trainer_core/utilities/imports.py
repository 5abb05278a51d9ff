"""Which optional packages are installed, under the names Lightning programs test (``lightning.pytorch.utilities.imports``)."""

from __future__ import annotations

import sys

from lightning_utilities.core.imports import RequirementCache

from trainer_core.imports import FAIRSCALE_AVAILABLE

_IS_WINDOWS = sys.platform == "win32"
_TORCHVISION_AVAILABLE = RequirementCache("torchvision")
_TORCHMETRICS_AVAILABLE = RequirementCache("torchmetrics")
_OMEGACONF_AVAILABLE = RequirementCache("omegaconf")
_RICH_AVAILABLE = RequirementCache("rich>=10.2.2")
_FAIRSCALE_AVAILABLE = FAIRSCALE_AVAILABLE
