"""Validation, test and prediction: one loop over the stage's dataloaders, three uses.

Validation and test log into a fresh :class:`~trainer_core.results.ResultCollection` and return
each loader's epoch metrics; prediction logs nothing and collects the step outputs. The hooks,
the batch transfer, the limits and the gradient mode are the same for all three.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch.utils.data import DataLoader

from trainer_core.callback_queries import prediction_writer_intervals
from trainer_core.checkpoint.restore import restore_checkpoint
from trainer_core.datamodule import log_stage_hyperparameters
from trainer_core.errors import MisconfigurationException
from trainer_core.hooks import check_dataloader_idx, step_caller
from trainer_core.loops.data import batch_mover, num_batches, resolve_stage_dataloaders, set_sampler_epoch
from trainer_core.module import LightningModule
from trainer_core.profilers.base import profiled, profiled_iter
from trainer_core.results import ResultCollection
from trainer_core.utilities import rank_zero_warn
from trainer_core.utilities.combined_loader import CombinedLoader
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from trainer_core.run_state import RunState

_STEP = {"validation": "validation_step", "test": "test_step", "predict": "predict_step"}


def run_loop(
    trainer: RunState,
    prefix: str,
    loaders: list[Any],
    limits: list[Union[int, float]],
    log: bool = False,
    step: Optional[int] = None,
    keep_predictions: bool = False,
) -> list[Any]:
    """One pass of ``prefix`` (``validation``, ``test`` or ``predict``) over ``loaders``.

    Returns one dict of epoch metrics per loader (validation and test), or one list of step outputs
    per loader (prediction; empty lists unless ``keep_predictions``).
    """
    module = trainer.lightning_module
    assert module is not None
    plugin = trainer.plugin
    runner = trainer.hook_runner
    hooks = runner.batch
    metrics = trainer.metrics
    step_name = _STEP[prefix]
    step_fn = step_caller(trainer, step_name, getattr(plugin, step_name))
    if plugin.defines_step(step_name) and is_overridden(step_name, module, LightningModule):
        check_dataloader_idx(getattr(module, step_name), step_name, len(loaders))
    batch_start = getattr(hooks, f"on_{prefix}_batch_start")
    batch_end = getattr(hooks, f"on_{prefix}_batch_end")
    move = batch_mover(trainer)
    precision = plugin.precision
    # With a profiler on (decided per run), each step and each batch fetch are recorded (Lightning's names).
    profiler = runner.profiler
    if profiler is not None:
        step_fn = profiled(profiler, f"[Strategy]{type(plugin).__name__}.{step_name}", step_fn)
        loop_name = "[_PredictionLoop]" if prefix == "predict" else "[_EvaluationLoop]"
        fetch_action = f"{loop_name}.{'val' if prefix == 'validation' else prefix}_next"
    predicting = prefix == "predict"
    # ``trainer.predict_loop.current_batch_indices``: kept up to date only for a writer that writes per batch.
    track_indices = predicting and trainer.predict_loop.tracks_current_batch

    # Lightning's rule: each submodule gets its own mode back (a frozen backbone the user put in eval mode stays
    # there), unless the module overrides the hook that puts it back in training mode.
    train_hook = f"on_{prefix}_model_train"
    custom_train_hook = not predicting and is_overridden(train_hook, module, LightningModule)
    modes = None if custom_train_hook else [(m, m.training) for m in module.modules()]
    if trainer.state_stage == "fit":
        # Lightning's rule: validation samplers follow the training epoch too (a sampler may shuffle by it).
        for loader in loaders:
            set_sampler_epoch(loader, trainer.progress.current_epoch)
    # The first loader's pass starts before the stage's hooks, as Lightning's does (a DataLoader draws
    # its seed from torch's generator then; with workers, its sampler runs then too).
    first = iter(_batches_of(loaders[0])) if loaders and any(limits) else None
    runner.call_module(f"on_{prefix}_model_eval")
    runner.call(f"on_{prefix}_start")
    results: Optional[ResultCollection] = None
    if not predicting:
        results = ResultCollection(training=False)
        results.plugin = plugin
        metrics.results = results
    multiple = len(loaders) > 1
    outputs: list[Any] = []
    if predicting:
        # What prediction writers read at the epoch's end (trainer.predict_loop.predictions).
        trainer.predict_loop.outputs = outputs
    # Validation inside fit runs under no_grad, as in Lightning: a callback may change the module's tensors at
    # its end (ModelPruning adds masks), and tensors made under inference_mode cannot join training's autograd.
    inference = trainer.inference_mode and trainer.state_stage != "fit"
    with torch.inference_mode() if inference else torch.no_grad():
        runner.call(f"on_{prefix}_epoch_start")
        for dl_idx, loader in enumerate(loaders):
            extra = (dl_idx,) if multiple else ()
            if results is not None:
                results.set_dataloader(dl_idx if multiple else None)
            predictions: list[Any] = []
            outputs.append(predictions)
            limit = limits[dl_idx]
            if limit == 0:
                continue
            batches = first if dl_idx == 0 else _batches_of(loader)
            if profiler is not None:
                batches = profiled_iter(profiler, fetch_action, iter(batches))
            for batch_idx, batch in enumerate(batches):
                if track_indices:
                    trainer.predict_loop.current_batch_indices = (
                        trainer.predict_loop.batch_indices(dl_idx, batch_idx) or []
                    )
                if move is not None:
                    batch = move(batch, dl_idx)
                if results is not None:
                    results.new_batch(batch)
                if batch_start:
                    runner.run(f"on_{prefix}_batch_start", batch_start, batch, batch_idx, *extra)
                runner.current_fx = step_name
                with precision.forward_context():
                    out = step_fn(batch, batch_idx, *extra)
                if batch_end:
                    runner.run(f"on_{prefix}_batch_end", batch_end, out, batch, batch_idx, *extra)
                if keep_predictions:
                    predictions.append(out)
                if log and results is not None and results.step_dirty:
                    _, logged, _ = results.step_metrics()
                    if logged:
                        metrics.log(logged, metrics.eval_step)
                    metrics.eval_step += 1
                if batch_idx + 1 >= limit:
                    break
        if results is not None:
            results.set_dataloader(None)
        runner.call(f"on_{prefix}_epoch_end")
    if results is None:
        runner.call(f"on_{prefix}_end")
        _restore_modes(modes)
        return outputs
    epoch_metrics = metrics.publish_epoch(results, log=log, step=step)
    results.reset_torchmetrics()
    runner.call(f"on_{prefix}_end")
    if custom_train_hook:
        runner.call_module(train_hook)
    else:
        _restore_modes(modes)
    return results.per_dataloader(epoch_metrics, len(loaders))


def _batches_of(loader: Any) -> Any:
    """The batches of one of a stage's loaders: a CombinedLoader's (in a mode other than sequential) without their indices."""
    if isinstance(loader, CombinedLoader):
        return (batch for batch, _, _ in loader)
    return loader


def _restore_modes(modes: Optional[list[tuple[torch.nn.Module, bool]]]) -> None:
    for submodule, training in modes or ():
        submodule.training = training


def _restore_weights(trainer: RunState, ckpt_path: Any) -> None:
    if ckpt_path is not None:
        restore_checkpoint(trainer.checkpoint_parts(), ckpt_path, weights_only=True)


def run_evaluation(
    trainer: RunState, stage: str, dataloaders: Any, ckpt_path: Any, verbose: bool
) -> list[dict[str, float]]:
    """``trainer.validate`` / ``trainer.test``: the stage's loop once, its metrics printed and returned."""
    kind, prefix, limit_name = (
        ("val", "validation", "limit_val_batches")
        if stage == "validate"
        else ("test", "test", "limit_test_batches")
    )
    _restore_weights(trainer, ckpt_path)
    log_stage_hyperparameters(trainer)
    loaders, shown = resolve_stage_dataloaders(trainer, kind, dataloaders)
    limit = getattr(trainer, limit_name)
    limits = [num_batches(dl, limit, limit_name) for dl in loaders]
    if stage == "validate":
        trainer.val_dataloaders, trainer.num_val_batches = shown, limits
    else:
        trainer.test_dataloaders, trainer.num_test_batches = shown, limits
    if not trainer.plugin.defines_step(f"{prefix}_step"):
        raise MisconfigurationException(
            f"`trainer.{stage}()` needs `{type(trainer.lightning_module).__name__}.{prefix}_step`; define it."
        )
    results = run_loop(trainer, prefix, loaders, limits, log=True)
    for lg in trainer.loggers:
        lg.save()
    if verbose and trainer.is_global_zero:
        _print_results(stage, results)
    return results


