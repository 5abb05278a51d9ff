"""The run a search borrows: the checkpoint and snapshot taken before it and put back after it.

Both searches (``lr_find``, the batch-size search) share it, and the one pass of the fit loop they run.
"""

from __future__ import annotations

import copy
import os
import uuid
from typing import TYPE_CHECKING, Any, Optional

from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from trainer_core.callbacks.base import Callback
    from trainer_core.trainer import Trainer

_METHODS = ("fit", "validate", "test", "predict")


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
            restore_checkpoint(t.checkpoint_parts(), self.path)
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
