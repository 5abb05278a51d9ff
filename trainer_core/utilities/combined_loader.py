"""Several iterables read as one: Lightning's ``CombinedLoader`` and its four modes.

The iterables may be nested in dicts, lists and tuples (torch's tree utilities flatten them); each
batch comes out in the structure the iterables were given in. Iterating yields
``(batch, batch_idx, dataloader_idx)`` in every mode, as Lightning's does:

* ``min_size``: until the shortest iterable ends.
* ``max_size_cycle``: until the longest ends; the shorter ones start over when they end.
* ``max_size``: until the longest ends; an ended iterable gives ``None``.
* ``sequential``: each iterable to its end, one after the other; ``batch`` is that iterable's
  batch and ``dataloader_idx`` its place in :attr:`CombinedLoader.flattened`.

Iterables with ``state_dict`` / ``load_state_dict`` (torchdata's ``StatefulDataLoader``) keep their
position in checkpoints, each its own (:meth:`CombinedLoader.state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Literal, Optional, Union

from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from trainer_core.errors import MisconfigurationException

Mode = Literal["min_size", "max_size_cycle", "max_size", "sequential"]
Limit = Union[int, float]
_STATES = "loaders"
_ENDED = "ended"


def _is_leaf(node: Any) -> bool:
    """An iterable, or a container of numbers and strings (``[1, 2, 3]`` is one iterable, not three)."""
    if not isinstance(node, (list, tuple, dict)):
        return True
    children = node.values() if isinstance(node, dict) else node
    return all(isinstance(child, (int, float, str)) for child in children)


def _length(iterable: Any) -> Limit:
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return float("inf")


def _limited_lengths(iterables: list[Any], limits: Optional[list[Limit]]) -> list[Limit]:
    lengths = [_length(iterable) for iterable in iterables]
    if limits is None:
        return lengths
    return [min(length, limit) for length, limit in zip(lengths, limits)]


def is_stateful(iterable: Any) -> bool:
    """Whether ``iterable`` saves and loads its position (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(iterable, "state_dict", None)) and callable(
        getattr(iterable, "load_state_dict", None)
    )


class _Combination(Iterator[tuple[Any, int, int]]):
    """One pass of a mode over the flattened iterables: yields ``(batches or batch, batch_idx, dataloader_idx)``."""

    def __init__(self, iterables: list[Any], limits: Optional[list[Limit]]) -> None:
        self.iterables = iterables
        self.limits = limits
        self.iterators: list[Iterator[Any]] = []
        self.batch_idx = 0
        # Which iterables have ended in this pass (kept by the modes where that changes what comes next).
        self.ended: list[bool] = [False] * len(iterables)

    def start(self, ended: Optional[list[bool]] = None) -> None:
        self.iterators = [iter(iterable) for iterable in self.iterables]
        self.batch_idx = 0

    def length(self) -> Limit:
        raise NotImplementedError

    def _counted(self, batches: Any, dataloader_idx: int = 0) -> tuple[Any, int, int]:
        batch_idx = self.batch_idx
        self.batch_idx += 1
        return batches, batch_idx, dataloader_idx

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader's iterator cannot be pickled (a copy of a running iteration has no meaning).
        state = self.__dict__.copy()
        state["iterators"] = [None if isinstance(it, _BaseDataLoaderIter) else it for it in self.iterators]
        return state


class _MinSize(_Combination):
    def __next__(self) -> tuple[Any, int, int]:
        return self._counted([next(it) for it in self.iterators])

    def length(self) -> Limit:
        lengths = [_length(iterable) for iterable in self.iterables]
        return min(lengths + list(self.limits or ()))


class _MaxSizeCycle(_Combination):
    """Ends when every iterable has ended once; one that ends before then starts over."""

    def start(self, ended: Optional[list[bool]] = None) -> None:
        super().start()
        self.ended = [False] * len(self.iterables)

    def __next__(self) -> tuple[Any, int, int]:
        batches = []
        for i, iterator in enumerate(self.iterators):
            try:
                batches.append(next(iterator))
            except StopIteration:
                self.ended[i] = True
                if all(self.ended):
                    raise
                self.iterators[i] = iter(self.iterables[i])
                batches.append(next(self.iterators[i]))
        return self._counted(batches)

    def length(self) -> Limit:
        return max(_limited_lengths(self.iterables, self.limits))


