"""The batch-size search: ``_scale_batch_size``, its trials, and the power and binary-search schedules."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from trainer_core.errors import MisconfigurationException
from trainer_core.tuner.attributes import lightning_getattr, lightning_setattr
from trainer_core.tuner.memory import _free_memory, is_oom_error
from trainer_core.tuner.search import _METHODS, _Search, _train
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer

_logger = logging.getLogger("trainer_core")

# The stage of each method: the attribute prefix of its dataloaders and limits, and its loop's name.
_EVAL_KINDS = {"validate": ("val", "validation"), "test": ("test", "test"), "predict": ("predict", "predict")}


def _scale_batch_size(
    trainer: Trainer,
    mode: str = "power",
    steps_per_trial: int = 3,
    init_val: int = 2,
    max_trials: int = 25,
    batch_arg_name: str = "batch_size",
    margin: float = 0.05,
    max_val: int = 8192,
) -> Optional[int]:
    """The largest batch size whose trials of ``steps_per_trial`` steps run without running out of memory.

    Each trial runs the stage's loop (training for ``fit``, else the evaluation loop) with the size
    set on the attribute ``batch_arg_name``; the dataloaders are made again for each size, so the
    module's or datamodule's dataloader hook must read that attribute. The size found stays set.
    """
    if not 0.0 <= margin < 1.0:
        raise MisconfigurationException(f"scale_batch_size(margin={margin!r}): use a fraction in [0, 1).")
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping the batch size finder: `fast_dev_run` is on.")
        return None
    stage = trainer.state_stage
    if stage not in _METHODS:
        raise MisconfigurationException("The batch size finder runs inside fit, validate, test or predict.")
    with _Search(trainer, "scale_batch_size") as search:
        search.use_callbacks([])
        if stage == "fit":
            trainer.limit_train_batches = 1.0
            trainer.limit_val_batches = steps_per_trial
            trainer.max_steps = trainer.global_step + steps_per_trial
        else:
            setattr(trainer, f"limit_{_EVAL_KINDS[stage][0]}_batches", steps_per_trial)
        trial = _BatchSizeTrial(trainer, stage, search, batch_arg_name, max_val)
        new_size, _ = trial.adjust(value=init_val)
        if mode == "power":
            new_size = _run_power_scaling(trial, new_size, max_trials, max_val)
        elif mode == "binsearch":
            new_size = _run_binsearch_scaling(trial, new_size, max_trials, margin, max_val)
        else:
            raise MisconfigurationException(f"scale_batch_size(mode={mode!r}): use 'power' or 'binsearch'.")
        _free_memory()
        _logger.info(f"Finished batch size finder, will continue with full run using batch size {new_size}")
    return new_size


class _BatchSizeTrial:
    """Runs the stage's loop at the current batch size, and changes the size and the loaders with it."""

    def __init__(
        self, trainer: Trainer, stage: str, search: _Search, batch_arg_name: str, max_val: int
    ) -> None:
        self.trainer = trainer
        self.stage = stage
        self.search = search
        self.batch_arg_name = batch_arg_name
        self.max_val = max_val
        self._loaders: Optional[list[Any]] = None

    def run(self) -> None:
        t = self.trainer
        _free_memory()
        self.search.reset_progress()
        t.should_stop = False
        if self.stage == "fit":
            _train(t)
            return
        from trainer_core.loops import run_loop
        from trainer_core.loops.data import num_batches

        kind, prefix = _EVAL_KINDS[self.stage]
        loaders = self.loaders()
        limit_name = f"limit_{kind}_batches"
        limits = [num_batches(dl, getattr(t, limit_name), limit_name) for dl in loaders]
        run_loop(t, prefix, loaders, limits, log=False)

    def loaders(self) -> list[Any]:
        """The stage's loaders at the current size (made once per size; fit's loop makes its own)."""
        if self.stage == "fit" and self.trainer.train_dataloader is not None:
            return [self.trainer.train_dataloader]
        if self._loaders is None:
            from trainer_core.loops.data import resolve_dataloaders

            kind = "train" if self.stage == "fit" else _EVAL_KINDS[self.stage][0]
            loaders = resolve_dataloaders(self.trainer, kind, None)
            if len(loaders) > 1:
                raise MisconfigurationException(
                    f"The batch size finder cannot be used with multiple {kind} dataloaders."
                )
            self._loaders = loaders
        return self._loaders

    def reset_loaders(self) -> None:
        """The size changed: every loader is made again, at the new size, before the next trial."""
        self._loaders = None
        t = self.trainer
        if self.stage == "fit":
            t.train_dataloader = None

    def dataset_length(self) -> Optional[int]:
        lengths = []
        for loader in self.loaders():
            try:
                lengths.append(len(loader.dataset))
            except (AttributeError, TypeError, NotImplementedError):
                continue
        if not lengths:
            return None
        return max(lengths) if self.stage == "fit" else sum(lengths)

    def adjust(
        self, factor: float = 1.0, value: Optional[int] = None, desc: Optional[str] = None
    ) -> tuple[int, bool]:
        """Set the next size (``value``, or the current one times ``factor``, at most ``max_val``).

        Returns the size and whether it changed; it does not grow past the dataset's length.
        """
        model = self.trainer.lightning_module
        batch_size = lightning_getattr(model, self.batch_arg_name)
        length = self.dataset_length()
        if length is not None and batch_size >= length:
            _logger.info(
                f"The batch size {batch_size} is greater or equal than the length of your dataset: {length}."
            )
            return batch_size, False
        new_size = value if value is not None else int(batch_size * factor)
        if new_size > self.max_val:
            if desc:
                _logger.info(
                    f"Batch size {new_size} exceeds max_val limit {self.max_val}, capping at {self.max_val}"
                )
            new_size = self.max_val
        if desc:
            _logger.info(f"Batch size {batch_size} {desc}, trying batch size {new_size}")
        changed = new_size != batch_size
        lightning_setattr(model, self.batch_arg_name, new_size)
        self.reset_loaders()
        return new_size, changed


