"""``Tuner``: the learning-rate range test and the batch-size search, as Lightning 2.x runs them.

Both searches run from a callback's ``on_fit_start`` (``LearningRateFinder``, ``BatchSizeFinder``;
``Tuner`` adds one, runs ``trainer.fit`` and ends the run when the search is done). A search trains
for real, so it must leave nothing behind: before it, the run is written to a temporary checkpoint
``.lr_find_<uuid>.ckpt`` / ``.scale_batch_size_<uuid>.ckpt`` in ``default_root_dir`` through
``trainer.save_checkpoint``; after it (even after an error) the checkpoint is restored through
``restore_checkpoint`` (weights, optimizer and scheduler states, callback states) and removed, and
what a checkpoint does not hold (the loop counters as they stood, the Trainer's limits, callbacks,
loggers, dataloaders, metrics, the random generators) is put back from :class:`_Search`'s snapshot.
Only the result survives: the learning rate or batch size attribute, and the finder's record.

Deviations from Lightning, each where Lightning's result is wrong: the first batch-size trial runs
at ``init_val`` (Lightning's reuses a loader built at the module's size before ``init_val`` was set);
steps count from the step a search began at, for the loss smoothing and the divergence test of
``lr_find`` (Lightning counts the run's, so a search later in a run stops after one step) and for
a trial's ``max_steps``. Missing attributes raise ``MisconfigurationException`` (Lightning's:
``AttributeError``). For ``validate``/``test``/``predict`` from a ``BatchSizeFinder`` that does
not end the run, the size found applies from the next call (the loop under way keeps its loaders).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.callbacks.base import Callback
    from trainer_core.datamodule import LightningDataModule
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

__all__ = [
    "Tuner",
    "is_oom_error",
    "lightning_getattr",
    "lightning_hasattr",
    "lightning_setattr",
]

_logger = logging.getLogger("trainer_core")

_METHODS = ("fit", "validate", "test", "predict")
# The stage of each method: the attribute prefix of its dataloaders and limits, and its loop's name.
_EVAL_KINDS = {"validate": ("val", "validation"), "test": ("test", "test"), "predict": ("predict", "predict")}
_LR_ATTRIBUTES = ("lr", "learning_rate")


# ---------------------------------------------------------------------------------------------- attributes
def _attr_holders(model: LightningModule, attribute: str) -> list[Any]:
    """Where ``attribute`` lives, in Lightning's order: the module, its hparams, the datamodule, its hparams."""
    holders: list[Any] = []
    if hasattr(model, attribute):
        holders.append(model)
    if attribute in getattr(model, "hparams", {}):
        holders.append(model.hparams)
    trainer = model._trainer
    datamodule = trainer.datamodule if trainer is not None else None
    if datamodule is not None:
        if hasattr(datamodule, attribute):
            holders.append(datamodule)
        if attribute in getattr(datamodule, "hparams", {}):
            holders.append(datamodule.hparams)
    return holders


def lightning_hasattr(model: LightningModule, attribute: str) -> bool:
    """Whether the module, its ``hparams``, the datamodule or its ``hparams`` has ``attribute``."""
    return bool(_attr_holders(model, attribute))


def lightning_getattr(model: LightningModule, attribute: str) -> Any:
    """``attribute`` from the last of its holders (the datamodule wins over the module, as in Lightning)."""
    holders = _attr_holders(model, attribute)
    if not holders:
        raise AttributeError(
            f"{attribute} is neither stored in the model namespace nor the `hparams` namespace/dict, nor the datamodule."
        )
    holder = holders[-1]
    return holder[attribute] if isinstance(holder, dict) else getattr(holder, attribute)


def lightning_setattr(model: LightningModule, attribute: str, value: Any) -> None:
    """Set ``attribute`` on every holder, so the module, its hparams and the datamodule agree."""
    holders = _attr_holders(model, attribute)
    if not holders:
        raise AttributeError(
            f"{attribute} is neither stored in the model namespace nor the `hparams` namespace/dict, nor the datamodule."
        )
    for holder in holders:
        if isinstance(holder, dict):
            holder[attribute] = value
        else:
            setattr(holder, attribute, value)


