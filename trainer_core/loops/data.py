"""Where a stage's batches come from: its dataloaders, how many batches it takes, how a batch reaches the device."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn
from trainer_core.utilities.combined_loader import CombinedLoader, is_single_iterable
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from trainer_core.run_state import RunState

_KIND_HOOK = {
    "train": "train_dataloader",
    "val": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def _request(trainer: RunState, kind: str, given: Any) -> Any:
    """What the stage reads: given to the entry point, else the datamodule's hook, else the module's."""
    hook = _KIND_HOOK[kind]
    if given is not None:
        return given
    datamodule = trainer.datamodule
    if datamodule is not None and is_overridden(hook, datamodule, LightningDataModule):
        return getattr(datamodule, hook)()
    if datamodule is not None and kind == "train":
        raise MisconfigurationException(
            f"{type(datamodule).__name__} does not define `train_dataloader`, which `fit` needs."
        )
    return trainer.hook_runner.call_module(hook)


def _prepared(trainer: RunState, kind: str, loaders: list[Any]) -> list[Any]:
    """Each loader checked, put in order under ``overfit_batches``, and given the plugin's sampler."""
    hook = _KIND_HOOK[kind]
    for loader in loaders:
        if not hasattr(loader, "__iter__"):
            raise MisconfigurationException(
                f"`{hook}` returned a {type(loader).__name__}, which cannot be iterated; return a DataLoader."
            )
    if trainer.overfit_batches > 0 and kind in ("train", "val") and trainer.state_stage == "fit":
        loaders = [_in_order(trainer, loader, kind) for loader in loaders]
    return [
        trainer.plugin.process_dataloader(loader, kind, trainer.use_distributed_sampler) for loader in loaders
    ]


def resolve_train_dataloader(trainer: RunState, given: Any) -> tuple[Any, Any]:
    """The training data as the loop reads it, and as ``trainer.train_dataloader`` shows it.

    One loader is read as it is. A list, tuple or dict of loaders (nested too) is read through
    ``CombinedLoader(..., "max_size_cycle")`` and a ``CombinedLoader`` in its own mode, as Lightning
    does; each of their loaders gets the plugin's sampler, and the Trainer shows their structure.
    """
    given = _request(trainer, "train", given)
    if not isinstance(given, CombinedLoader) and is_single_iterable(given):
        (loader,) = _prepared(trainer, "train", [given])
        return loader, loader
    combined = given if isinstance(given, CombinedLoader) else CombinedLoader(given, "max_size_cycle")
    if combined.mode == "sequential":
        raise MisconfigurationException(
            'fit: training cannot read a CombinedLoader(mode="sequential"); use "min_size", "max_size_cycle" '
            'or "max_size".'
        )
    combined.flattened = _prepared(trainer, "train", combined.flattened)
    return combined, combined.iterables


def resolve_stage_dataloaders(trainer: RunState, kind: str, given: Any) -> tuple[list[Any], Any]:
    """An evaluation stage's loaders, each with its own ``dataloader_idx``, and the structure the Trainer shows.

    A list or tuple gives one loader per entry, as does a ``CombinedLoader(mode="sequential")`` (its
    flattened loaders); a ``CombinedLoader`` in another mode is one loader whose batches combine those
    of its loaders (prediction takes only the sequential mode, as in Lightning).
    """
    given = _request(trainer, kind, given)
    if isinstance(given, CombinedLoader):
        if given.mode == "sequential":
            given.flattened = _prepared(trainer, kind, given.flattened)
            return list(given.flattened), given.iterables
        if kind == "predict":
            raise MisconfigurationException(
                f'predict: a CombinedLoader(mode={given.mode!r}) cannot be predicted on; use mode="sequential".'
            )
        given.flattened = _prepared(trainer, kind, given.flattened)
        return [given], given.iterables
    loaders = _prepared(trainer, kind, list(given) if isinstance(given, (list, tuple)) else [given])
    return loaders, loaders[0] if len(loaders) == 1 else loaders


def resolve_dataloaders(trainer: RunState, kind: str, given: Any) -> list[Any]:
    """The loaders of ``kind`` (the training data as one loader or ``CombinedLoader``)."""
    if kind == "train":
        return [resolve_train_dataloader(trainer, given)[0]]
    return resolve_stage_dataloaders(trainer, kind, given)[0]