def _fits(trial: _BatchSizeTrial) -> bool:
    """Run one trial: whether it ran without an out-of-memory error (any other error propagates)."""
    try:
        trial.run()
    except RuntimeError as err:
        if not is_oom_error(err):
            raise
        return False
    return True


def _run_power_scaling(trial: _BatchSizeTrial, new_size: int, max_trials: int, max_val: int) -> int:
    """Double the size after each trial that fits; after the first that does not, halve it and stop."""
    any_success = False
    last_successful_size = new_size
    for i in range(max_trials):
        if new_size >= max_val:
            _logger.info(f"Reached the maximum batch size limit of {max_val}. Stopping search.")
            break
        if _fits(trial):
            last_successful_size = new_size
            if i + 1 >= max_trials:
                new_size = last_successful_size
                break
            new_size, changed = trial.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
            any_success = True
        else:
            _free_memory(failed=True)
            new_size, _ = trial.adjust(factor=0.5, desc="failed")
            if any_success:
                break
    return new_size


def _run_binsearch_scaling(
    trial: _BatchSizeTrial, new_size: int, max_trials: int, margin: float, max_val: int
) -> int:
    """Double the size until a trial runs out of memory, then bisect between the last fit and that size."""
    low = 1
    high: Optional[int] = None
    count = 0
    last_successful_size = new_size
    while True:
        if new_size >= max_val:
            _logger.info(f"Reached the maximum batch size limit of {max_val}. Stopping search.")
            break
        if _fits(trial):
            last_successful_size = new_size
            count += 1
            if count >= max_trials:
                new_size = last_successful_size
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                new_size, changed = trial.adjust(value=(high + low) // 2, desc="succeeded")
            else:
                new_size, changed = trial.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
        else:
            _free_memory(failed=True)
            high = new_size
            new_size, _ = trial.adjust(value=(high + low) // 2, desc="failed")
            if high - low <= 1:
                break
    if margin > 0:
        reduced = max(1, int(new_size * (1 - margin)))
        if reduced != new_size:
            _logger.info(f"Applying margin of {margin:.1%}, reducing batch size from {new_size} to {reduced}")
            new_size = reduced
            lightning_setattr(trial.trainer.lightning_module, trial.batch_arg_name, new_size)
    return new_size
