"""``PyTorchProfiler``: ``torch.profiler`` over the run, a table of operators and Chrome traces of a few steps.

Each action is also a ``record_function`` range (``[pl][profile]<action>``) and each submodule's
forward a ``[pl][module]<class>: <name>`` range, so the trace shows which hook or layer an operator
ran in. The profiler steps at the end of every ``training_step``/``validation_step``/``test_step``/
``predict_step``, each kind counted on its own so that validation inside ``fit`` does not eat the
training schedule. A trace is written, like Lightning's, to
``{dirpath}/{stage}[-{filename}][-{rank}]-{step action}.{time}.pt.trace.json`` when the schedule
saves one (``dirpath`` defaults to the Trainer's ``log_dir``).
"""

from __future__ import annotations

import copy
import inspect
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.autograd.profiler import EventList, record_function
from torch.profiler import ProfilerAction, ProfilerActivity, tensorboard_trace_handler

from trainer_core.errors import MisconfigurationException
from trainer_core.profilers.base import Profiler
from trainer_core.utilities import rank_zero_warn

_STEP_KINDS = ("training_step", "validation_step", "test_step", "predict_step")
_SORT_KEYS = (
    "cpu_time",
    "cuda_time",
    "cpu_time_total",
    "cuda_time_total",
    "cpu_memory_usage",
    "cuda_memory_usage",
    "self_cpu_memory_usage",
    "self_cuda_memory_usage",
    "count",
)
# Lightning's default: skip one step, warm up one, record three (the overhead stays negligible).
_DEFAULT_WAIT, _DEFAULT_WARMUP, _DEFAULT_ACTIVE = 1, 1, 3


def _default_schedule(step: int) -> ProfilerAction:
    """``torch.profiler.schedule(wait=1, warmup=1, active=3)`` as a module function: a profiler holding it
    pickles (spawned processes receive the Trainer), which torch's closure does not."""
    position = step % (_DEFAULT_WAIT + _DEFAULT_WARMUP + _DEFAULT_ACTIVE)
    if position < _DEFAULT_WAIT:
        return ProfilerAction.NONE
    if position < _DEFAULT_WAIT + _DEFAULT_WARMUP:
        return ProfilerAction.WARMUP
    last = position == _DEFAULT_WAIT + _DEFAULT_WARMUP + _DEFAULT_ACTIVE - 1
    return ProfilerAction.RECORD_AND_SAVE if last else ProfilerAction.RECORD


