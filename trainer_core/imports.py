"""Optional dependencies, checked without importing them until a feature needs them."""

from __future__ import annotations

from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

FAIRSCALE_AVAILABLE = RequirementCache("fairscale==0.4.13")


def require_fairscale(feature: str) -> ModuleType:
    """Import fairscale for ``feature``, or raise one error that says how to install it."""
    if not FAIRSCALE_AVAILABLE:
        raise ModuleNotFoundError(
            f"{feature} needs fairscale 0.4.13 ({FAIRSCALE_AVAILABLE.message}). "
            "Install it with `pip install 'trainer-core[sharded]'` (or `pip install fairscale==0.4.13`)."
        )
    import fairscale

    return fairscale