# ---------------------------------------------------------------------------------------------- memory
def is_oom_error(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error (CUDA, cuDNN's, or the CPU allocator's), by Lightning's rule."""
    if not isinstance(exception, RuntimeError) or len(exception.args) != 1:
        return False
    message = exception.args[0]
    if not isinstance(message, str):
        return False
    return (
        ("CUDA" in message and "out of memory" in message)
        or "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED." in message
        or "DefaultCPUAllocator: can't allocate memory" in message
    )


def _free_memory(failed: bool = False) -> None:
    """Release what the last trial held, so the next one starts from the same free memory.

    After a failed trial the error's frames may keep its tensors alive in reference cycles: a full
    collection frees them. Otherwise only a CUDA cache needs emptying; on the CPU tensors are freed
    as soon as they are dropped, and a full collection (Lightning runs one before every trial) can
    cost more than the trial itself.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if failed or cuda:
        gc.collect()
    if cuda:
        try:
            torch.cuda.empty_cache()
        except RuntimeError as err:  # emptying the cache can itself run out of memory
            if not is_oom_error(err):
                raise


# ---------------------------------------------------------------------------------------------- state
class _Search:
    """The run before a search, put back after it: the checkpoint for what it holds, a snapshot for the rest.

    ``with _Search(trainer, "lr_find") as search:`` writes the checkpoint and takes the snapshot; the
    body changes the Trainer as the search needs (``callbacks``, limits, schedulers) and calls
    :meth:`use_callbacks`; on leaving, the Trainer's settings come back first (so the checkpoint's
    callback and scheduler states load into the user's objects), then the checkpoint, then the loop
    counters and generators as they stood.
    """

    def __init__(self, trainer: Trainer, prefix: str) -> None:
        self.trainer = trainer
        path = os.path.join(trainer.default_root_dir, f".{prefix}_{uuid.uuid4()}.ckpt")
        self.path: str = trainer.plugin.broadcast(path)
        self._saved: list[tuple[Any, str, Any]] = []
        self._progress: dict[str, Any] = {}
        self._metric_dicts: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self._rng: Optional[dict[str, Any]] = None
        # The progress bar this search turned off (turned on again after it).
        self._bar: Any = None
        self._ckpt_path: Optional[str] = None
        self._loop_state: Optional[dict[str, Any]] = None

    def __enter__(self) -> _Search:
        from trainer_core.checkpoint.rng import collect_rng_states

        t = self.trainer
        self._rng = collect_rng_states()
        t.save_checkpoint(self.path)
        t.plugin.checkpoint_io.wait()
        targets: list[tuple[Any, tuple[str, ...]]] = [
            (
                t,
                (
                    "callbacks",
                    "loggers",
                    "max_steps",
                    "limit_train_batches",
                    "limit_val_batches",
                    "limit_test_batches",
                    "limit_predict_batches",
                    "should_stop",
                    "ckpt_path",
                    "train_dataloader",
                    "num_training_batches",
                    "val_check_batch",
                    "val_dataloaders",
                    "num_val_batches",
                    "test_dataloaders",
                    "num_test_batches",
                    "predict_dataloaders",
                    "num_predict_batches",
                ),
            ),
            (t.plugin, ("lr_scheduler_configs",)),
            (t.hook_runner, ("batch", "after_closure", "current_fx")),
            (t.metrics, ("results", "train_results", "eval_step")),
        ]
        self._saved = [(obj, name, getattr(obj, name)) for obj, names in targets for name in names]
        # The fit loop's own state (its validation loaders, which loader is fresh): all of it comes back.
        self._loop_state = dict(vars(t.fit_loop)) if t.fit_loop is not None else None
        progress = t.progress
        self._progress = {name: copy.deepcopy(getattr(progress, name)) for name in _slots(progress)}
        metrics = t.metrics
        # What the loggers were sent comes back; what the search logged stays readable in callback_metrics and
        # progress_bar_metrics until the next run clears them, as in Lightning.
        self._metric_dicts = [(metrics.logged, dict(metrics.logged))]
        self._ckpt_path = t.ckpt_path
        bar = t.progress_bar_callback
        if bar is not None and getattr(bar, "is_enabled", False) and callable(getattr(bar, "disable", None)):
            self._bar = bar
            bar.disable()
        # What the search logs goes to a collection of its own; the loggers see none of it.
        from trainer_core.results import ResultCollection

        metrics.train_results = ResultCollection(training=True)
        metrics.train_results.plugin = t.plugin
        t.loggers = []
        return self

    def use_callbacks(self, callbacks: list[Callback]) -> None:
        """Run the search with only ``callbacks`` (Lightning's rule: the user's callbacks sit it out)."""
        from trainer_core.hooks import BatchHooks

        t = self.trainer
        t.callbacks = callbacks
        t.hook_runner.batch = BatchHooks(t, t.lightning_module, callbacks)
        t.hook_runner.after_closure = t.hook_runner.make_after_closure(t.lightning_module)

    def reset_progress(self) -> None:
        """The loop counters as they stood when the search began (before each batch-size trial)."""
        progress = self.trainer.progress
        for name, value in self._progress.items():
            setattr(progress, name, copy.deepcopy(value))

    def __exit__(self, *exc: Any) -> None:
        from trainer_core.checkpoint.restore import restore_checkpoint
        from trainer_core.checkpoint.rng import apply_rng_states

        t = self.trainer
        for obj, name, value in self._saved:
            setattr(obj, name, value)
        if self._loop_state is not None:
            vars(t.fit_loop).clear()
            vars(t.fit_loop).update(self._loop_state)
        try:
            restore_checkpoint(t, self.path)
        finally:
            t.plugin.remove_checkpoint(self.path)
            # The restore set the run up to continue from the checkpoint; the run continues from here.
            self.reset_progress()
            for live, saved in self._metric_dicts:
                live.clear()
                live.update(saved)
            t.ckpt_path = self._ckpt_path
            t.should_stop = False
            if self._bar is not None:
                self._bar.enable()
            assert self._rng is not None
            apply_rng_states(self._rng)


def _slots(obj: Any) -> list[str]:
    names: list[str] = []
    for cls in type(obj).__mro__:
        names.extend(getattr(cls, "__slots__", ()))
    return names or list(vars(obj))


def _fit_loop(trainer: Trainer, what: str) -> Any:
    loop = trainer.fit_loop
    if trainer.state_stage != "fit" or loop is None:
        raise MisconfigurationException(
            f"{what} runs inside `trainer.fit`; call it from a hook of a fit run."
        )
    return loop


def _train(trainer: Trainer) -> None:
    """One pass of Lightning's ``fit_loop.run()`` under the search's settings (validation loaders made anew)."""
    loop = trainer.fit_loop
    loop.val_loaders = None
    loop.train()


# ---------------------------------------------------------------------------------------------- learning rate
class _LRFinder:
    """What ``lr_find`` found: ``results`` (``{"lr": [...], "loss": [...]}``), a suggestion, a plot.

    Args:
        mode: ``"exponential"`` or ``"linear"``: how the learning rate grows after each step.
        lr_min: the learning rate of the first step.
        lr_max: the learning rate the schedule reaches after ``num_training`` steps.
        num_training: the number of steps (learning rates) to try.
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        if mode not in ("linear", "exponential"):
            raise MisconfigurationException(f"lr_find(mode={mode!r}): use 'exponential' or 'linear'.")
        self.mode = mode
        self.lr_min = lr_min
        self.lr_max = lr_max
        self.num_training = num_training
        self.results: dict[str, Any] = {}
        self._total_batch_idx = 0
        self._optimal_idx: Optional[int] = None

    def _exchange_scheduler(self, trainer: Trainer) -> None:
        """The optimizer starts at ``lr_min`` in every group; one step-interval scheduler raises it."""
        from trainer_core.optim import LRSchedulerConfig

        optimizers = trainer.plugin.optimizers
        if len(optimizers) != 1:
            raise MisconfigurationException(
                f"`configure_optimizers()` returned {len(optimizers)} optimizers, but the learning rate finder "
                "works with a single optimizer."
            )
        optimizer = optimizers[0]
        for group in optimizer.param_groups:
            group["lr"] = self.lr_min
            group["initial_lr"] = self.lr_min
        schedule = _LinearLR if self.mode == "linear" else _ExponentialLR
        scheduler = schedule(optimizer, self.lr_max, self.num_training)
        trainer.plugin.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval="step")]

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> Optional[float]:
        """The learning rate where the smoothed loss falls fastest (its most negative slope over the lr).

        ``skip_begin`` / ``skip_end`` points are left out at either end (too early to tell; already
        diverging). ``None`` (and an error in the log) when fewer than two finite points remain.
        """
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            _logger.error(
                "Failed to compute a learning rate suggestion: there are not enough points. Raise num_training "
                "or give the run more batches (limit_train_batches, max_epochs, the dataset's size)."
            )
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        steepest = int(torch.argmin(gradients).item())
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[steepest].item())
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the learning rate (log scale in exponential mode), the suggestion as a red dot.

        Returns the matplotlib figure (the one ``ax`` belongs to, when given).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise MisconfigurationException(
                "_LRFinder.plot needs matplotlib: `pip install matplotlib`."
            ) from err
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest:
            self.suggestion()
            if self._optimal_idx:
                ax.plot(
                    lrs[self._optimal_idx], losses[self._optimal_idx], markersize=10, marker="o", color="red"
                )
        if show:
            plt.show()
        return fig


