"""``is_overridden``: whether an object replaces a method of its base class.

Lightning's rule (``lightning_utilities.core.overrides``), defined here because importing
``lightning_utilities`` imports ``packaging`` and ``unittest.mock``, which ``import trainer_core``
would pay on every rank and CLI call.
"""

from __future__ import annotations

import sys
from functools import partial


def is_overridden(method_name: str, instance: object, parent: type) -> bool:
    """Whether ``instance``'s ``method_name`` is another function than ``parent``'s.

    As Lightning's: a ``functools.wraps`` wrapper or ``@contextmanager`` is compared by the function it
    wraps, a ``Mock(wraps=f)`` by ``f``, a ``partial`` by its function; a ``parent`` without the method
    raises ``ValueError``.
    """
    own = getattr(instance, method_name, None)
    if own is None:
        return False
    own = getattr(own, "__wrapped__", own)
    # No Mock can exist unless unittest.mock was imported, so the check never imports it.
    mock = sys.modules.get("unittest.mock")
    if mock is not None and isinstance(own, mock.Mock):
        own = own._mock_wraps
    elif isinstance(own, partial):
        own = own.func
    if own is None:
        return False
    base = getattr(parent, method_name, None)
    if base is None:
        raise ValueError("The parent should define the method")
    base = getattr(base, "__wrapped__", base)
    return own.__code__ != base.__code__