class _MaxSize(_Combination):
    """Ends when the longest iterable ends; one that has ended gives ``None``.

    A pass resumed from a checkpoint (``ended`` given) leaves the iterables that had ended alone:
    they give ``None`` until the pass is over, as in the run that went on.
    """

    def start(self, ended: Optional[list[bool]] = None) -> None:
        self.ended = list(ended) if ended is not None else [False] * len(self.iterables)
        self.iterators = [iter(()) if done else iter(it) for it, done in zip(self.iterables, self.ended)]
        self.batch_idx = 0

    def __next__(self) -> tuple[Any, int, int]:
        batches: list[Any] = [None] * len(self.iterators)
        exhausted = True
        for i, iterator in enumerate(self.iterators):
            try:
                batches[i] = next(iterator)
                exhausted = False
            except StopIteration:
                self.ended[i] = True
        if exhausted:
            raise StopIteration
        return self._counted(batches)

    def length(self) -> Limit:
        return max(_limited_lengths(self.iterables, self.limits))


class _Sequential(_Combination):
    """Each iterable to its end (or its limit), one after the other; one iterator alive at a time."""

    def start(self, ended: Optional[list[bool]] = None) -> None:
        self.dataloader_idx = -1
        self._next_iterable()

    def _next_iterable(self) -> None:
        # Only the current loader's iterator exists, so that only its workers run.
        self.dataloader_idx += 1
        self.batch_idx = 0
        current = self.dataloader_idx < len(self.iterables)
        self.iterators = [iter(self.iterables[self.dataloader_idx])] if current else []

    def __next__(self) -> tuple[Any, int, int]:
        while self.iterators:
            limit = self.limits[self.dataloader_idx] if self.limits is not None else None
            if limit is None or self.batch_idx < limit:
                with contextlib.suppress(StopIteration):
                    return self._counted(next(self.iterators[0]), self.dataloader_idx)
            self._next_iterable()
        raise StopIteration

    def length(self) -> Limit:
        return sum(_limited_lengths(self.iterables, self.limits))


_MODES: dict[str, type[_Combination]] = {
    "min_size": _MinSize,
    "max_size_cycle": _MaxSizeCycle,
    "max_size": _MaxSize,
    "sequential": _Sequential,
}