def run_predict(
    trainer: RunState, dataloaders: Any, ckpt_path: Any, return_predictions: Optional[bool]
) -> Optional[list[Any]]:
    """``trainer.predict``: ``predict_step`` over the data; the predictions (a list per dataloader if several)."""
    _restore_weights(trainer, ckpt_path)
    log_stage_hyperparameters(trainer)
    loaders, trainer.predict_dataloaders = resolve_stage_dataloaders(trainer, "predict", dataloaders)
    limits = [num_batches(dl, trainer.limit_predict_batches, "limit_predict_batches") for dl in loaders]
    trainer.num_predict_batches = limits
    keep = True if return_predictions is None else return_predictions
    on_batch, on_epoch = prediction_writer_intervals(trainer.callbacks)
    loop = trainer.predict_loop = PredictLoop(return_predictions=keep)
    # Only a prediction writer needs the samples' indices; without one nothing is recorded.
    recorders = [_record_indices(dl) for dl in loaders] if on_batch or on_epoch else []
    loop.recorders = recorders
    loop.tracks_current_batch = on_batch and any(recorder is not None for recorder in recorders)
    try:
        # An epoch writer gets every prediction, even when the caller does not want them back.
        predictions = run_loop(trainer, "predict", loaders, limits, keep_predictions=keep or on_epoch)
    finally:
        for loader, recorder in zip(loaders, recorders):
            if recorder is not None:
                object.__setattr__(loader, "batch_sampler", recorder.batch_sampler)
        loop.recorders = []
    if not keep:
        loop.outputs = []
        return None
    return predictions if len(loaders) > 1 else predictions[0]


