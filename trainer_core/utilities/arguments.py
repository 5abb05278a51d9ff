"""Checks of the objects a user hands to the Trainer and its plugins, made where each is built.

A class where an instance belongs (``checkpoint_io=TorchCheckpointIO``) is accepted by Python and fails
only when the run first calls a method on it, often after a whole epoch; these checks refuse it
before anything starts, with the call the user meant to write.
"""

from __future__ import annotations

from typing import Any, Union

from trainer_core.errors import MisconfigurationException

__all__ = ["is_class_of", "pass_instance", "require_instance"]

Kind = Union[type, tuple[type, ...]]


def is_class_of(value: Any, kind: Kind) -> bool:
    """Whether ``value`` is a subclass of ``kind`` itself, given where an instance of it belongs."""
    return isinstance(value, type) and issubclass(value, kind)


def pass_instance(cls: type) -> str:
    """What to write instead of the class ``cls``: ``"pass TorchCheckpointIO() (an instance, not the class)"``."""
    return f"pass {cls.__name__}() (an instance, not the class)"


def require_instance(value: Any, kind: Kind, argument: str, wanted: str) -> None:
    """Refuse ``value`` unless it is an instance of ``kind``.

    ``argument`` is how the user wrote it (``"DDPPlugin(checkpoint_io=...)"``: ``...`` is replaced by
    the value's name); ``wanted`` says what belongs there (``"a CheckpointIO instance"``).
    """
    if isinstance(value, kind):
        return
    if isinstance(value, type):
        given = argument.replace("...", value.__name__)
        if issubclass(value, kind):
            raise MisconfigurationException(f"{given}: {pass_instance(value)}.")
        raise MisconfigurationException(f"{given}: got the class {value.__name__}; pass {wanted}.")
    given = argument.replace("...", _short_repr(value))
    raise MisconfigurationException(f"{given}: got {type(value).__name__}; pass {wanted}.")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 and not text.startswith("<") else f"{type(value).__name__}(...)"