class CombinedLoader(Iterable):
    """Iterables (nested dicts, lists and tuples of them) read together under one of four ``mode``\\ s.

    Lightning's class of the same name: the Trainer wraps a collection of training loaders in
    ``CombinedLoader(loaders, "max_size_cycle")``, and takes one given to ``fit``, ``validate``, ``test``
    or ``predict`` as it is (see the module's docstring for the modes).

    Example::

        loaders = {"a": DataLoader(range(6), batch_size=4), "b": DataLoader(range(15), batch_size=5)}
        for batch, batch_idx, dataloader_idx in CombinedLoader(loaders, "max_size_cycle"):
            ...  # batch == {"a": tensor, "b": tensor}; three batches, "a" starting over for the third
    """

    def __init__(self, iterables: Any, mode: Mode = "min_size") -> None:
        if mode not in _MODES:
            raise MisconfigurationException(
                f"CombinedLoader(mode={mode!r}) is not a mode; use one of {', '.join(map(repr, _MODES))}."
            )
        self._iterables = iterables
        self._flattened, self._spec = self._flatten(iterables)
        self._mode = mode
        self._limits: Optional[list[Limit]] = None
        self._iterator: Optional[_Combination] = None
        # From a checkpoint, for the next pass: the iterables that had ended in the saved pass, and the
        # states of those (left unloaded: an ended loader gives nothing more until the pass is over).
        self._resume_ended: Optional[list[bool]] = None
        self._held_states: dict[int, Any] = {}

    @staticmethod
    def _flatten(iterables: Any) -> tuple[list[Any], TreeSpec]:
        return tree_flatten(iterables, is_leaf=_is_leaf)

    # ------------------------------------------------------------------ what it holds
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def iterables(self) -> Any:
        """The iterables in the structure they were given in (with any loaders the Trainer replaced)."""
        return self._iterables

    @property
    def flattened(self) -> list[Any]:
        """The iterables as a flat list, in the order their batches are combined (and ``dataloader_idx``)."""
        return self._flattened

    @flattened.setter
    def flattened(self, flattened: list[Any]) -> None:
        if len(flattened) != len(self._flattened):
            raise ValueError(
                f"CombinedLoader.flattened: {len(flattened)} iterables given for {len(self._flattened)}; "
                "replace each iterable with one other."
            )
        self._iterables = tree_unflatten(flattened, self._spec)
        self._flattened = list(flattened)

    @property
    def sampler(self) -> Any:
        """Each iterable's ``sampler`` (``None`` where it has none), in the iterables' structure."""
        return tree_unflatten([getattr(it, "sampler", None) for it in self._flattened], self._spec)

    @property
    def batch_sampler(self) -> Any:
        """Each iterable's ``batch_sampler`` (``None`` where it has none), in the iterables' structure."""
        return tree_unflatten([getattr(it, "batch_sampler", None) for it in self._flattened], self._spec)

    @property
    def limits(self) -> Optional[list[Limit]]:
        """The most batches to take from each iterable (``None``: no limit); the Trainer's ``limit_*_batches``."""
        return self._limits

    @limits.setter
    def limits(self, limits: Optional[Union[Limit, list[Limit]]]) -> None:
        if isinstance(limits, (int, float)):
            limits = [limits] * len(self._flattened)
        elif limits is not None and len(limits) != len(self._flattened):
            raise ValueError(
                f"CombinedLoader.limits: {len(limits)} limits given for {len(self._flattened)} iterables."
            )
        self._limits = None if limits is None else list(limits)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> CombinedLoader:
        iterator = _MODES[self._mode](self._flattened, self._limits)
        ended, self._resume_ended = self._resume_ended, None
        if ended is None:
            self._held_states = {}
        iterator.start(ended)
        self._iterator = iterator
        return self

    def __next__(self) -> tuple[Any, int, int]:
        if self._iterator is None:
            raise RuntimeError("Call `iter(combined_loader)` before `next`.")
        batches, batch_idx, dataloader_idx = next(self._iterator)
        if self._mode == "sequential":
            return batches, batch_idx, dataloader_idx
        return tree_unflatten(batches, self._spec), batch_idx, dataloader_idx

    def __len__(self) -> int:
        """Batches in one pass under the mode and the limits; a ``TypeError`` where that is not finite."""
        length = _MODES[self._mode](self._flattened, self._limits).length()
        return length  # type: ignore[return-value]  # a float (inf) makes len() raise TypeError, as for Lightning's

    def reset(self) -> None:
        """Forget the pass under way and stop the iterables' worker processes."""
        self._iterator = None
        for iterable in self._flattened:
            iterator = getattr(iterable, "_iterator", None)
            if isinstance(iterator, _MultiProcessingDataLoaderIter):
                iterator._shutdown_workers()
            if hasattr(iterable, "_iterator"):
                iterable._iterator = None

    # ------------------------------------------------------------------ position in checkpoints
    def _stateful(self) -> list[int]:
        return [i for i, iterable in enumerate(self._flattened) if is_stateful(iterable)]

    def _state_dicts(self) -> list[dict[str, Any]]:
        """The state of each stateful iterable, in the order of :attr:`flattened` (Lightning's record)."""
        held = self._held_states
        return [held[i] if i in held else self._flattened[i].state_dict() for i in self._stateful()]

    def _load_state_dicts(self, states: list[dict[str, Any]], ended: Optional[list[bool]] = None) -> None:
        self._held_states = {}
        if not states:
            return
        stateful = self._stateful()
        if len(stateful) != len(states):
            raise MisconfigurationException(
                f"The checkpoint holds the positions of {len(states)} stateful loaders, but the CombinedLoader has "
                f"{len(stateful)}; resume with the same training loaders as the saved run."
            )
        for i, state in zip(stateful, states):
            if ended is not None and ended[i]:
                self._held_states[i] = state
            else:
                self._flattened[i].load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Where each stateful iterable stands (the others start their pass again on resume).

        Under ``max_size`` it also says which iterables have ended in this pass, so that a resumed pass
        gives ``None`` for them until its end, as the pass that went on does.
        """
        state: dict[str, Any] = {_STATES: self._state_dicts()}
        if self._mode == "max_size" and self._iterator is not None:
            state[_ENDED] = list(self._iterator.ended)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put each stateful iterable back where :meth:`state_dict` found it; the next ``iter`` continues there."""
        ended = state_dict.get(_ENDED)
        if ended is not None and len(ended) != len(self._flattened):
            ended = None
        self._load_state_dicts(state_dict.get(_STATES, []), ended)
        self._resume_ended = ended


def is_single_iterable(iterables: Any) -> bool:
    """Whether ``iterables`` is one iterable rather than a collection of them (a list of loaders, a dict...)."""
    return _is_leaf(iterables)
