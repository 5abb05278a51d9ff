"""Lightning's ``utilities.rank_zero`` path: calls and messages for global rank 0 only.

The same objects as ``trainer_core.utilities`` exports (importing this imports that package first, which
sets ``rank_zero_only.rank`` from the environment), so the rank a plugin sets holds here too.
"""

from __future__ import annotations

from lightning_utilities.core.rank_zero import (
    WarningCache,
    rank_prefixed_message,
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = [
    "WarningCache",
    "rank_prefixed_message",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
