"""One optimizer and one scheduler per model part, behind the interface of a single one.

Pipeline parallelism splits a model into parts (stages); a rank may hold several. Each part gets
its own optimizer and scheduler, so a part can be saved, loaded and moved to another rank on its
own, but the loop and the callbacks keep talking to *one* optimizer and *one* scheduler: the
containers here fan every call out to the parts. For every plugin but pipeline parallelism there
is one part, and no container is built at all.

The scheduler container's state is the state of one scheduler: all parts step together, so their
states agree, and a checkpoint holds one scheduler state however many parts wrote it. That is what
lets a run resume with another number of parts (another pipeline degree, or parts per rank).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

from torch.optim import Optimizer

from trainer_core.optim import rebase_learning_rates


class OptimizersContainer(Optimizer):
    """Optimizers of the model parts, stepped, zeroed, saved and loaded together.

    It is an ``Optimizer`` (so hooks, ``isinstance`` checks and schedulers' bookkeeping work),
    whose ``param_groups`` are the parts' groups, in part order: a learning rate set through the
    container (a scheduler, a callback) is set on the part that owns the group.
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizersContainer needs at least one optimizer.")
        # Optimizer.__init__ sets up the hooks; the groups and the state it builds are not used.
        self.optimizers: list[Optimizer] = []
        super().__init__([_placeholder()], dict(optimizers[0].defaults))
        self.optimizers = list(optimizers)
        self.state = _ChainedState(self.optimizers)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        # Read through every time: a part's load_state_dict replaces its group dicts.
        return [group for opt in self.optimizers for group in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        """Only ``Optimizer.__init__`` sets it; the parts own the groups."""

    def __len__(self) -> int:
        return len(self.optimizers)

    def __iter__(self) -> Iterator[Optimizer]:
        return iter(self.optimizers)

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:  # type: ignore[override]
        # The closure (forward and backward of every part at once) runs once, before any part steps.
        result = closure() if closure is not None else None
        for opt in self.optimizers:
            opt.step(**kwargs)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"parts": [state of part 0, ...]}``: index-keyed, per part; checkpoints use names instead."""
        return {"parts": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        parts = state_dict["parts"] if isinstance(state_dict, dict) else state_dict
        if len(parts) != len(self.optimizers):
            raise ValueError(
                f"OptimizersContainer holds {len(self.optimizers)} optimizers but the state has {len(parts)} parts."
            )
        for opt, state in zip(self.optimizers, parts):
            opt.load_state_dict(state)

    def __repr__(self) -> str:
        inner = ", ".join(type(opt).__name__ for opt in self.optimizers)
        return f"OptimizersContainer({inner})"


class _ChainedState(dict):
    """The parts' ``state`` read as one mapping (for code that inspects ``optimizer.state``)."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        super().__init__()
        self._optimizers = optimizers

    def _merged(self) -> dict[Any, Any]:
        merged: dict[Any, Any] = {}
        for opt in self._optimizers:
            merged.update(opt.state)
        return merged

    def __getitem__(self, key: Any) -> Any:
        for opt in self._optimizers:
            if key in opt.state:
                return opt.state[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return any(key in opt.state for opt in self._optimizers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._merged())

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)

    def items(self):  # type: ignore[override]
        return self._merged().items()

    def keys(self):  # type: ignore[override]
        return self._merged().keys()

    def values(self):  # type: ignore[override]
        return self._merged().values()

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


def _placeholder() -> Any:
    import torch

    return torch.nn.Parameter(torch.zeros(0))


class LRSchedulersContainer:
    """Schedulers of the model parts (one per part's optimizer), stepped together.

    ``state_dict`` is the state of the first part's scheduler, because every part's is the same:
    a checkpoint holds one scheduler state, the same as a run without parts writes, and
    ``load_state_dict`` gives each part its own copy (rebased on that part's own learning rates when
    the part has another number of param groups than the saved scheduler had).
    """

    def __init__(self, schedulers: Sequence[Any], optimizer: OptimizersContainer) -> None:
        if not schedulers:
            raise ValueError("LRSchedulersContainer needs at least one scheduler.")
        self.schedulers = list(schedulers)
        self.optimizer = optimizer

    def __len__(self) -> int:
        return len(self.schedulers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.schedulers)

    def step(self, *args: Any, **kwargs: Any) -> None:
        for scheduler in self.schedulers:
            scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return [lr for scheduler in self.schedulers for lr in scheduler.get_last_lr()]

    @property
    def last_epoch(self) -> int:
        return self.schedulers[0].last_epoch

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            # A scheduler keeps references into the dict it loads: each part gets its own copy.
            scheduler.load_state_dict(copy.deepcopy(state_dict))
            if len(getattr(scheduler, "base_lrs", ())) != len(scheduler.optimizer.param_groups):
                rebase_learning_rates(scheduler)

    def __repr__(self) -> str:
        inner = ", ".join(type(s).__name__ for s in self.schedulers)
        return f"LRSchedulersContainer({inner})"
