"""Packages whose names load on first use, so that ``import trainer_core`` loads none of them."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(
    package: str, modules: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``name`` loads from ``package.<modules[name]>``.

    A name, once loaded, stays in the package's namespace, so later lookups are plain attribute reads.
    """

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(modules))

    return __getattr__, __dir__
