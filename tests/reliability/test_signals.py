"""Pre-emption: SIGTERM mid-training saves a checkpoint, exits 0, and ``ckpt_path="last"`` continues exactly.

Each run is ``tests/jobs/signal_job.py`` in a child process, signalled from here the way a cluster
scheduler signals a job. The resumed run must end with the same parameters, bit for bit, and
the same losses on every step after the stop as a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import JOBS

from trainer_core.plugins.io import TorchCheckpointIO
from trainer_core.signals import PREEMPTED_CHECKPOINT, PreemptionHandler

JOB = str(JOBS / "signal_job.py")
_LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cwd: Path, *args: str, timeout: float = 90) -> None:
    proc = subprocess.run(
        [sys.executable, JOB, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def _interrupt(cwd: Path, out: str, signum: int, rank: int, *args: str, timeout: float = 90) -> str:
    """Start a run, wait until it trains slowly, signal ``rank``'s process; returns the run's stderr."""
    proc = subprocess.Popen(
        [sys.executable, JOB, "--out", out, *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = cwd / out / "ready"
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert proc.poll() is None, f"the run ended before it was ready:\n{proc.communicate()[1][-6000:]}"
            assert time.monotonic() < deadline, "the run never got ready"
            time.sleep(0.02)
        # rank -1: the process the user started (under ddp_spawn it runs no rank itself).
        pid = proc.pid if rank == -1 else int((cwd / out / f"pid.rank{rank}").read_text())
        os.kill(pid, signum)
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"the signalled run exited {proc.returncode}:\n{stderr[-6000:]}"
    return stderr


def _final(out: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"final.rank{rank}.pt", weights_only=True)


def _assert_same_run(resumed: Path, reference: Path, rank: int = 0) -> None:
    expected, got = _final(reference, rank), _final(resumed, rank)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differs from the uninterrupted run"
    ref_losses = json.loads((reference / f"losses.rank{rank}.json").read_text())
    losses = json.loads((resumed / f"losses.rank{rank}.json").read_text())
    assert losses and all(losses[step] == ref_losses[step] for step in losses)


@pytest.mark.timeout(150)
def test_sigterm_saves_exits_zero_and_resume_continues_exactly(tmp_path: Path) -> None:
    signum = signal.SIGTERM
    max_steps = "36"
    _run(tmp_path, "--out", "ref", "--max-steps", max_steps)
    stderr = _interrupt(
        tmp_path, "run", signum, 0, "--max-steps", max_steps, "--ready-step", "4", "--slow", "0.2"
    )
    run = tmp_path / "run"

    # The checkpoint is complete and holds the step the run stopped at, well before the end.
    (stopped,) = json.loads((run / "saved.rank0.json").read_text())
    assert 4 <= stopped < int(max_steps)
    assert not (run / "final.rank0.pt").exists(), "the signalled run must stop, not train to the end"
    checkpoint = TorchCheckpointIO().load_checkpoint(str(run / "ckpts" / PREEMPTED_CHECKPOINT))
    assert checkpoint["global_step"] == stopped
    assert signal.Signals(signum).name in stderr and "ckpt_path" in stderr

    _run(tmp_path, "--out", "run", "--max-steps", max_steps, "--resume", "last")
    _assert_same_run(run, tmp_path / "ref")
    assert min(int(step) for step in json.loads((run / "losses.rank0.json").read_text())) == stopped


@pytest.mark.timeout(200)
def test_two_ranks_save_the_same_step_when_only_one_is_signalled(tmp_path: Path) -> None:
    """SLURM's SIGUSR1 reaches rank 1 only: rank 0 learns of it through the ranks' agreement."""
    args = ("--devices", "2", "--max-steps", "40")
    _run(tmp_path, "--out", "ref", *args, timeout=150)
    _interrupt(tmp_path, "run", signal.SIGUSR1, 1, *args, "--ready-step", "2", "--slow", "0.25", timeout=150)
    run = tmp_path / "run"
    steps = [json.loads((run / f"saved.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == 1, steps
    assert 2 <= steps[0][0] < 40
    assert (run / "ckpts" / PREEMPTED_CHECKPOINT).is_file()

    _run(tmp_path, "--out", "run", *args, "--resume", "last", timeout=150)
    for rank in (0, 1):
        _assert_same_run(run, tmp_path / "ref", rank)


@pytest.mark.timeout(200)
@pytest.mark.skipif(
    os.environ.get("FULL_MATRIX") != "1",
    reason="FULL_MATRIX=1 (make stress): two spawned ranks, twice; the agreement is tested with ddp in make test",
)
def test_ddp_spawn_passes_a_signal_to_its_ranks_and_ends_the_job_cleanly(tmp_path: Path) -> None:
    """The scheduler signals the process it started; the spawned ranks save together and it exits 0."""
    args = ("--devices", "2", "--plugin", "ddp_spawn", "--max-steps", "40")
    _run(tmp_path, "--out", "ref", *args, timeout=150)
    _interrupt(tmp_path, "run", signal.SIGTERM, -1, *args, "--ready-step", "2", "--slow", "0.25", timeout=150)
    run = tmp_path / "run"
    steps = [json.loads((run / f"saved.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == 1 and 2 <= steps[0][0] < 40, steps
    assert not (run / "final.rank0.pt").exists(), "the signalled run must stop, not train to the end"

    _run(tmp_path, "--out", "run", *args, "--resume", "last", timeout=150)
    for rank in (0, 1):
        _assert_same_run(run, tmp_path / "ref", rank)


def test_handler_restores_the_previous_handler_and_hands_over_an_unused_signal() -> None:
    """A signal that arrived when no batch boundary followed is not swallowed."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        handler = PreemptionHandler()
        assert handler.install()
        # Before training begins there is nothing to save: the signal goes to the previous handler at once.
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received is None and seen == [signal.SIGUSR1]
        seen.clear()
        handler.arm()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received == signal.SIGUSR1 and not seen
        handler.restore()
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) is not handler._on_signal
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
