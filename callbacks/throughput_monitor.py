"""``ThroughputMonitor``: batches, samples, items and FLOPs per second, over a window of recent batches.

Lightning's callback and its ``Throughput`` counter (``lightning_fabric.utilities.throughput``), with
the same metric names, windows and logging steps, so dashboards read the same under either trainer.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

# The prefix of each stage's metrics (Lightning's RunningStage values).
_STAGE_PREFIX = {"fit": "train", "validate": "validate", "test": "test", "predict": "predict"}


class _MonotonicWindow(list):
    """The last ``maxlen`` values of a counter that must increase; a value that does not is a bug in the caller."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, value: Any) -> None:
        if self and self[-1] >= value:
            raise ValueError(
                f"Throughput: expected the value to increase, last: {self[-1]}, current: {value}"
            )
        super().append(value)
        if len(self) > self.maxlen:
            del self[0]


class Throughput:
    """Rates over the last ``window_size`` updates, from running totals of time, batches, samples and items.

    ``compute()`` returns ``time``, ``batches``, ``samples`` (and ``lengths``) always; once the window
    is full, ``device/batches_per_sec`` and ``device/samples_per_sec`` (``device/items_per_sec`` with
    lengths), and with several processes the same rates over all of them without the ``device/``
    prefix; ``device/flops_per_sec`` (``flops_per_sec``, and ``device/mfu`` when the device's peak is
    known) once ``window_size`` FLOPs figures were given. Every rank is assumed to do the same work.
    """

    def __init__(
        self,
        available_flops: Optional[float] = None,
        world_size: int = 1,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        if world_size < 1:
            raise MisconfigurationException(f"Throughput(world_size={world_size}): use a positive number.")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise MisconfigurationException(
                f"ThroughputMonitor(window_size={window_size!r}): use an integer of at least 2 "
                "(a rate needs a first and a last value)."
            )
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time: _MonotonicWindow = _MonotonicWindow(window_size)
        self._batches: _MonotonicWindow = _MonotonicWindow(window_size)
        self._samples: _MonotonicWindow = _MonotonicWindow(window_size)
        self._lengths: _MonotonicWindow = _MonotonicWindow(window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(
        self,
        *,
        time: float,
        batches: int,
        samples: int,
        lengths: Optional[int] = None,
        flops: Optional[float] = None,
    ) -> None:
        """Record the totals so far (each larger than the last); ``flops``: this device's since the last update."""
        self._time.append(time)
        if samples < batches:
            raise ValueError(f"Throughput: expected samples ({samples}) >= batches ({batches}).")
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            if lengths < samples:
                raise ValueError(f"Throughput: expected lengths ({lengths}) >= samples ({samples}).")
            self._lengths.append(lengths)
            if len(self._samples) != len(self._lengths):
                raise RuntimeError(
                    f"Throughput: lengths were given {len(self._lengths)} times but samples {len(self._samples)}; "
                    "give lengths with every update or never."
                )
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> dict[str, Union[int, float]]:
        sep = self.separator
        metrics: dict[str, Union[int, float]] = {
            "time": self._time[-1],
            "batches": self._batches[-1],
            "samples": self._samples[-1],
        }
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        several = self.world_size > 1
        if len(self._time) == self._time.maxlen:
            elapsed = self._time[-1] - self._time[0]
            batches_per_sec = (self._batches[-1] - self._batches[0]) / elapsed
            samples_per_sec = (self._samples[-1] - self._samples[0]) / elapsed
            metrics[f"device{sep}batches_per_sec"] = batches_per_sec
            metrics[f"device{sep}samples_per_sec"] = samples_per_sec
            if several:
                metrics["batches_per_sec"] = batches_per_sec * self.world_size
                metrics["samples_per_sec"] = samples_per_sec * self.world_size
            if len(self._lengths) == self._lengths.maxlen:
                items_per_sec = (self._lengths[-1] - self._lengths[0]) / elapsed
                metrics[f"device{sep}items_per_sec"] = items_per_sec
                if several:
                    metrics["items_per_sec"] = items_per_sec * self.world_size
        if len(self._flops) == self._flops.maxlen:
            # The first entry's FLOPs were spent before the window's first time stamp.
            flops_per_sec = (sum(self._flops) - self._flops[0]) / (self._time[-1] - self._time[0])
            device_flops_per_sec = flops_per_sec / self.world_size
            if several:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[f"device{sep}flops_per_sec"] = device_flops_per_sec
            if self.available_flops:
                metrics[f"device{sep}mfu"] = device_flops_per_sec / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


class ThroughputMonitor(Callback):
    """Log throughput while training, validating, testing and predicting, on global rank 0.

    Metrics are named ``<stage>/<metric>`` (``train/device/samples_per_sec``, ``validate/time``, ...;
    see :class:`Throughput`). Training logs at the Trainer's logging interval (``log_every_n_steps``),
    after batches that step the optimizer, at the step the loggers use; evaluation and prediction log
    every ``log_every_n_steps`` batches of a run, at the number of batches of the run (validation
    inside ``fit``) or of every call of that stage so far (``validate``, ``test``, ``predict``).
    Validation inside ``fit`` does not count as training time.

    Args:
        batch_size_fn: the number of samples in a batch (``lambda batch: batch[0].size(0)``).
        length_fn: the number of items (tokens, ...) in a batch; adds ``items_per_sec``.
        **kwargs: ``window_size`` (default 100 batches) and ``separator`` (default ``"/"``) of
            :class:`Throughput`.

    FLOPs: give the module a ``flops_per_batch`` attribute (for instance from
    ``torch.utils.flop_counter.FlopCounterMode`` on one batch); ``device/mfu`` also needs the
    device's peak, known for CUDA devices when ``lightning_fabric`` is installed.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Optional[Callable[[Any], int]] = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - {"window_size", "separator"})
        if unknown:
            raise MisconfigurationException(
                f"ThroughputMonitor({', '.join(f'{k}=...' for k in unknown)}): unknown argument; "
                "use window_size or separator."
            )
        if not callable(batch_size_fn):
            raise MisconfigurationException(
                "ThroughputMonitor(batch_size_fn=...): pass a function that returns a batch's number of samples."
            )
        Throughput(**kwargs)  # refuse a bad window here, not when the run starts
        self.kwargs = kwargs
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.available_flops: Optional[float] = None
        self._throughputs: dict[str, Throughput] = {}
        self._t0s: dict[str, float] = {}
        self._lengths: dict[str, int] = {}
        self._samples: dict[str, int] = {}
        self._batches: dict[str, int] = {}
        # Batches of each evaluation stage: in this run (for the logging interval) and in all (the step).
        self._run_batches: dict[str, int] = {}
        self._total_batches: dict[str, int] = {}
        self._stepped_before = 0
        self._module_has_flops: Optional[bool] = None
        self._fitting = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.available_flops = _available_flops(trainer)
        self._fitting = stage == "fit"
        stages = ("train", "validate") if stage == "fit" else (_STAGE_PREFIX[stage],)
        for name in stages:
            self._throughputs[name] = Throughput(
                available_flops=self.available_flops, world_size=trainer.world_size, **self.kwargs
            )

    # ------------------------------------------------------------------ the counting
    def _start(self, stage: str) -> None:
        if self._fitting or stage not in self._samples:
            self._throughputs[stage].reset()
            self._lengths[stage] = 0
            self._samples[stage] = 0
            self._batches[stage] = 0
        self._run_batches[stage] = 0
        self._t0s[stage] = time.perf_counter()

    @torch.inference_mode()
    def _update(self, trainer: Trainer, pl_module: LightningModule, stage: str, batch: Any) -> None:
        if trainer.plugin.root_device.type == "cuda":
            # Kernels run asynchronously: the clock must wait for them.
            torch.cuda.synchronize(trainer.plugin.root_device)
        elapsed = time.perf_counter() - self._t0s[stage]
        if self.length_fn is not None:
            self._lengths[stage] += self.length_fn(batch)
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
            if not self._module_has_flops:
                rank_zero_warn(
                    f"ThroughputMonitor: {type(pl_module).__name__} has no `flops_per_batch` attribute, so FLOPs "
                    "per second are not logged."
                )
        flops = pl_module.flops_per_batch if self._module_has_flops else None
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._throughputs[stage].update(
            time=elapsed,
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=None if self.length_fn is None else self._lengths[stage],
            flops=flops,
        )

    def _log(self, trainer: Trainer, stage: str, step: int) -> None:
        throughput = self._throughputs[stage]
        metrics = {f"{stage}{throughput.separator}{k}": v for k, v in throughput.compute().items()}
        trainer.metrics.log(metrics, step)

    # ------------------------------------------------------------------ training
    def on_train_start(self, trainer: Trainer, *_: Any) -> None:
        self._stepped_before = trainer.batches_that_stepped
        if trainer.is_global_zero:
            self._start("train")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        stepped = trainer.batches_that_stepped
        optimizer_stepped = stepped != self._stepped_before
        self._stepped_before = stepped
        if not trainer.is_global_zero:
            return
        self._update(trainer, pl_module, "train", batch)
        # Logged only after an optimizer step, so that the window's time includes the step.
        if optimizer_stepped and (stepped % trainer.log_every_n_steps == 0 or trainer.should_stop):
            self._log(trainer, "train", stepped - 1)

    # ------------------------------------------------------------------ evaluation and prediction
    def _eval_start(self, trainer: Trainer, stage: str) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self._start(stage)

    def _eval_batch_end(self, trainer: Trainer, pl_module: LightningModule, stage: str, batch: Any) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        run = self._run_batches[stage] = self._run_batches[stage] + 1
        total = self._total_batches[stage] = self._total_batches.get(stage, 0) + 1
        self._update(trainer, pl_module, stage, batch)
        if run % trainer.log_every_n_steps == 0 or trainer.should_stop:
            # Lightning's step: inside fit each validation counts from 1 again; outside, calls add up.
            self._log(trainer, stage, run if self._fitting else total)

    def on_validation_start(self, trainer: Trainer, *_: Any) -> None:
        self._eval_start(trainer, "validate")

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._eval_batch_end(trainer, pl_module, "validate", batch)

    def on_validation_end(self, trainer: Trainer, *_: Any) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking or not self._fitting:
            return
        # Validation inside fit: move the training clock's start forward by the time spent away from
        # training, so that the training rates count training only.
        train_times = self._throughputs["train"]._time
        val_times = self._throughputs["validate"]._time
        train_elapsed = train_times[-1] if train_times else 0.0
        val_elapsed = val_times[-1] if val_times else 0.0
        if "train" in self._t0s:
            training_finished = self._t0s["train"] + train_elapsed
            self._t0s["train"] += (self._t0s["validate"] - training_finished) + val_elapsed

    def on_test_start(self, trainer: Trainer, *_: Any) -> None:
        self._eval_start(trainer, "test")

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._eval_batch_end(trainer, pl_module, "test", batch)

    def on_predict_start(self, trainer: Trainer, *_: Any) -> None:
        self._eval_start(trainer, "predict")

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *_: Any, **__: Any
    ) -> None:
        self._eval_batch_end(trainer, pl_module, "predict", batch)


def _available_flops(trainer: Trainer) -> Optional[float]:
    """The device's peak FLOPs at the run's precision, where known (CUDA, from lightning_fabric's table)."""
    device = trainer.plugin.root_device
    if device.type != "cuda":
        return None
    try:
        from lightning_fabric.utilities.throughput import get_available_flops
    except ImportError:
        return None
    name = trainer.plugin.precision.name
    dtype = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16}.get(
        name, torch.float16 if name.startswith("16") else torch.float32
    )
    return get_available_flops(device, dtype)