class _LinearLR(LRScheduler):
    """From the optimizer's learning rate to ``end_lr`` in ``num_iter`` equal steps (Lightning's schedule).

    The first two steps both use the starting rate; step ``k >= 1`` then uses
    ``base + (k + 1) / num_iter * (end_lr - base)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, last_epoch: int = -1):
        self.end_lr = end_lr
        self.num_iter = num_iter
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        r = (self.last_epoch + 1) / self.num_iter
        if self.last_epoch > 0:
            val = [base + r * (self.end_lr - base) for base in self.base_lrs]
        else:
            val = list(self.base_lrs)
        self._lr = val
        return val

    @property
    def lr(self) -> list[float]:
        return self._lr


class _ExponentialLR(LRScheduler):
    """From the optimizer's learning rate to ``end_lr`` in ``num_iter`` geometric steps (Lightning's schedule).

    The first two steps both use the starting rate; step ``k >= 1`` then uses
    ``base * (end_lr / base) ** ((k + 1) / num_iter)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, last_epoch: int = -1):
        self.end_lr = end_lr
        self.num_iter = num_iter
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        r = (self.last_epoch + 1) / self.num_iter
        if self.last_epoch > 0:
            val = [base * (self.end_lr / base) ** r for base in self.base_lrs]
        else:
            val = list(self.base_lrs)
        self._lr = val
        return val

    @property
    def lr(self) -> list[float]:
        return self._lr