def _in_order(trainer: RunState, loader: Any, kind: str) -> Any:
    """``Trainer(overfit_batches=...)``: the loader without shuffling, so that every epoch sees the same batches.

    Lightning's rule, for the train and the val loaders of ``fit`` (each keeps its own data); a
    loader with a sampler of its own other than torch's ``RandomSampler`` is put in order too.
    """
    from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

    from trainer_core.plugins.parallel import loader_with_sampler

    sampler = getattr(loader, "sampler", None)
    if (
        not isinstance(loader, DataLoader)
        or isinstance(loader.dataset, IterableDataset)
        or isinstance(sampler, SequentialSampler)
    ):
        return loader
    setting = f"Trainer(overfit_batches={trainer.overfit_batches!r})"
    if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
        rank_zero_warn(
            f"{setting}: the {kind} dataloader has its own batch sampler ({type(loader.batch_sampler).__name__}), "
            "which is kept; if it shuffles, each epoch overfits other batches. Return a loader without shuffling."
        )
        return loader
    rank_zero_warn(
        f"{setting} trains on the same first batches every epoch, but the {kind} dataloader shuffles "
        f"({type(sampler).__name__}); it is read in order instead."
    )
    return loader_with_sampler(loader, SequentialSampler(loader.dataset))


def num_batches(loader: Any, limit: Union[int, float], name: str) -> Union[int, float]:
    """Batches to draw from ``loader`` under ``limit`` (a number of batches or a fraction).

    A ``CombinedLoader`` takes the limit for each of its loaders (Lightning's rule), and draws as many
    batches as its mode makes of those.
    """
    if isinstance(loader, CombinedLoader):
        loader.limits = [num_batches(dl, limit, name) for dl in loader.flattened]
        return _length(loader)
    length = _length(loader)
    return min(length, limit) if isinstance(limit, int) else _fraction(length, limit, name)


def has_length(loader: Any) -> bool:
    """Whether ``loader`` (each of a CombinedLoader's loaders) has a length."""
    each = loader.flattened if isinstance(loader, CombinedLoader) else (loader,)
    return not any(math.isinf(_length(dl)) for dl in each)


def _length(loader: Any) -> Union[int, float]:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return float("inf")


def _fraction(length: Union[int, float], limit: float, name: str) -> Union[int, float]:
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


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on each sampler of ``loader`` (of each of a CombinedLoader's loaders) that has one.

    A DistributedSampler reshuffles by it; a batch sampler's own sampler gets it too.
    """
    for each in loader.flattened if isinstance(loader, CombinedLoader) else (loader,):
        sampler = getattr(each, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
        inner = getattr(getattr(each, "batch_sampler", None), "sampler", None)
        if callable(getattr(inner, "set_epoch", None)) and inner is not sampler:
            inner.set_epoch(epoch)


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


def _transfer(trainer: RunState, hooks: tuple[Any, Any, Any], batch: Any, dataloader_idx: int) -> Any:
    """The batch through the run's three transfer hooks (each the data module's or the module's)."""
    before, transfer, after = hooks
    runner = trainer.hook_runner
    previous = runner.current_fx  # each named while it runs, as every hook the Trainer calls is
    try:
        runner.current_fx = "on_before_batch_transfer"
        batch = before(batch, dataloader_idx)
        runner.current_fx = "transfer_batch_to_device"
        batch = transfer(batch, trainer.plugin.root_device, dataloader_idx)
        runner.current_fx = "on_after_batch_transfer"
        return after(batch, dataloader_idx)
    finally:
        runner.current_fx = previous


def batch_mover(trainer: RunState) -> Optional[Callable[[Any, int], Any]]:
    """How a batch reaches the device: the user's hooks, the plugin, or (on the CPU) not at all.

    Under ``"bf16-true"``, ``"16-true"`` and ``"64-true"`` its floating tensors are first converted to the
    weights' dtype (before ``on_before_batch_transfer``, as in Lightning): the precision's ``convert_input``.
    """
    move = _device_mover(trainer)
    precision = trainer.plugin.precision
    if not precision.input_conversion_needed:
        return move
    convert = precision.convert_input
    if move is None:
        return lambda batch, idx: convert(batch)
    return lambda batch, idx: move(convert(batch), idx)


def _device_mover(trainer: RunState) -> Optional[Callable[[Any, int], Any]]:
    hooks = trainer.hook_runner.batch.batch_transfer
    if hooks:
        return lambda batch, idx: _transfer(trainer, hooks, batch, idx)
    if trainer.plugin.root_device.type != "cpu":
        move = trainer.plugin.batch_to_device
        return lambda batch, idx: move(batch)
    return None
