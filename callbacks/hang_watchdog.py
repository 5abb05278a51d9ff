"""``HangWatchdog``: a rank that stops making progress ends the job, with every rank's stack and the culprit named.

A rank that hangs (a step that never returns, a collective one rank never reaches, a checkpoint write
on a dead file system) leaves the other ranks waiting in a collective until the process group's
timeout (10 minutes by default), and then they say only "timed out". This callback turns that into a
quick, explained failure:

* **Beats.** The Trainer's hooks record where this rank is: the phase (``batch 7: training_step``,
  ``batch 7: backward (gradient all-reduce)``, ``checkpoint save``, ...), the batch and the time. A
  beat on the hot path is one tuple stored in an attribute and a counter incremented, nothing else:
  no formatting, no I/O, no lock. Text is made only when a hang is reported.
* **One thread per rank** wakes about once a second, off the hot path. When this rank's last beat is
  older than ``timeout`` (``checkpoint_timeout`` in a checkpoint save or load, in setup, in the
  first training batch, which compiles and allocates, or while any rank is in one of those), the
  rank declares a hang.
* **The ranks tell each other through the process group's store** (the c10d key-value store every
  rank already talks to), never through a collective: collectives are what hangs. Every rank's
  thread sees the declaration within about a second, dumps its Python stack (every thread, with
  :mod:`faulthandler`) to its stderr and posts its state (rank, host, pid, phase, seconds since its
  last beat). The rank that declared it waits a few seconds for the states and writes the report:
  which ranks are behind (they never reached the point the others wait in: the culprit, with its
  host and pid, what it is doing and for how long), where the others wait, and which ranks did not
  answer (stopped, dead, or stuck holding the GIL). Every rank logs the report at error level and
  ends with ``os._exit(`` :data:`EXIT_CODE` ``)``: under ``torchrun --max-restarts`` the workers are
  restarted and resume from the last checkpoint.
* **A backstop** for a process whose watchdog thread cannot run at all (C code holding the GIL):
  the thread re-arms ``faulthandler.dump_traceback_later`` each time it looks; if it cannot look for
  the phase's limit plus :data:`BACKSTOP_GRACE_SECONDS` (or its reporting stalls on a store that no
  longer answers), faulthandler itself dumps the stacks and ends the process (exit status 1).
  faulthandler holds one such timer per process: the watchdog replaces one the program set itself.

"Behind" is decided by counting beats: every rank runs the same hooks in the same order, so the
rank whose count is lowest has not reached the hook the others passed. Among ranks at the same
count, those whose training thread is not inside a ``torch.distributed`` collective (read from its
stack when the hang is reported) are behind those waiting in one: a rank still writing its part of a
checkpoint while the others wait in the barrier after it. Ranks that cannot be told apart hang
inside the same phase (a collective that never completes on any rank): the report says so.

With one process there is nobody to wait for: the rank dumps its stack, logs the report and exits
with :data:`EXIT_CODE` just the same. The watchdog runs during ``fit``, ``validate``, ``test`` and
``predict``; it stops with the run (``teardown``, or ``on_exception`` after an error).

Limits: a phase that no hook marks counts as the phase before it: the write after
``on_save_checkpoint`` (as the save), the search of a tuner whose hooks the callback sits out (as
setup), a recompilation after the first batch (as the step: raise ``timeout`` when it takes longer).
A rank whose Python cannot run (the GIL held in C code) answers nobody: it is named as not answering,
and faulthandler's timer ends it later.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim import Optimizer

    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

_logger = logging.getLogger("trainer_core")

#: Exit status of every rank of a job the watchdog ends (``EX_TEMPFAIL``: a failure worth a restart).
EXIT_CODE = 75
DEFAULT_TIMEOUT = timedelta(minutes=5)
#: Under the process group's default collective timeout (10 minutes), so the watchdog still fires first.
DEFAULT_CHECKPOINT_TIMEOUT = timedelta(minutes=8)
#: How long the declaring rank waits for the other ranks' states before it reports without them.
ANSWER_SECONDS = 5.0
#: How much longer than the phase's limit faulthandler's own timer waits before it ends a process
#: whose watchdog thread could not run; longer than the reporting takes (answers, report, reads).
BACKSTOP_GRACE_SECONDS = 15.0
_POLL_SECONDS = 1.0
_KEY_ROOT = "trainer_core/hang_watchdog"

# Phase codes stored by the beats; the text and which limit applies are looked up only when needed.
(
    _SETUP,
    _FIT_START,
    _SANITY,
    _TRAIN_START,
    _EPOCH_START,
    _STEP,
    _BACKWARD,
    _OPTIMIZER,
    _AFTER_BATCH,
    _VAL_START,
    _VAL_BATCH,
    _AFTER_VAL,
    _EPOCH_END,
    _SAVE,
    _LOAD,
    _TRAIN_END,
    _EVAL_START,
    _TEST_BATCH,
    _PREDICT_BATCH,
    _EVAL_END,
) = range(20)

_PHASES: dict[int, str] = {
    _SETUP: "setup / checkpoint load",
    _FIT_START: "fit start (checkpoint load)",
    _SANITY: "sanity check",
    _TRAIN_START: "training start (dataloaders)",
    _EPOCH_START: "epoch {epoch} start (dataloader iterator)",
    _STEP: "batch {batch}: training_step",
    _BACKWARD: "batch {batch}: backward (gradient all-reduce)",
    _OPTIMIZER: "batch {batch}: optimizer step",
    _AFTER_BATCH: "after batch {batch} (logging, validation, loading the next batch)",
    _VAL_START: "validation start",
    _VAL_BATCH: "validation batch {batch}",
    _AFTER_VAL: "after validation",
    _EPOCH_END: "epoch {epoch} end",
    _SAVE: "checkpoint save",
    _LOAD: "checkpoint load",
    _TRAIN_END: "training end",
    _EVAL_START: "{stage} start",
    _TEST_BATCH: "test batch {batch}",
    _PREDICT_BATCH: "predict batch {batch}",
    _EVAL_END: "{stage} end",
}
#: Phases that may legitimately take as long as a checkpoint save or load.
_LONG_PHASES = frozenset({_SETUP, _FIT_START, _SAVE, _LOAD})

_monotonic = time.monotonic
_C10D_FILE = os.path.join("distributed", "distributed_c10d.py")


def _seconds(value: Any, name: str) -> float:
    """``value`` (seconds or a ``timedelta``) as positive, finite seconds, or a clear error naming ``name``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise MisconfigurationException(
            f"HangWatchdog({name}={value!r}): give seconds (a number) or a datetime.timedelta."
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise MisconfigurationException(
            f"HangWatchdog({name}={value!r}): must be a positive, finite duration; to turn the watchdog "
            "off, leave the callback out."
        )
    return seconds


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file (a test's capture)
        return 2


def _lockstep_world_size(world_size: int) -> int:
    """The processes that share this one's process group and store: the world, or one.

    Under ``"ddp_ft"`` each replica group is a process group of its own, and a group that hangs
    must end alone (the others drop it from their quorum once it is gone), so each process
    watches itself.
    """
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        return 1
    return world_size


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class HangWatchdog(Callback):
    """End every rank, with its stack and a report naming the stuck rank, when a rank makes no progress.

    Args:
        timeout: how long a rank may go without progress (seconds or a ``timedelta``) in a training,
            validation, test or predict step, a collective, or between them. Keep it under the
            process group's collective timeout (``DDPPlugin(timeout=...)``, 10 minutes by default),
            or the collective fails first with a plain "timed out": a warning says so.
        checkpoint_timeout: the same for a checkpoint save or load, the setup before training (where
            the checkpoint loads) and the first training batch of a run (compilation, allocation); on
            every rank while any rank is in one of those.

    Every rank ends with exit status :data:`EXIT_CODE` (75, ``EX_TEMPFAIL``). Unlike the collective
    timeout, the watchdog also catches a hang that involves no collective (a step that never returns
    on the only rank), and it costs the training step only a few attribute stores per batch.
    """

    def __init__(
        self,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT,
        checkpoint_timeout: Union[float, timedelta] = DEFAULT_CHECKPOINT_TIMEOUT,
    ) -> None:
        self.timeout = _seconds(timeout, "timeout")
        self.checkpoint_timeout = _seconds(checkpoint_timeout, "checkpoint_timeout")
        # Replaced by tests that run a hang in their own process; the real one ends the process.
        self._exit: Callable[[int], None] = os._exit
        self._poll_seconds = min(_POLL_SECONDS, self.timeout / 4)
        self._reset()

    def _reset(self) -> None:
        # The beat: (phase code, batch index, time.monotonic()), replaced whole so the thread never
        # reads half of one; and how many beats so far, which orders the ranks in a report.
        self._beat: tuple[int, int, float] = (_SETUP, 0, _monotonic())
        self._count = 0
        # The first training batch compiles, autotunes and allocates: until the count passes this, it
        # counts under the long limit.
        self._warmup_until = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._declared = False
        self._trainer: Optional[Trainer] = None
        self._store: Any = None
        self._prefix = ""
        self._rank = 0
        self._world_size = 1
        self._collective_timeout: Optional[float] = None
        self._training_thread = threading.get_ident()

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callbacks into each rank: only the settings travel.
        return {"timeout": self.timeout, "checkpoint_timeout": self.checkpoint_timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # ------------------------------------------------------------------ start and stop
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop()
        self._reset()
        self._trainer = trainer
        self._rank = trainer.global_rank
        self._world_size = _lockstep_world_size(trainer.world_size)
        self._store = self._process_group_store()
        if self._store is not None:
            self._prefix = self._run_prefix()
        collective = getattr(trainer.plugin, "timeout", None)
        if isinstance(collective, timedelta) and trainer.world_size > 1:
            self._collective_timeout = collective.total_seconds()
            for name in ("timeout", "checkpoint_timeout"):
                if getattr(self, name) >= self._collective_timeout:
                    rank_zero_warn(
                        f"HangWatchdog({name}={getattr(self, name):g} s) is not shorter than the process group's "
                        f"collective timeout ({type(trainer.plugin).__name__}(timeout={collective})): a rank "
                        "waiting in a collective fails with a plain 'timed out' before the watchdog can name the "
                        f"stuck rank. Lower `{name}` or raise the plugin's `timeout`."
                    )
        # Armed now, not at the thread's first look: a process may hang before that.
        faulthandler.dump_traceback_later(
            self.checkpoint_timeout + BACKSTOP_GRACE_SECONDS, exit=True, file=_stderr_fd()
        )
        self._thread = threading.Thread(target=self._watch, name="trainer-core-hang-watchdog", daemon=True)
        self._thread.start()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (the run ended); a hang already declared still ends the process."""
        thread = self._thread
        if thread is None:
            return
        if self._declared:
            # The reporting is under way (this rank's collective failed because a peer already
            # exited): let it finish and end the process with the watchdog's status.
            thread.join(ANSWER_SECONDS + 10.0)
        self._stop.set()
        thread.join(5.0)
        self._thread = None
        faulthandler.cancel_dump_traceback_later()

    def _process_group_store(self) -> Any:
        if self._world_size == 1:
            return None
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        try:
            return _get_default_store()
        except (RuntimeError, ValueError):
            return None

    def _run_prefix(self) -> str:
        """Keys of this run: by launcher attempt (a store may outlive a restart) and by run in this process."""
        global _RUNS
        _RUNS += 1
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"{_KEY_ROOT}/{attempt}/{_RUNS}/"

    # ------------------------------------------------------------------ beats (the hot path)
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_FIT_START, 0, _monotonic())

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._count += 1
        self._beat = (_LOAD, 0, _monotonic())

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_SANITY, 0, _monotonic())

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_TRAIN_START, 0, _monotonic())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_TRAIN_START, 0, _monotonic())
        # Epoch start, then the first batch's start, backward, optimizer step and end.
        self._warmup_until = self._count + 5

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_EPOCH_START, 0, _monotonic())

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._count += 1
        self._beat = (_STEP, batch_idx, _monotonic())

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        self._count += 1
        self._beat = (_BACKWARD, self._beat[1], _monotonic())

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        self._count += 1
        self._beat = (_OPTIMIZER, self._beat[1], _monotonic())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count += 1
        self._beat = (_AFTER_BATCH, batch_idx, _monotonic())

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_EPOCH_END, 0, _monotonic())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_TRAIN_END, 0, _monotonic())

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_VAL_START, 0, _monotonic())

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._count += 1
        self._beat = (_VAL_BATCH, batch_idx, _monotonic())

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_AFTER_VAL, 0, _monotonic())

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_EVAL_START, 0, _monotonic())

    def on_test_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._count += 1
        self._beat = (_TEST_BATCH, batch_idx, _monotonic())

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_EVAL_END, 0, _monotonic())

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_EVAL_START, 0, _monotonic())

    def on_predict_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._count += 1
        self._beat = (_PREDICT_BATCH, batch_idx, _monotonic())

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count += 1
        self._beat = (_EVAL_END, 0, _monotonic())

    def state_dict(self) -> dict[str, Any]:
        # The first thing a checkpoint save asks the callbacks for: the save starts here (nothing is saved).
        self._count += 1
        self._beat = (_SAVE, 0, _monotonic())
        return {}

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._count += 1
        self._beat = (_SAVE, 0, _monotonic())

    # ------------------------------------------------------------------ the watching thread
    def _limit(self, phase: int) -> float:
        if phase in _LONG_PHASES or self._count <= self._warmup_until:
            return self.checkpoint_timeout
        return self.timeout

    def _watch(self) -> None:
        in_long_phase = False  # what this rank last told the others
        fd = _stderr_fd()
        while not self._stop.wait(self._poll_seconds):
            phase, _, since = self._beat
            limit = self._limit(phase)
            # Pushed back at every look: it fires only when this thread cannot run (once a second, a
            # timer thread replaced: nothing on the training thread).
            faulthandler.dump_traceback_later(limit + BACKSTOP_GRACE_SECONDS, exit=True, file=fd)
            store = self._store
            if store is not None:
                try:
                    long_now = limit == self.checkpoint_timeout
                    if long_now != in_long_phase:
                        # How many ranks are in a save or load: a rank that waits for one gets its long limit.
                        store.add(self._prefix + "in_checkpoint", 1 if long_now else -1)
                        in_long_phase = long_now
                    if store.check([self._prefix + "hang"]):
                        self._on_hang(declared_here=False)
                        return
                    stale = _monotonic() - since > limit
                    if (
                        stale
                        and not long_now
                        and store.add(self._prefix + "in_checkpoint", 0) > 0
                        and _monotonic() - since <= self.checkpoint_timeout
                    ):
                        stale = False
                except Exception as err:  # the store's host (rank 0) is gone: watch this rank alone
                    _logger.debug(f"HangWatchdog: the process group's store stopped answering ({err!r})")
                    self._store = store = None
                    stale = _monotonic() - since > limit
            else:
                stale = _monotonic() - since > limit
            if stale and not self._stop.is_set():
                self._on_hang(declared_here=True)
                return

    def _on_hang(self, declared_here: bool) -> None:
        """Dump this rank's stack, post its state, report (or read the report), and end the process."""
        self._declared = True
        # The reporting waits on the store: should it stall (a frozen store host), faulthandler ends it.
        faulthandler.dump_traceback_later(
            ANSWER_SECONDS + BACKSTOP_GRACE_SECONDS, exit=True, file=_stderr_fd()
        )
        store = self._store
        reporter = True
        if store is not None and declared_here:
            try:
                reporter = store.add(self._prefix + "hang", 1) == 1
            except Exception:
                store = None
        elif store is not None:
            reporter = False
        me = self._state()
        self._dump_stack(me)
        if store is None:
            # No store (one process, or its host is gone): this rank's own report.
            self._say(self._report({self._rank: me}, world_size=1))
            self._exit(EXIT_CODE)
            return
        try:
            store.set(f"{self._prefix}state/{self._rank}", json.dumps(me))
            if reporter:
                readers = self._collect_and_report(store, me)
            else:
                self._say(self._read_report(store))
        except Exception as err:
            self._say(
                f"[trainer-core] HangWatchdog: rank {self._rank} (host {me['host']}, pid {me['pid']}) has been "
                f"in '{me['phase']}' for {me['seconds']:.0f} s; the other ranks' states could not be read "
                f"({err!r}). Exiting with code {EXIT_CODE}."
            )
        else:
            if reporter:
                self._wait_for_readers(store, readers)
        self._exit(EXIT_CODE)

    def _state(self) -> dict[str, Any]:
        phase, batch, since = self._beat
        trainer = self._trainer
        stage = getattr(trainer, "state_stage", None) or "run"
        epoch = getattr(trainer, "current_epoch", 0) if trainer is not None else 0
        text = _PHASES[phase].format(batch=batch, epoch=epoch, stage=stage)
        if phase == _VAL_BATCH and getattr(trainer, "sanity_checking", False):
            text = "sanity check: " + text
        collective = self._collective_of_training_thread()
        if collective is not None:
            text += f", in torch.distributed.{collective}()"
        return {
            "rank": self._rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "phase": text,
            "seconds": _monotonic() - since,
            "count": self._count,
            "in_collective": collective is not None,
            "limit": self._limit(phase),
        }

    def _collective_of_training_thread(self) -> Optional[str]:
        """The ``torch.distributed`` collective the training thread waits in now, read from its stack, or ``None``.

        Tells apart, within one phase, the rank that has not reached a collective from those that wait
        in it (a rank-0 checkpoint write and the others' barrier after it). A collective that autograd
        runs from C++ (DDP's gradient all-reduce) leaves no Python frame: the backward phase says it.
        """
        frame = sys._current_frames().get(self._training_thread)
        found = None
        while frame is not None:
            if frame.f_code.co_filename.endswith(_C10D_FILE):
                found = frame.f_code.co_name  # the outermost: the public function, not its helpers
            frame = frame.f_back
        return found

    def _dump_stack(self, me: dict[str, Any]) -> None:
        """Every thread's Python stack, written in one piece so that ranks sharing a terminal do not interleave."""
        header = (
            f"\n[trainer-core] HangWatchdog: rank {me['rank']} (host {me['host']}, pid {me['pid']}), "
            f"in '{me['phase']}' for {me['seconds']:.0f} s; Python stacks of every thread:\n"
        )
        fd = _stderr_fd()
        try:
            sys.stderr.flush()
        except Exception:
            pass
        try:
            with tempfile.TemporaryFile() as buffer:
                faulthandler.dump_traceback(file=buffer, all_threads=True)
                buffer.seek(0)
                os.write(fd, header.encode() + buffer.read())
        except OSError:  # no temporary file: straight to stderr
            os.write(fd, header.encode())
            faulthandler.dump_traceback(file=fd, all_threads=True)

    def _collect_and_report(self, store: Any, me: dict[str, Any]) -> int:
        """Gather the states that arrive within :data:`ANSWER_SECONDS`, log the report and post it; returns
        how many other ranks will read it.

        A store that fails meanwhile (its host, rank 0, has exited) loses nobody's report: this rank
        reports with the states it has. The report is logged before anything else can end this process
        (a launcher that sees another rank exit ends its own).
        """
        states: dict[int, dict[str, Any]] = {self._rank: me}
        deadline = _monotonic() + ANSWER_SECONDS
        try:
            while len(states) < self._world_size and _monotonic() < deadline:
                for rank in range(self._world_size):
                    key = f"{self._prefix}state/{rank}"
                    if rank not in states and store.check([key]):
                        states[rank] = json.loads(store.get(key))
                time.sleep(0.1)
        except Exception:
            pass
        report = self._report(states, self._world_size)
        self._say(report)
        try:
            store.set(self._prefix + "report", report)
        except Exception:
            return 0
        return len(states) - 1

    def _wait_for_readers(self, store: Any, readers: int) -> None:
        """Briefly, until the other ranks have read the report: this rank may host the store."""
        if not readers:
            return
        deadline = _monotonic() + 2.0
        try:
            while store.add(self._prefix + "read", 0) < readers and _monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            return
        time.sleep(0.2)  # the store's replies to the last readers are still on their way

    def _read_report(self, store: Any) -> str:
        key = self._prefix + "report"
        deadline = _monotonic() + ANSWER_SECONDS + 3.0
        while _monotonic() < deadline:
            if store.check([key]):
                report = store.get(key).decode()
                try:
                    store.add(self._prefix + "read", 1)
                except Exception:  # the reporter (perhaps the store's host) exited first: nothing lost
                    pass
                return report
            time.sleep(0.1)
        return (
            f"[trainer-core] HangWatchdog: rank {self._rank}: another rank declared a hang but wrote no report "
            f"within {ANSWER_SECONDS + 3.0:.0f} s. Exiting with code {EXIT_CODE}."
        )

    def _report(self, states: dict[int, dict[str, Any]], world_size: int) -> str:
        """Who is behind (the culprit), where the others wait, and who did not answer."""
        lines = [
            f"[trainer-core] HangWatchdog: a rank made no progress within its limit (timeout={self.timeout:g} s; "
            f"checkpoint_timeout={self.checkpoint_timeout:g} s for checkpoint saves, loads, setup and the first "
            f"batch); ending every rank with exit code {EXIT_CODE}."
        ]

        # Behind: fewest beats; among equals, not (yet) in the collective the others wait in.
        def progress(state: dict[str, Any]) -> tuple[int, bool]:
            return state["count"], state.get("in_collective", False)

        lowest = min(progress(s) for s in states.values())
        behind = [states[r] for r in sorted(states) if progress(states[r]) == lowest]
        waiting = [states[r] for r in sorted(states) if progress(states[r]) != lowest]
        culprits = "; ".join(
            f"rank {s['rank']} (host {s['host']}, pid {s['pid']}) has been in '{s['phase']}' for {s['seconds']:.0f} s"
            for s in behind
        )
        silent_ranks = world_size - len(states)
        if not waiting and silent_ranks:
            waits = "; ".join(
                f"rank {s['rank']} (host {s['host']}, pid {s['pid']}) waits in '{s['phase']}' for {s['seconds']:.0f} s"
                for s in behind
            )
            lines.append(f"  {waits}.")
        elif not waiting and len(states) > 1:
            lines.append(
                f"  Every answering rank is at the same point: {culprits}. None is behind the others: the hang is "
                "inside this phase on every rank (a collective that never completes, or the same slow work)."
            )
        else:
            groups: dict[str, list[dict[str, Any]]] = {}
            for s in waiting:
                groups.setdefault(s["phase"], []).append(s)
            waits = "; ".join(
                f"{_names([s['rank'] for s in group])} {'waits' if len(group) == 1 else 'wait'} in '{phase}' "
                f"(for {max(s['seconds'] for s in group):.0f} s)"
                for phase, group in groups.items()
            )
            lines.append(f"  {culprits}" + (f"; {waits}." if waits else "."))
        silent = [r for r in range(world_size) if r not in states]
        if silent:
            suspect = (
                " It never reached the point where the others wait: the likely culprit."
                if not waiting and len(states) >= 1 and world_size > 1
                else ""
            )
            lines.append(
                f"  {_names(silent)} did not answer within {ANSWER_SECONDS:g} s: stopped, dead, or stuck holding "
                f"the GIL (faulthandler's own timer dumps such a process's stack later).{suspect}"
            )
        where = "Each rank's Python stacks are" if world_size > 1 else "The Python stacks are"
        lines.append(f"  {where} above in its log (faulthandler, every thread).")
        if self._collective_timeout is not None:
            lines.append(
                f"  (The process group's collective timeout, {self._collective_timeout:g} s, was not reached.)"
            )
        lines.append(
            "  If this work legitimately takes longer, raise HangWatchdog(timeout=...) (checkpoint saves, loads and "
            "setup: checkpoint_timeout=...)."
        )
        return "\n".join(lines)

    def _say(self, report: str) -> None:
        """At error level in the log; on stderr too when no log handler writes there."""
        _logger.error(report)
        to_stderr = any(
            isinstance(h, logging.StreamHandler)
            and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__)
            for h in _logger.handlers
        )
        if not to_stderr or not _logger.isEnabledFor(logging.ERROR):
            try:
                sys.stderr.write(report + "\n")
            except Exception:
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


#: Runs started in this process: every rank counts the same, so it scopes the keys of one run.
_RUNS = 0
