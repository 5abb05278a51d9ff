"""``LambdaCallback``: a callback made on the spot from functions, one per hook."""

from __future__ import annotations

from typing import Any, Callable

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException

# Members of ``Callback`` that are not hooks: a function given for them would change what the
# checkpoint holds, not react to an event (Lightning's LambdaCallback does not take them either).
_NOT_HOOKS = frozenset({"state_key", "state_dict", "load_state_dict"})


def callback_hooks() -> frozenset[str]:
    """Every hook name ``Callback`` defines (``setup``, ``on_fit_start``, ..., ``on_exception``)."""
    return frozenset(
        name
        for name, member in vars(Callback).items()
        if not name.startswith("_") and callable(member) and name not in _NOT_HOOKS
    )


class LambdaCallback(Callback):
    """Run the given function for each named hook, with the hook's arguments.

    Example::

        LambdaCallback(on_train_epoch_end=lambda trainer, module: print(trainer.current_epoch))

    Any hook of :class:`~trainer_core.callbacks.Callback` may be given; a name that is not one is
    refused (a typo would otherwise never run). Hooks not given cost nothing: the Trainer calls only
    the hooks a callback sets.
    """

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        known = callback_hooks()
        unknown = sorted(set(hooks) - known)
        if unknown:
            raise MisconfigurationException(
                f"LambdaCallback({', '.join(f'{name}=...' for name in unknown)}): not a Callback hook. "
                f"Use any of: {', '.join(sorted(known))}."
            )
        for name, fn in hooks.items():
            if fn is None:
                continue
            if not callable(fn):
                raise MisconfigurationException(
                    f"LambdaCallback({name}={fn!r}): pass a function that takes the hook's arguments."
                )
            setattr(self, name, _as_hook(fn))


def _as_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    # A function of its own: the Trainer tells overridden hooks by their code object, which builtins
    # and callable objects do not have.
    def hook(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return hook