def _determine_lr_attr_name(model: LightningModule, attr_name: str = "") -> str:
    if attr_name:
        if not lightning_hasattr(model, attr_name):
            raise MisconfigurationException(
                f"lr_find(attr_name={attr_name!r}): {type(model).__name__} has no attribute {attr_name!r}, in "
                "itself, its `hparams`, or the datamodule. Name the attribute that holds the learning rate."
            )
        return attr_name
    for name in _LR_ATTRIBUTES:
        if lightning_hasattr(model, name):
            return name
    raise MisconfigurationException(
        f"The learning rate finder looked for one of {_LR_ATTRIBUTES} on {type(model).__name__} and its "
        "`hparams` and found none. Store the learning rate there (and read it in `configure_optimizers`), set "
        "`lr_find(attr_name=...)` to the name you use, or pass `update_attr=False`."
    )


def _lr_find(
    trainer: Trainer,
    model: LightningModule,
    min_lr: float = 1e-8,
    max_lr: float = 1,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: Optional[float] = 4.0,
    update_attr: bool = False,
    attr_name: str = "",
) -> Optional[_LRFinder]:
    """The range test: ``num_training`` steps from ``min_lr`` to ``max_lr``, then the run as it was.

    With ``update_attr``, the suggestion becomes the module's learning rate attribute and every
    optimizer group's ``lr``, after the run is put back, so the training that follows uses it.
    """
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping the learning rate finder: `fast_dev_run` is on.")
        return None
    _fit_loop(trainer, "The learning rate finder")
    if update_attr:
        attr_name = _determine_lr_attr_name(model, attr_name)
    lr_finder = _LRFinder(mode, min_lr, max_lr, num_training)
    start_step = trainer.global_step
    from trainer_core.callbacks.lr_finder import _LRCallback

    callback = _LRCallback(
        num_training, early_stop_threshold, show_progress=trainer.progress_bar_callback is not None
    )
    finished = False
    with _Search(trainer, "lr_find") as search:
        try:
            search.use_callbacks([callback])
            callback.start_step = start_step
            trainer.max_steps = num_training + start_step
            trainer.limit_val_batches = num_training
            lr_finder._exchange_scheduler(trainer)
            _train(trainer)
        finally:
            callback.close()
        if trainer.global_step != num_training + start_step:
            _logger.info(
                f"The learning rate finder stopped early after {trainer.global_step - start_step} steps: the loss diverged."
            )
        lr_finder.results = trainer.plugin.broadcast({"lr": callback.lrs, "loss": callback.losses})
        lr_finder._total_batch_idx = trainer.total_batch_idx
        finished = True
    if update_attr and finished:
        lr = lr_finder.suggestion()
        if lr is not None:
            lightning_setattr(model, attr_name, lr)
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            _logger.info(f"Learning rate set to {lr}")
    return lr_finder


# ---------------------------------------------------------------------------------------------- batch size
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


