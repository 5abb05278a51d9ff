"""The random generators a training step may draw from, saved and put back for an exact resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def collect_rng_states() -> dict[str, Any]:
    """Every generator a training step may draw from, as plain tensors and tuples."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _numpy_state() -> tuple[Any, ...]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # A tensor and plain numbers load under weights_only without any numpy global.
    return (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def apply_rng_states(states: dict[str, Any]) -> None:
    """Put back what ``collect_rng_states`` returned."""
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
