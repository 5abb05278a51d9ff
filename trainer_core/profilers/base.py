"""The ``Profiler`` contract, the profiler that does nothing, and the wrappers the loops use when one is on.

A profiler records *actions*: named spans between ``start(name)`` and ``stop(name)``. The Trainer
names them as Lightning does (``[LightningModule]MyModule.on_train_epoch_end``,
``[Callback]MyCallback.on_train_batch_end``, ``[Strategy]SingleDevicePlugin.training_step``,
``run_training_batch``, ``[_TrainingEpochLoop].train_dataloader_next``, ...) so that a report reads
the same under both. ``describe()`` writes the report at the end of each ``fit``/``validate``/
``test``/``predict``: to ``{dirpath}/{stage}-{filename}.txt`` when a ``filename`` is given (with
``-{rank}`` before the extension when several processes run), otherwise to the console from rank 0.

The Trainer decides once per run whether profiling is on (any profiler but the plain
:class:`PassThroughProfiler`); only then are hooks and loop steps wrapped by :func:`profiled`, so a
run without a profiler calls exactly what it called before.
"""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional, TextIO, Union

log = logging.getLogger(__name__)


class Profiler(ABC):
    """Subclass this (``start``, ``stop`` and, for a report, ``summary``) to write a profiler of your own.

    Args:
        dirpath: Folder of the report file. ``None``: the Trainer's ``log_dir``.
        filename: Name of the report file (the stage and ``.txt`` are added). ``None``: no file; the
            report goes to the console (rank 0).
    """

    def __init__(self, dirpath: Optional[Union[str, Path]] = None, filename: Optional[str] = None) -> None:
        self.dirpath = dirpath
        self.filename = filename
        self._output_file: Optional[TextIO] = None
        self._write_stream: Optional[Callable[[str], Any]] = None
        self._local_rank: Optional[int] = None
        self._stage: Optional[str] = None

    @abstractmethod
    def start(self, action_name: str) -> None:
        """Begin recording ``action_name``."""

    @abstractmethod
    def stop(self, action_name: str) -> None:
        """End recording ``action_name``."""

    def summary(self) -> str:
        """The report text; empty when there is nothing to report."""
        return ""

    @contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        """Record the code inside ``with profiler.profile("name"):`` as one call of ``name``."""
        try:
            self.start(action_name)
            yield action_name
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        """Called by the Trainer before the first hook of a run.

        ``local_rank`` is ``None`` in a single process. The Trainer passes the *global* rank there
        when several processes run (Lightning passes the local one): on one machine the two are the
        same, and across machines sharing a file system only the global rank keeps the files apart.
        """
        self._stage = stage
        self._local_rank = local_rank
        self.dirpath = self.dirpath or log_dir

    def teardown(self, stage: Optional[str]) -> None:
        """Close the report file; called by :meth:`describe`."""
        self._write_stream = None
        if self._output_file is not None:
            self._output_file.close()
            self._output_file = None

    def describe(self) -> None:
        """Write the report (file or console) and close; the Trainer calls this at the end of each run."""
        self._prepare_streams()
        text = self.summary()
        if text and self._write_stream is not None:
            self._write_stream(text)
        if self._output_file is not None:
            self._output_file.flush()
        self.teardown(stage=self._stage)

    def __getstate__(self) -> dict[str, Any]:
        # What a run attached (the module, an open report file) stays behind when the Trainer is sent
        # to spawned processes; each process attaches its own.
        state = self.__dict__.copy()
        state.update(_lightning_module=None, _output_file=None, _write_stream=None)
        return state

    @property
    def local_rank(self) -> int:
        return 0 if self._local_rank is None else self._local_rank

    def __del__(self) -> None:
        try:
            self.teardown(stage=self._stage)
        except AttributeError:  # an __init__ that raised left attributes unset; nothing is open then
            pass

    # ------------------------------------------------------------------ report output
    def _prepare_filename(self, action_name: Optional[str] = None, extension: str = ".txt") -> str:
        """``{stage}-{filename}-{rank}-{action}{extension}``, each part only when known; unsafe characters become ``_``."""
        parts = [self._stage, self.filename, None if self._local_rank is None else str(self._local_rank)]
        parts.append(action_name)
        base = "-".join(p for p in parts if p)
        base = re.sub(r"_+", "_", re.sub(r"[\\/:*?\"<>|\n\r\t]", "_", base)).strip()
        return (base or "profile") + extension

    def _prepare_streams(self) -> None:
        if self._write_stream is not None:
            return
        if self.filename and self.dirpath:
            os.makedirs(self.dirpath, exist_ok=True)
            # Appended: fit, then test, with one profiler add their reports to one folder without loss.
            self._output_file = open(os.path.join(self.dirpath, self._prepare_filename()), "a")
            self._write_stream = self._output_file.write
        else:
            self._write_stream = self._rank_zero_info

    def _rank_zero_info(self, text: str) -> None:
        if self._local_rank in (None, 0):
            log.info(text)

    def _stats_to_str(self, stats: dict[str, str]) -> str:
        """One report of per-action texts, headed like Lightning's."""
        lines = [f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report"]
        for action, text in stats.items():
            rank = "" if self._local_rank is None else f" rank: {self._local_rank}"
            lines += [f"Profile stats for: {action}{rank}", text]
        return os.linesep.join(lines)


class PassThroughProfiler(Profiler):
    """The Trainer's profiler when none is asked for: records nothing, costs nothing.

    ``trainer.profiler.profile("name")`` in user code works whether profiling is on or not.
    """

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass


def profiled(profiler: Profiler, action_name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, each call recorded as ``action_name``; built once per run, only when profiling is on."""
    start, stop = profiler.start, profiler.stop

    def call(*args: Any, **kwargs: Any) -> Any:
        start(action_name)
        try:
            return fn(*args, **kwargs)
        finally:
            stop(action_name)

    return call


def profiled_iter(profiler: Profiler, action_name: str, iterator: Iterator[Any]) -> Iterator[Any]:
    """``iterator``, each ``next`` recorded as ``action_name`` (the time spent waiting for a batch)."""
    start, stop = profiler.start, profiler.stop
    while True:
        start(action_name)
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            stop(action_name)
        yield item
