"""Small helpers the trainer layer shares, and Lightning's ``lightning.pytorch.utilities`` names users import."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from trainer_core.utilities.apply_func import apply_to_collection
from trainer_core.utilities.combined_loader import CombinedLoader
from trainer_core.utilities.rank_zero import (
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = [
    "AttributeDict",
    "CombinedLoader",
    "as_list",
    "cli_lightning_logo",
    "extract_batch_size",
    "grad_norm",
    "launcher_restart_count",
    "listing",
    "move_data_to_device",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "to_float",
]


def _rank_from_env() -> int:
    # A process started by torchrun or SLURM knows its rank before any plugin runs.
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None:
            return int(value)
    return 0


rank_zero_only.rank = getattr(rank_zero_only, "rank", _rank_from_env())


def launcher_restart_count() -> tuple[str, int]:
    """``(launcher, n)``: this process belongs to its launcher's ``n``-th restart of the job; ``("", 0)``: the first start.

    torchrun counts the restarts after a failure (``--max-restarts``); SLURM counts a job's requeues.
    """
    for launcher, variable in (("torchrun", "TORCHELASTIC_RESTART_COUNT"), ("SLURM", "SLURM_RESTART_COUNT")):
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 0:
            return launcher, int(value)
    return "", 0


class AttributeDict(dict):
    """A dict whose keys read as attributes, as Lightning's ``hparams`` do."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"'{type(self).__name__}' has no attribute '{key}'") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


def move_data_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory."""
    non_blocking = device.type == "cuda"

    def _move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)

    return apply_to_collection(batch, torch.Tensor, _move)


def extract_batch_size(batch: Any) -> int:
    """The size of the first dimension of the first tensor found in ``batch`` (1 if none).

    As Lightning's: other values (``None`` for a loader that has ended under ``CombinedLoader(mode="max_size")``,
    strings, numbers) are passed over, so that ``{"name": "a", "x": x}`` has ``len(x)`` samples.
    """
    size = _first_tensor_size(batch)
    return 1 if size is None else size


def _first_tensor_size(batch: Any) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return 1 if batch.ndim == 0 else batch.size(0)
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    elif isinstance(batch, str) or not isinstance(batch, Iterable):
        return None
    for value in batch:
        size = _first_tensor_size(value)
        if size is not None:
            return size
    return None


def to_float(value: Any) -> float:
    """A logged value as a Python float, for loggers and the progress bar."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return float(value)


def as_list(obj: Any) -> list[Any]:
    """``None`` -> ``[]``; a list or tuple -> a list; anything else -> a list of that one thing."""
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return [obj]


def listing(names: Sequence[str], limit: int = 20) -> str:
    """Names joined for an error message, cut after ``limit`` so a message stays readable."""
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... and {len(names) - limit} more"
    return shown


def grad_norm(
    module: nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, float]:
    """The ``norm_type`` norm of each parameter's gradient and of all of them together (Lightning's helper).

    Keys as Lightning's: ``grad_{norm}_norm{sep}{name}`` per parameter and ``grad_{norm}_norm_total``;
    log them from ``on_before_optimizer_step`` with ``self.log_dict(grad_norm(self, norm_type=2))``.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm(norm_type={norm_type}): use a positive number or 'inf'.")
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": p.grad.data.norm(norm_type)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        total = torch.tensor(list(norms.values())).norm(norm_type)
        norms[f"grad_{norm_type}_norm_total"] = total
    return norms


def cli_lightning_logo() -> None:
    """The banner a Lightning example prints first (``lightning.pytorch.cli_lightning_logo``): ours names trainer-core."""
    from trainer_core.__about__ import __version__

    print(f"\ntrainer-core {__version__}: a Lightning-style trainer\n")
