"""Validation, test and prediction: one loop over the stage's dataloaders, three uses.

Validation and test log into a fresh :class:`~trainer_core.results.ResultCollection` and return
each loader's epoch metrics; prediction logs nothing and collects the step outputs. The hooks,
the batch transfer, the limits and the gradient mode are the same for all three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from trainer_core.errors import MisconfigurationException
from trainer_core.loops.data import batch_mover, num_batches, resolve_dataloaders
from trainer_core.results import ResultCollection

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer

_STEP = {"validation": "validation_step", "test": "test_step", "predict": "predict_step"}


def run_loop(
    trainer: Trainer,
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
    step_fn = getattr(plugin, step_name)
    batch_start = getattr(hooks, f"on_{prefix}_batch_start")
    batch_end = getattr(hooks, f"on_{prefix}_batch_end")
    move = batch_mover(trainer)
    precision = plugin.precision
    predicting = prefix == "predict"

    was_training = module.training
    runner.call_module(f"on_{prefix}_model_eval")
    runner.call(f"on_{prefix}_start")
    results: Optional[ResultCollection] = None
    if not predicting:
        results = ResultCollection(training=False)
        results.plugin = plugin
        metrics.results = results
    multiple = len(loaders) > 1
    outputs: list[Any] = []
    with torch.inference_mode() if trainer.inference_mode else torch.no_grad():
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
            for batch_idx, batch in enumerate(loader):
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
        return outputs
    epoch_metrics = metrics.publish_epoch(results, log=log, step=step)
    runner.call(f"on_{prefix}_end")
    if was_training:
        runner.call_module(f"on_{prefix}_model_train")
    return results.per_dataloader(epoch_metrics, len(loaders))


def _restore_weights(trainer: Trainer, ckpt_path: Any) -> None:
    if ckpt_path is not None:
        from trainer_core.checkpoint.restore import restore_checkpoint

        restore_checkpoint(trainer, ckpt_path, weights_only=True)


def run_evaluation(
    trainer: Trainer, stage: str, dataloaders: Any, ckpt_path: Any, verbose: bool
) -> list[dict[str, float]]:
    """``trainer.validate`` / ``trainer.test``: the stage's loop once, its metrics printed and returned."""
    kind, prefix, limit_name = (
        ("val", "validation", "limit_val_batches")
        if stage == "validate"
        else ("test", "test", "limit_test_batches")
    )
    _restore_weights(trainer, ckpt_path)
    loaders = resolve_dataloaders(trainer, kind, dataloaders)
    limit = getattr(trainer, limit_name)
    limits = [num_batches(dl, limit, limit_name) for dl in loaders]
    shown = loaders[0] if len(loaders) == 1 else loaders
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
    trainer: Trainer, dataloaders: Any, ckpt_path: Any, return_predictions: Optional[bool]
) -> Optional[list[Any]]:
    """``trainer.predict``: ``predict_step`` over the data; the predictions (a list per dataloader if several)."""
    _restore_weights(trainer, ckpt_path)
    loaders = resolve_dataloaders(trainer, "predict", dataloaders)
    limits = [num_batches(dl, trainer.limit_predict_batches, "limit_predict_batches") for dl in loaders]
    trainer.predict_dataloaders = loaders[0] if len(loaders) == 1 else loaders
    trainer.num_predict_batches = limits
    keep = True if return_predictions is None else return_predictions
    predictions = run_loop(trainer, "predict", loaders, limits, keep_predictions=keep)
    if not keep:
        return None
    return predictions if len(loaders) > 1 else predictions[0]


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
