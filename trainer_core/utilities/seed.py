"""Lightning's ``utilities.seed`` path: seeding, and a block whose random draws leave the generators as they were."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trainer_core.checkpoint.rng import apply_rng_states, collect_rng_states
from trainer_core.seed import seed_everything

__all__ = ["isolate_rng", "seed_everything"]


@contextmanager
def isolate_rng(include_cuda: bool = True) -> Iterator[None]:
    """Within the block, draw from Python's, NumPy's and torch's generators; after it, they are as before.

    For draws that must not change a run's random stream (a sample plotted in a callback, an extra
    validation). ``include_cuda=False`` leaves the CUDA generators alone, for a forked process where
    CUDA may not start. Unlike Lightning's, the states come back when the block raises too.
    """
    states = collect_rng_states()
    states.pop("cuda", None)
    cuda = torch.cuda.get_rng_state_all() if include_cuda and torch.cuda.is_available() else None
    try:
        yield
    finally:
        apply_rng_states(states)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
