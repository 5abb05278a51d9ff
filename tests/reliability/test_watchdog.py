"""The hang watchdog: a rank that stops making progress ends every rank, with stacks and the culprit named.

* Two ranks (``plugins="ddp"``, gloo on 127.0.0.1, ``tests/jobs/watchdog_job.py``): at batch 3 rank 1
  sleeps forever inside ``training_step`` while rank 0 waits for it in the gradient all-reduce. With
  ``HangWatchdog(timeout=3 s)`` and a collective timeout of 60 s, every rank must end (with the
  watchdog's exit status, through the real ``os._exit``) within a few seconds of the timeout, each
  rank's stack must be in the output (rank 1's sleeping ``training_step`` among them), and the report
  must name rank 1 with its host, pid and phase as the stuck one and rank 0 as waiting in backward.
  The same with more trials, and a hang in the checkpoint write, runs under ``FULL_MATRIX=1``.
* One process, in this process (the exit replaced by a recorder): a hang in ``training_step`` is
  caught after ``timeout``, a hang in a checkpoint write after ``checkpoint_timeout`` and reported as
  a checkpoint save; the watchdog thread and faulthandler's timer are gone after every run.
* Argument checks, the warning when the watchdog could not fire before the collective timeout, and
  pickling (``ddp_spawn`` sends callbacks to its ranks).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from boring import BoringModel, fast_trainer, random_loader
from launch import JOBS, job_env

from trainer_core.callbacks.hang_watchdog import BACKSTOP_GRACE_SECONDS, EXIT_CODE, HangWatchdog
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.io import TorchCheckpointIO

FULL = os.environ.get("FULL_MATRIX") == "1"
TIMEOUT_S = 3.0
# From the hang to every rank gone: the timeout, up to a second until the watchdog thread looks, about
# a second for the other ranks to answer, then the report; the rest is a loaded machine's slack.
ENDS_WITHIN_S = TIMEOUT_S + 5.0


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _run_job(out: Path, *args: str) -> tuple[int, str, float, dict[int, int]]:
    """Start the job as a user would; returns its exit status, output, seconds from the hang to the last
    rank gone, and each rank's pid. Kills whatever is left, whatever happens."""
    proc = subprocess.Popen(
        [sys.executable, str(JOBS / "watchdog_job.py"), "--out", str(out), *args],
        cwd=out,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
    pids = {r: int((out / f"pid.rank{r}").read_text()) for r in (0, 1) if (out / f"pid.rank{r}").exists()}
    deadline = time.monotonic() + 15
    while not all(_pid_gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone_at = time.time()
    alive = [p for p in pids.values() if not _pid_gone(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"rank processes {alive} still run after the job ended\n{output[-3000:]}"
    assert (out / "fault.time").exists(), output[-3000:]
    return proc.returncode, output, gone_at - float((out / "fault.time").read_text()), pids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trial", range(5 if FULL else 1))
def test_a_rank_hung_in_training_step_is_named_and_every_rank_ends(tmp_path: Path, trial: int) -> None:
    code, output, ended, pids = _run_job(
        tmp_path, "--devices", "2", "--hang-rank", "1", "--hang-batch", "3", "--timeout", str(TIMEOUT_S),
        "--checkpoint-timeout", "30", "--ddp-timeout", "60",
    )  # fmt: skip
    assert len(pids) == 2, output[-3000:]
    # Rank 0 (the launching process) exits with the watchdog's status; 1 only if the launcher saw rank 1
    # exit first and ended the run itself.
    assert code in (EXIT_CODE, 1), output[-3000:]
    assert ended < ENDS_WITHIN_S, (
        f"every rank ended {ended:.1f} s after the hang (allowed {ENDS_WITHIN_S:.0f} s)"
    )
    assert ended > TIMEOUT_S
    print(
        f"hang in training_step on rank 1: every rank ended {ended:.1f} s after the hang (timeout {TIMEOUT_S} s)"
    )
    assert "timed out" not in output.lower(), "the collective timeout fired, not the watchdog"
    host = socket.gethostname()
    # Each rank dumped every thread's stack; rank 1's shows where it sleeps.
    for rank, phase in ((0, "batch 3: backward (gradient all-reduce)"), (1, "batch 3: training_step")):
        header = f"HangWatchdog: rank {rank} (host {host}, pid {pids[rank]}), in '{phase}'"
        assert header in output, output[-5000:]
    rank1_dump = output.split(f"HangWatchdog: rank 1 (host {host}, pid {pids[1]}), in")[1]
    assert re.search(r'watchdog_job\.py", line \d+ in hang_forever\n\s+File ".*watchdog_job\.py", line \d+ in training_step', rank1_dump), (
        rank1_dump[:3000]
    )  # fmt: skip
    # The report, on every rank: rank 1 is behind (stuck), rank 0 waits for it in backward.
    culprit = re.compile(
        rf"rank 1 \(host {re.escape(host)}, pid {pids[1]}\) has been in 'batch 3: training_step' for (\d+) s; "
        r"rank 0 waits in 'batch 3: backward \(gradient all-reduce\)'"
    )
    reports = culprit.findall(output)
    assert len(reports) == 2, output[-4000:]
    assert all(int(seconds) >= TIMEOUT_S - 1 for seconds in reports), reports
    assert f"exit code {EXIT_CODE}" in output


@pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1: a hang in the checkpoint write of rank 0")
@pytest.mark.timeout(120)
def test_a_rank_hung_in_a_checkpoint_write_is_reported_as_a_save(tmp_path: Path) -> None:
    code, output, ended, pids = _run_job(
        tmp_path, "--devices", "2", "--hang-in", "save", "--hang-rank", "0", "--hang-batch", "3",
        "--timeout", "2", "--checkpoint-timeout", "4", "--ddp-timeout", "60",
    )  # fmt: skip
    assert code in (EXIT_CODE, 1), output[-3000:]
    assert ended < 4 + 5.0, output[-3000:]
    host = socket.gethostname()
    dump_header = f"HangWatchdog: rank 0 (host {host}, pid {pids[0]}), in 'checkpoint save'"
    assert dump_header in output, output[-4000:]
    assert "in save_checkpoint" in output
    # Both ranks are in the save; rank 1 already waits in the barrier after it: rank 0 is the one behind.
    assert re.search(
        rf"rank 0 \(host {re.escape(host)}, pid {pids[0]}\) has been in 'checkpoint save' for \d+ s; "
        r"rank 1 waits in 'checkpoint save, in torch.distributed.barrier\(\)'",
        output,
    ), output[-4000:]


@pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1: a rank that holds the GIL in C (about 20 s)")
@pytest.mark.timeout(120)
def test_a_rank_holding_the_gil_is_named_as_not_answering_and_ended_by_faulthandler(tmp_path: Path) -> None:
    code, output, ended, pids = _run_job(
        tmp_path, "--devices", "2", "--hang-in", "gil", "--hang-rank", "1", "--hang-batch", "3",
        "--timeout", str(TIMEOUT_S), "--checkpoint-timeout", "30", "--ddp-timeout", "60",
    )  # fmt: skip
    assert code == EXIT_CODE, output[-3000:]
    # Rank 0 reports without rank 1's answer; rank 1's own faulthandler timer ends it after the grace.
    assert ended < TIMEOUT_S + BACKSTOP_GRACE_SECONDS + 5.0, output[-3000:]
    host = socket.gethostname()
    assert f"rank 0 (host {host}, pid {pids[0]}) waits in 'batch 3: backward (gradient all-reduce)'" in output
    assert "rank 1 did not answer within 5 s: stopped, dead, or stuck holding the GIL" in output
    assert "the likely culprit" in output
    assert re.search(r"Timeout \(0:00:\d+\)!", output), output[-3000:]
    assert "in hang_holding_the_gil" in output


# ---------------------------------------------------------------------------------------------- one process


class _Hang:
    """Blocks the training process where a test wants it, until the watchdog's exit releases it."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.exit_codes: list[int] = []
        self.started: Optional[float] = None

    def wait(self) -> None:
        self.started = time.monotonic()
        assert self.released.wait(30), "the watchdog did not fire"

    def exit(self, code: int) -> None:
        self.exit_codes.append(code)
        self.released.set()


class _HangInStep(BoringModel):
    def __init__(self, hang: _Hang) -> None:
        super().__init__()
        self.hang = hang

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 2 and not self.hang.released.is_set():
            self.hang.wait()
        return super().training_step(batch, batch_idx)


class _HangingIO(TorchCheckpointIO):
    def __init__(self, hang: _Hang) -> None:
        super().__init__()
        self.hang = hang

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if checkpoint["global_step"] == 3 and not self.hang.released.is_set():
            self.hang.wait()
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.fixture
def torch_warmed_up() -> None:
    """The first optimizer of a process imports torch._dynamo: seconds on a loaded machine, inside a setup
    the tests below give a checkpoint_timeout of 2.5 s."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trainer-core-hang-watchdog"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("where", "phase", "limit"),
    [("step", "batch 2: training_step", 1.0), ("save", "checkpoint save", 2.5)],
)
def test_one_process_hang_is_reported_with_its_phase_after_that_phase_s_limit(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    torch_warmed_up: None,
    where: str,
    phase: str,
    limit: float,
) -> None:
    hang = _Hang()
    watchdog = HangWatchdog(timeout=1.0, checkpoint_timeout=2.5)
    watchdog._exit = hang.exit
    callbacks: list[Any] = [watchdog]
    plugins: list[Any] = []
    if where == "save":
        plugins.append(_HangingIO(hang))
        callbacks.append(ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1))
    trainer = fast_trainer(
        max_steps=5, callbacks=callbacks, plugins=plugins, enable_checkpointing=where == "save"
    )
    trainer.fit(_HangInStep(hang) if where == "step" else BoringModel(), random_loader(16, 4))
    released_after = hang.released.is_set() and time.monotonic() - (hang.started or 0.0)
    assert hang.exit_codes == [EXIT_CODE]
    assert trainer.global_step == 5  # released, the run went on and ended normally
    err = capfd.readouterr().err
    pid, host = os.getpid(), socket.gethostname()
    match = re.search(
        rf"rank 0 \(host {re.escape(host)}, pid {pid}\) has been in '{re.escape(phase)}' for (\d+) s", err
    )
    assert match, err[-3000:]
    # The phase's own limit applied: not before it, and within about a poll after it.
    assert released_after and limit <= released_after < limit + 2.0, released_after
    # This process's stack, from faulthandler, shows where it hung.
    frame = "in wait\n" if where == "step" else "in save_checkpoint\n"
    assert f"HangWatchdog: rank 0 (host {host}, pid {pid}), in '{phase}'" in err
    dump = err.split("Python stacks of every thread:")[1]
    assert frame in dump and "in training_step" in dump if where == "step" else frame in dump, dump[:3000]
    assert not _watchdog_threads()


@pytest.mark.timeout(60)
def test_the_watchdog_stops_with_each_run_and_after_an_error() -> None:
    watchdog = HangWatchdog(timeout=1.0, checkpoint_timeout=2.0)
    fired: list[int] = []
    watchdog._exit = fired.append

    class Probe(BoringModel):
        threads_seen: list[int] = []

        def on_train_start(self) -> None:
            self.threads_seen.append(len(_watchdog_threads()))

    for run in (1, 2):  # a second fit with the same callback starts and stops its own thread
        fast_trainer(max_steps=3, callbacks=[watchdog]).fit(Probe(), random_loader(8, 4))
        assert Probe.threads_seen == [1] * run
        assert not _watchdog_threads()

    class Fails(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fast_trainer(max_steps=3, callbacks=[watchdog]).fit(Fails(), random_loader(8, 4))
    assert not _watchdog_threads()
    # faulthandler's backstop timer was cancelled with the thread: nothing fires after the run.
    time.sleep(0.1)
    assert fired == []
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"timeout": 0}, "timeout=0"),
        ({"timeout": -5}, "timeout=-5"),
        ({"timeout": float("inf")}, "timeout=inf"),
        ({"timeout": "5m"}, "timeout='5m'"),
        ({"timeout": True}, "timeout=True"),
        ({"checkpoint_timeout": timedelta(0)}, "checkpoint_timeout=datetime.timedelta(0)"),
        ({"checkpoint_timeout": None}, "checkpoint_timeout=None"),
    ],
)
def test_bad_timeouts_are_refused_naming_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(MisconfigurationException, match=re.escape(f"HangWatchdog({argument})")):
        HangWatchdog(**kwargs)


