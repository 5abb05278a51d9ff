"""Lightning's ``utilities.rank_zero`` path: calls and messages for global rank 0 only.

The same objects as ``trainer_core.utilities`` exports (importing this imports that package first, which
sets ``rank_zero_only.rank`` from the environment), so the rank a plugin sets holds here too. They
behave as ``lightning_utilities.core.rank_zero``'s and are defined here because importing
``lightning_utilities`` imports ``packaging``, which ``import trainer_core`` would pay on every rank and
CLI call; the rank is this module's own (a plugin sets it on ``rank_zero_only``).
"""

from __future__ import annotations

import logging
import warnings
from functools import wraps
from typing import Any, Callable, Optional, TypeVar, Union

_T = TypeVar("_T")
# Lightning's logger name, so that messages go (or stay hidden) where they did with lightning_utilities'.
log = logging.getLogger("lightning_utilities.core.rank_zero")


def rank_zero_only(fn: Callable[..., _T], default: Optional[_T] = None) -> Callable[..., Optional[_T]]:
    """``fn`` run on global rank 0 only (``rank_zero_only.rank``); other ranks get ``default``."""

    @wraps(fn)
    def wrapped_fn(*args: Any, **kwargs: Any) -> Optional[_T]:
        rank = getattr(rank_zero_only, "rank", None)
        if rank is None:
            raise RuntimeError("The `rank_zero_only.rank` needs to be set before use")
        if rank == 0:
            return fn(*args, **kwargs)
        return default

    return wrapped_fn


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.debug`` on global rank 0 only."""
    log.debug(*args, stacklevel=stacklevel - 1, **kwargs)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.info`` on global rank 0 only."""
    log.info(*args, stacklevel=stacklevel - 1, **kwargs)


@rank_zero_only
def rank_zero_warn(message: Union[str, Warning], stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn`` on global rank 0 only; the warning names the line that called this."""
    warnings.warn(message, stacklevel=stacklevel - 1, **kwargs)


def rank_zero_deprecation(message: Union[str, Warning], stacklevel: int = 5, **kwargs: Any) -> None:
    """A ``DeprecationWarning`` (or ``category=``) on global rank 0 only."""
    category = kwargs.pop("category", DeprecationWarning)
    rank_zero_warn(message, stacklevel=stacklevel, category=category, **kwargs)


def rank_prefixed_message(message: str, rank: Optional[int]) -> str:
    """``[rank: X] message``, or ``message`` when ``rank`` is ``None``."""
    return message if rank is None else f"[rank: {rank}] {message}"


class WarningCache(set):
    """Messages already shown: each ``warn``/``deprecation``/``info`` call shows a message once, on rank 0."""

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_warn(message, stacklevel=stacklevel, **kwargs)

    def deprecation(self, message: str, stacklevel: int = 6, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_deprecation(message, stacklevel=stacklevel, **kwargs)

    def info(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_info(message, stacklevel=stacklevel, **kwargs)


__all__ = [
    "WarningCache",
    "rank_prefixed_message",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
