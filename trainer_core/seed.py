"""Seeding every generator a run draws from."""

from __future__ import annotations

import logging
import os
import random
from typing import Optional

import numpy as np
import torch

from trainer_core.utilities.rank_zero import rank_zero_only, rank_zero_warn

_MAX_SEED = np.iinfo(np.uint32).max


def seed_everything(seed: Optional[int] = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's, NumPy's and torch's generators and export the seed to child processes.

    ``workers=True`` also sets ``PL_SEED_WORKERS`` so that DataLoader workers are seeded from
    the global seed, as in Lightning. Without ``seed``: ``PL_GLOBAL_SEED``, else 0 with a warning
    (Lightning's rule). Returns the seed used.
    """
    if seed is None:
        env = os.environ.get("PL_GLOBAL_SEED")
        if env is None:
            # Lightning's rule (2.x): no seed given anywhere means 0, said out loud, so two runs agree.
            seed = 0
            rank_zero_warn(f"seed_everything(): no seed given and no PL_GLOBAL_SEED set; seed set to {seed}.")
        else:
            seed = int(env)
    seed = int(seed)
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed_everything(seed={seed}): the seed must be in [0, {_MAX_SEED}].")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if verbose and rank_zero_only.rank == 0:
        logging.getLogger("trainer_core").info(f"Seed set to {seed}")
    return seed
