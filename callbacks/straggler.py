"""``StragglerMonitor``: which rank is slowest at its own work, how much slower, and a warning that names it.

In synchronous data parallel training every rank waits for the slowest one in the gradient
all-reduce, so every rank's *wall* step time is the slowest rank's: wall time cannot tell which
rank holds the others up. What differs between ranks is the work each does *alone*, before it
reaches a collective. This callback times that local work with the host clock:

* always: from the end of one batch (``on_train_batch_end``) to the start of the next
  (``on_train_batch_start``): fetching and collating the next batch, the other callbacks' and the
  module's end-of-batch hooks, logging;
* with ``time_forward=True``, also from ``on_train_batch_start`` to the batch's first
  ``on_before_backward``: ``training_step``, the forward.

Every ``every_n_steps`` optimizer steps the ranks exchange their mean time per batch over the
window (one collective of one number per rank; every rank counts the same steps, so they meet at
the same point), and every rank logs ``straggler/slowest_rank``, ``straggler/slowest_time`` and
``straggler/median_time`` (seconds) and ``straggler/spread`` (slowest / median). Global rank 0
warns about each rank whose time exceeds ``factor`` times the median, with its host.

Why the forward is not timed by default: a rank that reaches a collective early waits there for
the others, and a wait inside a timed window counts as that rank's own work. The time between
batches holds no collective of the step (those come in ``training_step``, the backward and the
optimizer step), under every plugin. ``training_step`` often does: ``self.log(...,
sync_dist=True)`` all-reduces on every step, DDP broadcasts the buffers of a module that has
some (BatchNorm) at each forward, FSDP and tensor parallelism gather parameters or exchange
activations in the forward, and the pipeline plugin runs forward and backward together. There the
fast ranks wait inside the forward for the slow one, so everything the slow rank did before that
collective (its data loading too) shows on every rank alike: the ranks look equal, and after a
validation that one rank spends longer in, the others' wait for it reads as their own slowness.
(Measured with 2 ranks and a ``sync_dist`` log in ``training_step``: a 60 ms data-loading delay
on rank 1 read 84 vs 83 ms per batch with ``time_forward=True``, and 61 vs 0.4 ms by default.) Pass ``time_forward=True`` under ``ddp``, ``ddp_sharded`` or ``zero`` when
``training_step`` runs no collective, to also see ranks whose forward is slower (a slower CPU,
a busier host).

How to read the figures:

* On CUDA the clock sees the host's side: data loading, Python, kernel launches. Kernels run
  asynchronously, so a slow GPU shows only where the host waits for it inside a window. A slow
  data pipeline or a busy host, the usual stragglers, show directly.
* The median is the lower median (``statistics.median_low``): with two ranks the slow rank is
  compared with the other one, where a midpoint would keep the ratio below 2 whatever the delay.
* A time between batches of a few microseconds (data already in memory) has noisy ratios: a
  rank is named only when it is also ``min_delay`` (1 ms) slower per batch than the median. The
  metrics show every window's ratio regardless.

Not counted: the first two batches of each ``fit`` (the first has no time before it; in the
second, DDP rebuilds its gradient buckets with a broadcast inside the forward, and compiled
modules often compile again); the batch after a validation run, after a checkpoint save (both
may wait for other ranks and write files) and the first batch of each epoch (the epoch-end hooks,
the loader's new iterator and its workers' start-up are not per-step work). Weights-only saves do
not call the callbacks' checkpoint hooks and so are not seen. The last, partial window of a run is
not reported.

Warnings are rate-limited: a rank is named when it becomes a straggler, not again while it stays
one; a rank that recovers and falls behind again is named again. The logged metrics show every
window.

With one process there is nothing to compare: the callback takes its hooks out of the training
loop in ``setup`` (the Trainer calls only the hooks a callback overrides), logs and warns nothing,
and costs nothing per step. With several, each batch costs two hook calls (three with
``time_forward``) of a clock read and a few float operations, about 3 us on a slow 2-core machine,
and each comparison one collective.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from torch import Tensor

    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

#: The per-batch hooks that do the timing; silenced in ``setup`` when there is nothing to compare.
_TIMING_HOOKS = ("on_train_batch_start", "on_before_backward", "on_train_batch_end")

#: What the figures hold, for the warning, by ``time_forward``.
_TIMED = {False: "between batches: loading data, end-of-batch hooks", True: "loading data, training_step"}

#: Batches left out at the start of each fit (see the module's docstring).
_WARMUP_BATCHES = 2

METRIC_SLOWEST_RANK = "straggler/slowest_rank"
METRIC_SLOWEST_TIME = "straggler/slowest_time"
METRIC_MEDIAN_TIME = "straggler/median_time"
METRIC_SPREAD = "straggler/spread"


class StragglerSummary(NamedTuple):
    """One window's comparison of the ranks' mean local time per batch (seconds)."""

    slowest_rank: int
    slowest_time: float
    median_time: float
    spread: float
    #: The ranks slower than ``factor`` x the median, slowest first.
    stragglers: tuple[int, ...]


def summarize(times: list[float], factor: float, min_delay: float = 0.0) -> Optional[StragglerSummary]:
    """Compare the ranks' ``times`` (``nan`` for a rank that counted no batch); ``None`` if under two ranks counted.

    The median is the lower median, so that with two ranks the slow one is compared with the other.
    """
    counted = [(t, rank) for rank, t in enumerate(times) if not math.isnan(t)]
    if len(counted) < 2:
        return None
    slowest_time, slowest_rank = max(counted)
    median = statistics.median_low(t for t, _ in counted)
    spread = _ratio(slowest_time, median)
    stragglers = tuple(
        rank for t, rank in sorted(counted, reverse=True) if t > factor * median and t - median >= min_delay
    )
    return StragglerSummary(slowest_rank, slowest_time, median, spread, stragglers)


def _ratio(time_s: float, median: float) -> float:
    return time_s / median if median > 0 else math.inf


class StragglerMonitor(Callback):
    """Log which rank is slowest at its local work per batch, and warn when one is ``factor`` x slower than the median.

    Args:
        every_n_steps: compare the ranks every this many optimizer steps (one collective of one
            number per rank each time); the figures are means over those steps' batches.
        factor: a rank whose mean local time exceeds ``factor`` times the median is named in a
            warning on global rank 0; above 1.
        min_delay: a rank is named only when its time also exceeds the median by this many seconds
            per batch: ratios of times of a few microseconds (data already in memory) are noise.
        time_forward: also time ``training_step`` (up to the backward). Only where it runs no
            collective (``ddp``, ``ddp_sharded``, ``zero`` without ``sync_dist`` step logging or
            module buffers): a collective there hides the straggler (see the module's docstring).

    Use it as ``Trainer(callbacks=[StragglerMonitor()])``; it has no state in checkpoints. See the
    module's docstring for what is timed and how to read the figures under each plugin.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        factor: float = 1.5,
        min_delay: float = 0.001,
        time_forward: bool = False,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise MisconfigurationException(
                f"StragglerMonitor(every_n_steps={every_n_steps!r}): use a positive integer (the optimizer "
                "steps between two comparisons of the ranks)."
            )
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 1
        ):
            raise MisconfigurationException(
                f"StragglerMonitor(factor={factor!r}): use a number above 1 (a rank slower than factor x the "
                "median is named; at 1 or below, half the ranks would be)."
            )
        if isinstance(min_delay, bool) or not isinstance(min_delay, (int, float)) or not min_delay >= 0:
            raise MisconfigurationException(
                f"StragglerMonitor(min_delay={min_delay!r}): use a number of seconds, 0 or more (a rank is named "
                "only when it is also this much slower per batch than the median)."
            )
        if not isinstance(time_forward, bool):
            raise MisconfigurationException(
                f"StragglerMonitor(time_forward={time_forward!r}): use True (also time training_step, where it "
                "runs no collective) or False (the time between batches only)."
            )
        self.every_n_steps = every_n_steps
        self.factor = float(factor)
        self.min_delay = float(min_delay)
        self.time_forward = time_forward
        #: Each rank's host name, by global rank (gathered once per fit).
        self.hosts: list[str] = []
        #: Each rank's mean local time per batch in the last window (``nan``: it counted none).
        self.rank_times: list[float] = []
        #: The last window's comparison, or ``None`` before the first.
        self.summary: Optional[StragglerSummary] = None
        self._active = False
        self._named: frozenset[int] = frozenset()
        self._next_compare = every_n_steps
        # The timing state: plain floats, so each hook does a clock read and a few float operations.
        self._mark: Optional[float] = None  # end of the last batch; None: the time since is not counted
        self._gap = 0.0  # this batch's time since the last batch; -1.0: not counted
        self._started: Optional[float] = None  # this batch's start, until its first backward
        self._total = 0.0
        self._batches = 0
        self._warmup = 0  # batches still to leave out after the current one

    # ------------------------------------------------------------------ run setup
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for name in _TIMING_HOOKS:
            self.__dict__.pop(name, None)  # a previous run's silencing
        self._active = stage == "fit" and trainer.world_size > 1
        if not self._active:
            silenced: tuple[str, ...] = _TIMING_HOOKS
        else:
            silenced = () if self.time_forward else ("on_before_backward",)
        # The Trainer builds its per-batch hook lists after ``setup`` from the hooks a callback
        # overrides; the base class's empty hooks on the instance make these count as not overridden.
        for name in silenced:
            setattr(self, name, getattr(Callback, name).__get__(self))
        if not self._active:
            return
        # Every rank runs setup at the same point, with the process group up: one exchange per fit.
        self.hosts = [str(h) for h in trainer.plugin.all_gather_object(socket.gethostname())]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            return
        n = self.every_n_steps
        # Multiples of n from the start: every rank (also after a resume) compares at the same steps.
        self._next_compare = (trainer.batches_that_stepped // n + 1) * n
        self._named = frozenset()
        self._reset_window()
        self._mark = None
        self._warmup = _WARMUP_BATCHES - 1

    # ------------------------------------------------------------------ the timing (per batch)
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        mark = self._mark
        if self.time_forward:
            self._gap = -1.0 if mark is None else now - mark
            self._started = now
        elif mark is not None:
            self._total += now - mark
            self._batches += 1

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        started = self._started
        if started is None:  # a later backward of the same batch (manual optimization)
            return
        self._started = None
        if self._gap >= 0.0:
            self._total += self._gap + (time.perf_counter() - started)
            self._batches += 1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is not None:
            # Timing the forward, but no backward came (a skipped batch): the time between batches only.
            self._started = None
            if self._gap >= 0.0:
                self._total += self._gap
                self._batches += 1
        if trainer.batches_that_stepped >= self._next_compare:
            self._next_compare = trainer.batches_that_stepped + self.every_n_steps
            self._compare(trainer)
        if self._warmup:
            self._warmup -= 1  # the next batch is left out too
            return
        # Last, so that neither the comparison's wait nor this hook's work counts.
        self._mark = time.perf_counter()

    # ------------------------------------------------------------------ what is left out
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark = None

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._mark = None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark = None

    # ------------------------------------------------------------------ the comparison (every n steps)
    def _reset_window(self) -> None:
        self._total = 0.0
        self._batches = 0

    def _compare(self, trainer: Trainer) -> None:
        """Exchange the window's means, log the comparison on every rank, and warn (rank 0) about new stragglers."""
        mean = self._total / self._batches if self._batches else math.nan
        self._reset_window()
        local = torch.tensor([mean], dtype=torch.float64, device=trainer.plugin.root_device)
        self.rank_times = [float(t) for t in trainer.plugin.all_gather(local).flatten().tolist()]
        self.report(trainer, self.rank_times)

    def report(self, trainer: Trainer, times: list[float]) -> None:
        """Log the comparison of ``times`` (one per rank) and name the ranks that became stragglers.

        Called on every rank with the same ``times``; public so that a test (or a user with their
        own timings) can feed it without a process group.
        """
        summary = self.summary = summarize(times, self.factor, self.min_delay)
        if summary is None:
            return
        trainer.metrics.log(
            {
                METRIC_SLOWEST_RANK: summary.slowest_rank,
                METRIC_SLOWEST_TIME: summary.slowest_time,
                METRIC_MEDIAN_TIME: summary.median_time,
                METRIC_SPREAD: summary.spread,
            },
            step=max(0, trainer.batches_that_stepped - 1),
        )
        stragglers = frozenset(summary.stragglers)
        new = [rank for rank in summary.stragglers if rank not in self._named]
        self._named = stragglers
        if new and trainer.is_global_zero:
            rank_zero_warn(self._message(trainer, new, times, summary))

    def _message(
        self, trainer: Trainer, ranks: list[int], times: list[float], summary: StragglerSummary
    ) -> str:
        named = "; ".join(
            f"rank {rank} (host {self._host(rank)}): {times[rank] * 1e3:.1f} ms, "
            f"{_ratio(times[rank], summary.median_time):.1f}x the median"
            for rank in ranks
        )
        return (
            f"StragglerMonitor: {named} of {summary.median_time * 1e3:.1f} ms per batch of the rank's own work "
            f"({_TIMED[self.time_forward]}) over the {self.every_n_steps} optimizer steps up to step "
            f"{trainer.batches_that_stepped}. Every rank waits for the slowest in each step: look at that "
            f"host's data loading and load. A rank is named again only after it recovers "
            f"(StragglerMonitor(factor={self.factor:g}))."
        )

    def _host(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else "?"