class PredictLoop:
    """What a ``trainer.predict`` run shows its callbacks, under Lightning's names (``trainer.predict_loop``)."""

    def __init__(self, return_predictions: bool = False) -> None:
        self.return_predictions = return_predictions
        # Per dataloader: the step outputs kept so far (filled by run_loop).
        self.outputs: list[list[Any]] = []
        # Per dataloader: the index recorder swapped into its batch sampler, or None (only with a writer).
        self.recorders: list[Optional[IndexRecorder]] = []
        #: The data-set indices of the batch being predicted (Lightning's name), which a prediction writer
        #: reads in ``write_on_batch_end``; kept only while a writer writes per batch (else ``[]``).
        self.current_batch_indices: list[int] = []
        self.tracks_current_batch = False

    @property
    def predictions(self) -> list[Any]:
        """The kept predictions: one list of batch outputs, or one such list per dataloader if several."""
        return self.outputs[0] if len(self.outputs) == 1 else self.outputs

    def batch_indices(self, dataloader_idx: int, batch_idx: int) -> Optional[list[int]]:
        """The data-set indices of batch ``batch_idx`` of dataloader ``dataloader_idx``, if recorded."""
        recorder = self.recorders[dataloader_idx] if dataloader_idx < len(self.recorders) else None
        if recorder is None or batch_idx >= len(recorder.seen):
            return None
        return recorder.seen[batch_idx]

    @property
    def epoch_batch_indices(self) -> list[list[list[int]]]:
        """Per dataloader, the index lists of the batches predicted so far (Lightning's shape, always nested)."""
        result = []
        for dl_idx, outputs in enumerate(self.outputs):
            recorder = self.recorders[dl_idx] if dl_idx < len(self.recorders) else None
            # A loader with workers fetches ahead: only the batches predicted count.
            result.append([] if recorder is None else recorder.seen[: len(outputs)])
        return result


class IndexRecorder:
    """A batch sampler that remembers the indices of each batch it gives out, for prediction writers.

    It stands in for the loader's own batch sampler while ``predict`` runs (a ``DataLoader`` takes
    its batches' indices from it in the main process, also with workers), and everything else is
    read from the sampler it wraps.
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen = []
        for indices in self.batch_sampler:
            self.seen.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def _record_indices(loader: Any) -> Optional[IndexRecorder]:
    """Put an :class:`IndexRecorder` in ``loader``'s place of its batch sampler; ``None`` where it has none."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(loader, DataLoader) or batch_sampler is None:
        rank_zero_warn(
            f"A prediction writer cannot know the sample indices of a {type(loader).__name__} without a batch "
            "sampler: its `batch_indices` are None. Use a torch DataLoader with a batch_size."
        )
        return None
    recorder = IndexRecorder(batch_sampler)
    # DataLoader refuses a new batch sampler once built; the swap is undone when predict ends.
    object.__setattr__(loader, "batch_sampler", recorder)
    return recorder


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    rows = [(name, value) for res in results for name, value in sorted(res.items())]
    if not rows:
        return
    width = max(len(name) for name, _ in rows)
    title = f"{stage.capitalize()} metric"
    width = max(width, len(title))
    line = "-" * (width + 22)
    print(line)
    print(f"{title:<{width}}  {'Value':>18}")
    print(line)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>18.6g}")
    print(line)