# ---------------------------------------------------------------------------------------------- Tuner
class Tuner:
    """Finds a learning rate (:meth:`lr_find`) or a batch size (:meth:`scale_batch_size`) for a Trainer's run.

    Each method adds its finder callback to the Trainer, runs the entry point (``fit`` for the
    learning rate; ``method`` for the batch size), which ends once the search is done, and removes
    the callback again. The model comes back exactly as it went in, but for the attribute found.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def scale_batch_size(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Optional[LightningDataModule] = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> Optional[int]:
        """The largest batch size that runs ``steps_per_trial`` steps without running out of memory.

        ``mode="power"`` doubles the size until a trial fails, then halves it; ``"binsearch"``
        then bisects between the last size that fit and the first that failed, and gives
        ``margin`` back (5% by default). The size is set on ``batch_arg_name`` of the module, its
        hparams or the datamodule (wherever it is), whose dataloader hook must read it: loaders
        passed to ``fit`` directly cannot change their batch size.
        """
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        _check_scale_batch_size_configuration(self._trainer)
        from trainer_core.callbacks.batch_size_finder import BatchSizeFinder

        finder = BatchSizeFinder(
            mode=mode,
            steps_per_trial=steps_per_trial,
            init_val=init_val,
            max_trials=max_trials,
            batch_arg_name=batch_arg_name,
            margin=margin,
            max_val=max_val,
        )
        finder._early_exit = True
        self._run_with(finder, model, method, train_dataloaders, val_dataloaders, dataloaders, datamodule)
        return finder.optimal_batch_size

    def lr_find(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Optional[LightningDataModule] = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: Optional[float] = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> Optional[_LRFinder]:
        """A learning rate range test: ``num_training`` steps from ``min_lr`` up to ``max_lr``.

        ``mode`` grows the rate ``"exponential"``-ly or ``"linear"``-ly; the search stops early when
        the smoothed loss exceeds ``early_stop_threshold`` times the best (``None``: never). With
        ``update_attr``, the suggestion is written to ``attr_name`` (found by itself: ``lr`` or
        ``learning_rate``, on the module or its hparams). Returns the finder: ``results``,
        ``suggestion()``, ``plot()``; ``None`` under ``fast_dev_run``.
        """
        if method != "fit":
            raise MisconfigurationException("method='fit' is the only valid configuration to run lr finder.")
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        _check_lr_find_configuration(self._trainer)
        from trainer_core.callbacks.lr_finder import LearningRateFinder

        finder = LearningRateFinder(
            min_lr=min_lr,
            max_lr=max_lr,
            num_training_steps=num_training,
            mode=mode,
            early_stop_threshold=early_stop_threshold,
            update_attr=update_attr,
            attr_name=attr_name,
        )
        finder._early_exit = True
        self._run_with(finder, model, "fit", train_dataloaders, val_dataloaders, None, datamodule)
        return finder.optimal_lr

    def _run_with(
        self,
        finder: Callback,
        model: LightningModule,
        method: str,
        train_dataloaders: Any,
        val_dataloaders: Any,
        dataloaders: Any,
        datamodule: Optional[LightningDataModule],
    ) -> None:
        trainer = self._trainer
        trainer.callbacks = [finder, *trainer.callbacks]
        try:
            if method == "fit":
                trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
            elif method == "validate":
                trainer.validate(model, dataloaders, datamodule=datamodule)
            elif method == "test":
                trainer.test(model, dataloaders, datamodule=datamodule)
            else:
                trainer.predict(model, dataloaders, datamodule=datamodule)
        finally:
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]


def _check_tuner_configuration(
    train_dataloaders: Any, val_dataloaders: Any, dataloaders: Any, method: str
) -> None:
    if method not in _METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {_METHODS}.")
    if method == "fit":
        if dataloaders is not None:
            raise MisconfigurationException(
                f"In tuner with method={method!r}, `dataloaders` argument should be None,"
                " please consider setting `train_dataloaders` and `val_dataloaders` instead."
            )
    elif train_dataloaders is not None or val_dataloaders is not None:
        raise MisconfigurationException(
            f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders`"
            " arguments should be None, please consider setting `dataloaders` instead."
        )


def _check_lr_find_configuration(trainer: Trainer) -> None:
    from trainer_core.callbacks.lr_finder import LearningRateFinder

    if any(isinstance(cb, LearningRateFinder) for cb in trainer.callbacks):
        raise ValueError(
            "Trainer is already configured with a `LearningRateFinder` callback. "
            "Please remove it if you want to use the Tuner."
        )


def _check_scale_batch_size_configuration(trainer: Trainer) -> None:
    if trainer.world_size > 1:
        raise ValueError("Tuning the batch size is currently not supported with distributed strategies.")
    from trainer_core.callbacks.batch_size_finder import BatchSizeFinder

    if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
        raise ValueError(
            "Trainer is already configured with a `BatchSizeFinder` callback. "
            "Please remove it if you want to use the Tuner."
        )
