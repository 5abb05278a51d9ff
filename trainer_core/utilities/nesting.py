"""How deep and how big a loaded structure really is, measured without recursion.

A file can describe a structure that breaks the code that later walks it: lists nested 100,000
deep (every recursive walker, ``copy.deepcopy`` included, ends in ``RecursionError``), a container
that holds itself (a walker never ends), or a few containers referenced over and over (pickle's memo,
YAML's anchors: a "billion laughs" is a few hundred bytes that unfold to 10**9 entries for any walker
that does not remember what it has seen). :func:`nesting_problem` measures all three in one pass
that visits each distinct container once, so the readers can refuse such a file before anything
walks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

#: Containers nested deeper than this are refused: real checkpoints and hyper-parameters nest under
#: a dozen levels, and recursive walkers (two or three frames a level) stay far from Python's limit.
MAX_NESTING = 100
#: Entries that repeated references may add when the structure is unfolded (a tree has none).
MAX_REPEATED_ENTRIES = 1_000_000

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor)


def _members(value: Any) -> list[Any]:
    """What a walker of ``value`` descends into: keys and values, items, or an object's attributes."""
    if isinstance(value, _LEAVES):
        return []
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    state = getattr(value, "__dict__", None)  # a registered class, argparse.Namespace
    return list(state.values()) if isinstance(state, dict) else []


def _is_container(value: Any) -> bool:
    if isinstance(value, _LEAVES):
        return False
    return isinstance(value, (Mapping, list, tuple, set, frozenset)) or isinstance(
        getattr(value, "__dict__", None), dict
    )


def nesting_problem(
    value: Any, max_depth: int = MAX_NESTING, max_repeated: int = MAX_REPEATED_ENTRIES
) -> Optional[str]:
    """Why walking ``value`` would fail or never end (to follow the file's name in an error), or ``None``.

    ``"nests containers more than 100 deep"``, ``"holds a container that contains itself"``, or
    ``"repeats the same containers so often that it unfolds to N entries"``.
    """
    measured: dict[int, tuple[int, int]] = {}  # id -> (height, entries when unfolded)
    on_path: set[int] = set()  # the containers between the top and the one being entered
    distinct_entries = 0
    # (container, its members that are containers, its number of members); None: not entered yet
    stack: list[tuple[Any, Optional[list[Any]], int]] = [(value, None, 0)]
    while stack:
        node, inner, count = stack.pop()
        key = id(node)
        if inner is not None:  # every member measured: measure the container
            on_path.discard(key)
            height = 1 + max((measured[id(member)][0] for member in inner), default=0)
            measured[key] = (height, count + sum(measured[id(member)][1] for member in inner))
            distinct_entries += count
            continue
        if key in measured:
            continue
        if key in on_path:
            return "holds a container that contains itself"
        if len(on_path) >= max_depth:
            return f"nests containers more than {max_depth} deep"
        on_path.add(key)
        members = _members(node)
        inner = [member for member in members if _is_container(member)]
        stack.append((node, inner, len(members)))
        stack.extend((member, None, 0) for member in inner if id(member) not in measured)
    unfolded = measured[id(value)][1]
    if unfolded - distinct_entries > max_repeated:
        return (
            f"repeats the same containers so often that it unfolds to {unfolded:,} entries "
            f"({distinct_entries:,} distinct)"
        )
    return None