def test_timeouts_take_seconds_or_timedelta_and_survive_pickling() -> None:
    watchdog = HangWatchdog(timeout=timedelta(seconds=90), checkpoint_timeout=240)
    assert (watchdog.timeout, watchdog.checkpoint_timeout) == (90.0, 240.0)
    default = HangWatchdog()
    assert (default.timeout, default.checkpoint_timeout) == (300.0, 480.0)
    copy = pickle.loads(pickle.dumps(watchdog))
    assert (copy.timeout, copy.checkpoint_timeout, copy._thread) == (90.0, 240.0, None)


def test_a_timeout_not_under_the_collective_timeout_is_warned_about() -> None:
    plugin = type("DDPPlugin", (), {"timeout": timedelta(seconds=60)})()
    trainer = SimpleNamespace(plugin=plugin, global_rank=0, world_size=2)
    watchdog = HangWatchdog(timeout=60, checkpoint_timeout=30)
    try:
        with pytest.warns(
            UserWarning, match=r"HangWatchdog\(timeout=60 s\) is not shorter than .*timeout=0:01:00"
        ):
            watchdog.setup(trainer, None, "fit")  # type: ignore[arg-type]
    finally:
        watchdog.stop()
    watchdog = HangWatchdog(timeout=30, checkpoint_timeout=45)
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            watchdog.setup(trainer, None, "fit")  # type: ignore[arg-type]
    finally:
        watchdog.stop()
    assert not _watchdog_threads()