class _ModuleRanges:
    """A ``record_function`` range around every submodule's forward, named ``[pl][module]<class>: <name>``."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._open: dict[str, record_function] = {}
        self._handles: list[Any] = []

    def _enter(self, name: str, *_: Any) -> None:
        self._open[name] = record_function("[pl][module]" + name).__enter__()

    def _exit(self, name: str, *_: Any) -> None:
        ranged = self._open.pop(name, None)
        if ranged is not None:
            ranged.__exit__(None, None, None)

    def __enter__(self) -> _ModuleRanges:
        for module_name, module in self._model.named_modules():
            if module_name:
                name = f"{type(module).__module__}.{type(module).__name__}: {module_name}"
                self._handles.append(module.register_forward_pre_hook(partial(self._enter, name)))
                self._handles.append(module.register_forward_hook(partial(self._exit, name)))
        return self

    def __exit__(self, *_: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _StepSchedule:
    """The user's (or the default) schedule, fed a separate step count for each kind of step.

    ``kind`` is the step function that just ended; once a kind's schedule has said
    ``RECORD_AND_SAVE`` it records nothing more. A kind whose run has fewer steps than the default
    schedule needs is recorded whole instead (the default would save nothing).
    """

    def __init__(self, schedule: Callable[[int], ProfilerAction], is_default: bool) -> None:
        self.schedule = schedule
        self.is_default = is_default
        # Set by the profiler when it opens (the Trainer's batch counts); unknown until then.
        self.total_steps: Optional[Callable[[str], float]] = None
        self.reset()

    def reset(self) -> None:
        self.kind: Optional[str] = None
        self.counts: dict[str, int] = {}
        self.finished: set[str] = set()
        self.previous: Optional[ProfilerAction] = None

    def __call__(self, _step_num: int) -> ProfilerAction:
        kind = self.kind
        if kind is None or kind in self.finished:
            return ProfilerAction.NONE
        count = self.counts[kind] = self.counts.get(kind, 0) + 1
        few = (
            self.total_steps is not None
            and self.total_steps(kind) < _DEFAULT_WAIT + _DEFAULT_WARMUP + _DEFAULT_ACTIVE
        )
        if self.is_default and few:
            action = ProfilerAction.RECORD
        else:
            action = self.schedule(count)
        if self.previous == ProfilerAction.RECORD and action == ProfilerAction.WARMUP:
            # Another kind of step was recording (validation started inside training): keep recording.
            action = ProfilerAction.RECORD
        if action == ProfilerAction.RECORD_AND_SAVE:
            self.finished.add(kind)
        self.previous = action
        return action


class PyTorchProfiler(Profiler):
    """The cost of each operator inside the model, on the CPU and (when there is one) the GPU.

    Args:
        dirpath: Folder of the report and traces; ``None``: the Trainer's ``log_dir``.
        filename: Write the table to ``{dirpath}/{stage}-{filename}.txt`` instead of the console.
        group_by_input_shapes: Group operators by input shape (needs ``record_shapes=True``).
        emit_nvtx: Emit NVTX ranges for ``nvprof``/Nsight instead of recording (CUDA only).
        export_to_chrome: Write the Chrome traces (``chrome://tracing``, Perfetto, TensorBoard).
        row_limit: Rows of the table; ``-1``: all.
        sort_by_key: Column to sort the table by (``cpu_time_total`` or ``cuda_time_total`` by default).
        record_module_names: Name each submodule's forward in the trace.
        table_kwargs: More arguments of ``EventList.table``.
        **profiler_kwargs: Arguments of ``torch.profiler.profile`` (``schedule``, ``record_shapes``,
            ``profile_memory``, ``with_stack``, ``activities``, ``on_trace_ready``...).
    """

    STEP_FUNCTIONS = set(_STEP_KINDS)
    AVAILABLE_SORT_KEYS = set(_SORT_KEYS)

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        group_by_input_shapes: bool = False,
        emit_nvtx: bool = False,
        export_to_chrome: bool = True,
        row_limit: int = 20,
        sort_by_key: Optional[str] = None,
        record_module_names: bool = True,
        table_kwargs: Optional[dict[str, Any]] = None,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiler: Optional[Any] = None
        self.function_events: Optional[EventList] = None
        self._lightning_module: Optional[nn.Module] = None  # set by the Trainer at each run
        self._module_ranges: Optional[_ModuleRanges] = None
        self._recording: dict[str, record_function] = {}
        self._nvtx: Optional[Any] = None

        activities = profiler_kwargs.get("activities")
        cuda = torch.cuda.is_available() if not activities else ProfilerActivity.CUDA in activities
        self._sort_by_key = sort_by_key or ("cuda_time_total" if cuda else "cpu_time_total")
        if self._sort_by_key not in _SORT_KEYS:
            raise MisconfigurationException(
                f"PyTorchProfiler(sort_by_key={sort_by_key!r}): use one of {', '.join(_SORT_KEYS)}."
            )
        self._table_kwargs = dict(table_kwargs or {})
        allowed = set(inspect.signature(EventList.table).parameters) - {"self", "sort_by", "row_limit"}
        for key in self._table_kwargs:
            if key not in allowed:
                raise MisconfigurationException(
                    f"PyTorchProfiler(table_kwargs={{{key!r}: ...}}): not an argument of EventList.table; "
                    f"use {', '.join(sorted(allowed))} (sort_by and row_limit have their own arguments)."
                )
        schedule = profiler_kwargs.get("schedule")
        if schedule is not None and (not callable(schedule) or not isinstance(schedule(0), ProfilerAction)):
            raise MisconfigurationException(
                "PyTorchProfiler(schedule=...): pass a callable that returns a torch.profiler.ProfilerAction "
                "(torch.profiler.schedule(wait=..., warmup=..., active=...))."
            )
        self._schedule = _StepSchedule(schedule or _default_schedule, is_default=schedule is None)
        self._group_by_input_shapes = group_by_input_shapes and profiler_kwargs.get("record_shapes", False)
        self._emit_nvtx = emit_nvtx
        self._export_to_chrome = export_to_chrome
        self._row_limit = row_limit
        self._record_module_names = record_module_names
        self._user_trace_ready = "on_trace_ready" in profiler_kwargs
        kwargs = {**profiler_kwargs, "schedule": self._schedule}
        kwargs.setdefault("activities", [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self._profiler_kwargs = kwargs

    # ------------------------------------------------------------------ recording
    def start(self, action_name: str) -> None:
        if self.profiler is None and self._nvtx is None:
            self._open()
        module = self._lightning_module
        if module is not None and self._module_ranges is None and self._record_module_names:
            self._module_ranges = _ModuleRanges(module).__enter__()
        if self.profiler is not None and action_name not in self._recording:
            self._recording[action_name] = record_function("[pl][profile]" + action_name).__enter__()

    def stop(self, action_name: str) -> None:
        ranged = self._recording.pop(action_name, None)
        if ranged is not None:
            ranged.__exit__(None, None, None)
        if self.profiler is None or self._emit_nvtx:
            return
        kind = next((k for k in _STEP_KINDS if action_name.endswith(k)), None)
        if kind is None:
            return
        self._schedule.kind = kind
        if not self._user_trace_ready:
            self.profiler.on_trace_ready = partial(self._export_trace, action_name)
        self.profiler.step()

    def _open(self) -> None:
        if torch.autograd._profiler_enabled():
            # Another profiler left open (one that was never described) would make this one fail.
            torch.autograd._disable_profiler()
        self._schedule.reset()
        self._schedule.total_steps = self._total_steps
        if self._emit_nvtx:
            self._nvtx = torch.autograd.profiler.emit_nvtx().__enter__()
            return
        allowed = set(inspect.signature(torch.profiler.profile.__init__).parameters)
        kwargs = {k: v for k, v in self._profiler_kwargs.items() if k in allowed}
        self.profiler = torch.profiler.profile(**kwargs).__enter__()

    def _total_steps(self, kind: str) -> float:
        """Steps of ``kind`` this run will take, from the Trainer (infinite when it cannot tell)."""
        # ``_trainer``: the ``trainer`` property raises when the module is not attached.
        trainer = getattr(self._lightning_module, "_trainer", None)
        if trainer is None:
            return float("inf")
        counts: Any = {
            "training_step": trainer.num_training_batches,
            "validation_step": trainer.num_val_batches,
            "test_step": trainer.num_test_batches,
            "predict_step": trainer.num_predict_batches,
        }[kind]
        return float(sum(counts)) if isinstance(counts, list) else float(counts)

    def _export_trace(self, action_name: str, profiler: Any) -> None:
        if not self._export_to_chrome:
            return
        if self.dirpath is None:
            rank_zero_warn(
                "PyTorchProfiler: no trace written, there is no `dirpath` (and no Trainer log_dir)."
            )
            return
        worker = self._prepare_filename(action_name=action_name, extension="")
        tensorboard_trace_handler(str(self.dirpath), worker)(profiler)

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.function_events = self.profiler.events()
            self.profiler = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
        if self._module_ranges is not None:
            self._module_ranges.__exit__()
            self._module_ranges = None

    # ------------------------------------------------------------------ report
    def summary(self) -> str:
        if not self._profiler_kwargs.get("enabled", True) or self._emit_nvtx:
            return ""
        self._close()
        if not self.function_events:
            return ""
        averages = self.function_events.key_averages(group_by_input_shapes=self._group_by_input_shapes)
        table = averages.table(sort_by=self._sort_by_key, row_limit=self._row_limit, **self._table_kwargs)
        return self._stats_to_str({"records": table})

    def teardown(self, stage: Optional[str]) -> None:
        self._close()
        for ranged in self._recording.values():
            ranged.__exit__(None, None, None)
        self._recording = {}
        super().teardown(stage=stage)

    def __getstate__(self) -> dict[str, Any]:
        # A live torch profiler cannot travel to spawned processes; each starts its own there.
        state = super().__getstate__()
        state.update(profiler=None, function_events=None, _module_ranges=None, _recording={}, _nvtx=None)
        # Its ``total_steps`` is a bound method of this profiler, set again when the profiler opens.
        state["_schedule"] = schedule = copy.copy(self._schedule)
        schedule.total_steps = None
        return state
