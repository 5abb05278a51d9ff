"""``StrEnum``: an enum whose members are their string values (``TrainerFn.FITTING == "fit"``).

Lightning's (``lightning_utilities.core.enums``), defined here because importing ``lightning_utilities``
imports ``packaging``, which ``import trainer_core`` would pay on every rank and CLI call.
"""

from __future__ import annotations

import warnings
from enum import Enum
from typing import Literal, Optional

_Source = Literal["key", "value", "any"]


class StrEnum(str, Enum):
    """A ``str`` enum built from a member's name or value with ``from_str``, as Lightning's is."""

    @classmethod
    def from_str(cls, value: str, source: _Source = "key") -> StrEnum:
        """The member whose name (any case, ``source="key"``), value (``"value"``) or either (``"any"``) is ``value``."""
        if source in ("key", "any"):
            for name in cls.__members__:
                if name.lower() == value.lower():
                    return cls[name]
        if source in ("value", "any"):
            for name, member in cls.__members__.items():
                if member == value:
                    return cls[name]
        raise ValueError(f"Invalid match: expected one of {cls._allowed_matches(source)}, but got {value}.")

    @classmethod
    def try_from_str(cls, value: str, source: _Source = "key") -> Optional[StrEnum]:
        """``from_str``, or a warning and ``None`` when nothing matches."""
        try:
            return cls.from_str(value, source)
        except ValueError:
            warnings.warn(
                UserWarning(
                    f"Invalid string: expected one of {cls._allowed_matches(source)}, but got {value}."
                ),
                stacklevel=2,
            )
        return None

    @classmethod
    def _allowed_matches(cls, source: str) -> list[str]:
        keys = list(cls.__members__)
        values = [member.value for member in cls.__members__.values()]
        return keys if source == "key" else values if source == "value" else keys + values
