"""``apply_to_collection``: a function applied to every value of a type in nested lists, dicts, tuples.

Lightning's own (``lightning_utilities.core.apply_func``), imported on the first call: importing
``lightning_utilities`` imports ``packaging``, which ``import trainer_core`` would otherwise pay on every
rank and CLI call.
"""

from __future__ import annotations

from typing import Any, Callable, Union


def apply_to_collection(
    data: Any,
    dtype: Union[type, Any, tuple[Union[type, Any], ...]],
    function: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``lightning_utilities.core.apply_func.apply_to_collection``, with the same arguments."""
    from lightning_utilities.core.apply_func import apply_to_collection as apply

    return apply(data, dtype, function, *args, **kwargs)
