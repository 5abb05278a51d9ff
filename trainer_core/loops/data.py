"""Where a stage's batches come from: its dataloaders, how many batches it takes, how a batch reaches the device."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from lightning_utilities.core.overrides import is_overridden

from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer

_KIND_HOOK = {
    "train": "train_dataloader",
    "val": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def resolve_dataloaders(trainer: Trainer, kind: str, given: Any) -> list[Any]:
    """The dataloaders of ``kind``: given to the entry point, else the datamodule's, else the module's."""
    hook = _KIND_HOOK[kind]
    if given is None:
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden(hook, datamodule, LightningDataModule):
            given = getattr(datamodule, hook)()
        elif datamodule is not None and kind == "train":
            raise MisconfigurationException(
                f"{type(datamodule).__name__} does not define `train_dataloader`, which `fit` needs."
            )
        else:
            given = trainer.hook_runner.call_module(hook)
    loaders = list(given) if isinstance(given, (list, tuple)) else [given]
    if kind == "train" and len(loaders) != 1:
        raise MisconfigurationException(
            f"fit: training takes one dataloader, got {len(loaders)}; combine them into one dataset or loader."
        )
    for loader in loaders:
        if not hasattr(loader, "__iter__"):
            raise MisconfigurationException(
                f"`{hook}` returned a {type(loader).__name__}, which cannot be iterated; return a DataLoader."
            )
    return [
        trainer.plugin.process_dataloader(loader, kind, trainer.use_distributed_sampler) for loader in loaders
    ]


def num_batches(loader: Any, limit: Union[int, float], name: str) -> Union[int, float]:
    """Batches to draw from ``loader`` under ``limit`` (a number of batches or a fraction)."""
    try:
        length: Union[int, float] = len(loader)
    except (TypeError, NotImplementedError):
        length = float("inf")
    if isinstance(limit, int):
        return min(length, limit)
    if limit == 1.0:
        return length
    if math.isinf(length):
        if limit == 0.0:
            return 0
        raise MisconfigurationException(
            f"Trainer({name}={limit}) is a fraction, but the dataloader has no length; pass a number of batches instead."
        )
    count = int(length * limit)
    return max(count, 1) if limit > 0 and length > 0 else count


def with_last_flag(iterator: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``, looking one item ahead (for loaders without a length)."""
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True


def _transfer(trainer: Trainer, batch: Any, dataloader_idx: int) -> Any:
    call = trainer.hook_runner.call_module
    batch = call("on_before_batch_transfer", batch, dataloader_idx)
    batch = call("transfer_batch_to_device", batch, trainer.plugin.root_device, dataloader_idx)
    return call("on_after_batch_transfer", batch, dataloader_idx)


def batch_mover(trainer: Trainer) -> Optional[Callable[[Any, int], Any]]:
    """How a batch reaches the device: the user's hooks, the plugin, or (on the CPU) not at all."""
    if trainer.hook_runner.batch.batch_transfer:
        return lambda batch, idx: _transfer(trainer, batch, idx)
    if trainer.plugin.root_device.type != "cpu":
        move = trainer.plugin.batch_to_device
        return lambda batch, idx: move(batch)
    return None
