"""SLURM requeue: on the requeue signal the job saves, runs ``scontrol requeue`` once, exits 0, and continues.

SLURM is played by its environment variables and a fake ``scontrol`` first on the PATH that records
who called it with what (and can fail or hang on request). The end-to-end runs are
``tests/jobs/slurm_job.py`` in child processes; the requeued run must end with the same parameters,
bit for bit, as a run that was never stopped. The failure cases and the rules (which signal, which
job id, which rank) run in this process on a tiny module, where they cost a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from boring import BoringModel, quiet_trainer, random_loader
from launch import JOBS, LAUNCH_VARS, job_env

from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.environments import LocalEnvironment, SLURMEnvironment
from trainer_core.plugins.io import TorchCheckpointIO
from trainer_core.signals import PREEMPTED_CHECKPOINT, PreemptionHandler, requeue_job

JOB = str(JOBS / "slurm_job.py")
#: FULL_MATRIX=1 (make stress) adds the two-rank run (two processes started as srun would).
FULL = os.environ.get("FULL_MATRIX") == "1"
JOB_ID = "4242"
#: One task of a batch job started by ``srun`` (``SLURM_STEP_ID``), as SLURM sets them.
SLURM_VARS = {
    "SLURM_JOB_ID": JOB_ID,
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_NODELIST": "localhost",
}

_FAKE_SCONTROL = """#!/bin/sh
echo "$SLURM_PROCID $*" >> "$FAKE_SCONTROL_LOG"
if [ -n "$FAKE_SCONTROL_STDERR" ]; then echo "$FAKE_SCONTROL_STDERR" >&2; fi
if [ -n "$FAKE_SCONTROL_SLEEP" ]; then sleep "$FAKE_SCONTROL_SLEEP"; fi
exit "${FAKE_SCONTROL_EXIT:-0}"
"""


def _fake_scontrol(folder: Path) -> tuple[str, Path]:
    """A folder holding a fake ``scontrol`` (to put first on the PATH) and the file it records calls in."""
    bin_dir = folder / "fake-bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(_FAKE_SCONTROL)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(bin_dir), folder / "scontrol.calls"


def _calls(log: Path) -> list[str]:
    """``"<SLURM_PROCID of the caller> <argv>"`` per call of the fake ``scontrol``."""
    return log.read_text().splitlines() if log.exists() else []


def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process, as outside any job: no launch or SLURM variables."""
    for key in list(os.environ):
        if key in LAUNCH_VARS or key.startswith("SLURM_"):
            monkeypatch.delenv(key)


# ---------------------------------------------------------------------------------------- real processes
def _job_env(extra: dict[str, str]) -> dict[str, str]:
    env = job_env()
    env.update(extra)
    return env


def _start(cwd: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, JOB, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{stderr[-6000:]}"
    return stderr


def _reference(out: Path, *args: str) -> None:
    """The job's uninterrupted run, in this process (one thread, as in the job) to save starting another."""
    import slurm_job

    threads = torch.get_num_threads()
    try:
        slurm_job.main(["--out", str(out), *args])
    finally:
        torch.set_num_threads(threads)


def _final(out: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"final.rank{rank}.pt", weights_only=True)


@pytest.mark.timeout(200)
def test_requeue_signal_saves_requeues_once_and_the_requeued_job_continues_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_slurm(monkeypatch)  # for the reference, run here
    bin_dir, log = _fake_scontrol(tmp_path)
    slurm = {
        **SLURM_VARS,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SCONTROL_LOG": str(log),
    }
    steps = ("--max-steps", "30")
    signalled = _start(
        tmp_path,
        _job_env(slurm),
        "--out", "run", *steps, "--requeue-signal", "SIGUSR2", "--signal", "SIGUSR2", "--signal-at-step", "7",
    )  # fmt: skip
    _reference(tmp_path / "ref", *steps)  # meanwhile
    stderr = _finish(signalled)
    run = tmp_path / "run"
    path = run / "ckpts" / PREEMPTED_CHECKPOINT

    # Saved at the step the signal came, complete; the job stopped there and asked SLURM once to requeue it.
    assert json.loads((run / "saved.rank0.json").read_text()) == [7]
    assert TorchCheckpointIO().load_checkpoint(str(path))["global_step"] == 7
    assert not (run / "final.rank0.pt").exists(), "the signalled run must stop, not train to the end"
    assert _calls(log) == [f"0 requeue {JOB_ID}"]
    assert f"requeued SLURM job {JOB_ID}; it continues from {path}" in stderr

    # SLURM starts the requeued job with SLURM_RESTART_COUNT=1: fit without ckpt_path continues from it.
    _finish(_start(tmp_path, _job_env({**slurm, "SLURM_RESTART_COUNT": "1"}), "--out", "run", *steps))
    expected, got = _final(tmp_path / "ref"), _final(run)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differs from the uninterrupted run"
    losses = json.loads((run / "losses.rank0.json").read_text())
    ref_losses = json.loads((tmp_path / "ref" / "losses.rank0.json").read_text())
    assert min(int(step) for step in losses) == 7 and all(losses[s] == ref_losses[s] for s in losses)
    assert _calls(log) == [f"0 requeue {JOB_ID}"], "the run that finished must not requeue"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    not FULL, reason="FULL_MATRIX=1 (make stress): two processes; the agreement's rule is unit-tested"
)
@pytest.mark.timeout(200)
def test_two_ranks_requeue_once_from_rank_zero_when_only_rank_one_is_signalled(tmp_path: Path) -> None:
    """``srun`` started two tasks; SLURM's signal reaches rank 1 only: both save one step, rank 0 requeues."""
    bin_dir, log = _fake_scontrol(tmp_path)
    common = {
        **SLURM_VARS,
        "SLURM_NTASKS": "2",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SCONTROL_LOG": str(log),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    args = ("--out", "run", "--devices", "2", "--max-steps", "40", "--slow", "0.2")
    args += (
        "--requeue-signal",
        "SIGUSR2",
        "--signal",
        "SIGUSR2",
        "--signal-at-step",
        "2",
        "--signal-rank",
        "1",
    )
    procs = [
        _start(tmp_path, _job_env({**common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}), *args)
        for rank in (0, 1)
    ]
    stderr = [_finish(proc, timeout=150) for proc in procs]
    run = tmp_path / "run"
    saved = [json.loads((run / f"saved.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert saved[0] == saved[1] and len(saved[0]) == 1 and 2 <= saved[0][0] < 40, saved
    assert (
        TorchCheckpointIO().load_checkpoint(str(run / "ckpts" / PREEMPTED_CHECKPOINT))["global_step"]
        == saved[0][0]
    )
    assert _calls(log) == [f"0 requeue {JOB_ID}"], "rank 0, and only rank 0, requeues the job, once"
    assert "requeued SLURM job" in stderr[0] and "requeued SLURM job" not in stderr[1]


# ---------------------------------------------------------------------------------------- in this process
@pytest.fixture
def slurm_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """SLURM's variables of a one-task job and a fake ``scontrol`` first on the PATH; yields its call log."""
    _no_slurm(monkeypatch)
    for key, value in SLURM_VARS.items():
        monkeypatch.setenv(key, value)
    bin_dir, log = _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    yield log


@pytest.fixture
def messages() -> Iterator[list[str]]:
    """What trainer-core logs during the test (its logger does not propagate to pytest's)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("trainer_core")
    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


class _SignalAt(Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _fit_signalled(folder: Path, signum: int, plugins: Optional[list[Any]] = None) -> Path:
    """A tiny fit that receives ``signum`` after step 3; returns the pre-emption checkpoint's path."""
    trainer = quiet_trainer(
        max_steps=20,
        plugins=plugins,
        default_root_dir=str(folder),
        enable_checkpointing=True,
        callbacks=[_SignalAt(3, signum), ModelCheckpoint(dirpath=str(folder / "ckpts"), save_top_k=0)],
    )
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(BoringModel(), random_loader(32, 4, batch_size=4))
    assert stopped.value.code == 0
    assert trainer.global_step == 3
    path = folder / "ckpts" / PREEMPTED_CHECKPOINT
    assert TorchCheckpointIO().load_checkpoint(str(path))["global_step"] == 3, (
        "the checkpoint must be complete"
    )
    return path


def test_a_slurm_job_found_by_itself_requeues_its_array_task_on_sigusr1(
    slurm_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, messages: list[str]
) -> None:
    """No environment passed: a one-task batch job gets Lightning's defaults; an array task requeues itself only."""
    monkeypatch.delenv("SLURM_STEP_ID")  # `python train.py` in the sbatch script itself: no srun
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    path = _fit_signalled(tmp_path, signal.SIGUSR1)
    assert _calls(slurm_job) == ["0 requeue 77_3"]
    assert f"requeued SLURM job 77_3; it continues from {path}." in messages


def test_without_scontrol_the_job_says_what_to_do_and_ends_cleanly(
    slurm_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, messages: list[str]
) -> None:
    """As in a container without SLURM's tools (Lightning #21404): the checkpoint is kept, the message says how on."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    path = _fit_signalled(tmp_path, signal.SIGUSR2, [SLURMEnvironment(requeue_signal=signal.SIGUSR2)])
    (warning,) = [m for m in messages if m.startswith("Could not requeue")]
    assert "`scontrol` is not on the PATH" in warning and f"The checkpoint is safe at {path}." in warning
    assert f"scontrol requeue {JOB_ID}" in warning and 'ckpt_path="last"' in warning
    assert _calls(slurm_job) == []


def test_a_failing_scontrol_is_reported_with_its_error(
    slurm_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, messages: list[str]
) -> None:
    refusal = "slurm_requeue error: Requested operation is presently disabled"
    monkeypatch.setenv("FAKE_SCONTROL_EXIT", "1")
    monkeypatch.setenv("FAKE_SCONTROL_STDERR", refusal)
    path = _fit_signalled(tmp_path, signal.SIGUSR1)
    (warning,) = [m for m in messages if m.startswith("Could not requeue")]
    assert f"`scontrol requeue {JOB_ID}` exited with status 1: {refusal}" in warning
    assert f"The checkpoint is safe at {path}." in warning
    assert _calls(slurm_job) == [f"0 requeue {JOB_ID}"]


def test_scontrol_that_does_not_answer_is_given_up_on(
    slurm_job: Path, monkeypatch: pytest.MonkeyPatch, messages: list[str]
) -> None:
    monkeypatch.setenv("FAKE_SCONTROL_SLEEP", "5")
    assert not requeue_job(SLURMEnvironment(), "/ckpts/preempted.ckpt", timeout=0.3)
    assert any("did not answer within 0.3 s" in m and "/ckpts/preempted.ckpt" in m for m in messages)


@pytest.mark.parametrize(
    ("signum", "environment"),
    [
        pytest.param(signal.SIGTERM, None, id="sigterm-stops"),
        pytest.param(
            signal.SIGUSR1, SLURMEnvironment(requeue_signal="SIGUSR2"), id="sigusr1-stops-when-usr2-requeues"
        ),
        pytest.param(signal.SIGUSR1, SLURMEnvironment(auto_requeue=False), id="auto-requeue-off"),
    ],
)
def test_signals_that_only_save_and_stop_do_not_requeue(
    slurm_job: Path, tmp_path: Path, signum: int, environment: Optional[SLURMEnvironment]
) -> None:
    _fit_signalled(tmp_path, signum, [environment] if environment is not None else None)
    assert _calls(slurm_job) == []


def test_outside_slurm_sigusr1_still_only_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_slurm(monkeypatch)
    bin_dir, log = _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log))
    _fit_signalled(tmp_path, signal.SIGUSR1)
    assert _calls(log) == []


# ---------------------------------------------------------------------------------------- the rules
def test_requeue_job_id_follows_slurm_array_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert SLURMEnvironment.requeue_job_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert SLURMEnvironment.requeue_job_id() == "1234"
    # An array task's own SLURM_JOB_ID differs from the array's; scontrol wants <array>_<task>.
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1200")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "34")
    assert SLURMEnvironment.requeue_job_id() == "1200_34"


def test_requeue_signal_is_configurable_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SLURMEnvironment().requeue_signal == signal.SIGUSR1 and SLURMEnvironment().auto_requeue
    for given in (signal.SIGUSR2, int(signal.SIGUSR2), "SIGUSR2", "usr2"):
        assert SLURMEnvironment(requeue_signal=given).requeue_signal == signal.SIGUSR2
    for bad, match in (
        (signal.SIGKILL, "cannot catch SIGKILL"),
        ("SIGNOPE", "not a signal"),
        (999, "not a signal"),
    ):
        with pytest.raises(MisconfigurationException, match=match):
            SLURMEnvironment(requeue_signal=bad)
    with pytest.raises(MisconfigurationException, match="auto_requeue='yes'"):
        SLURMEnvironment(auto_requeue="yes")  # type: ignore[arg-type]
    # Lightning #21404: change the signal for SLURM runs only, without giving an environment.
    monkeypatch.setattr(SLURMEnvironment, "default_requeue_signal", signal.SIGUSR2)
    assert SLURMEnvironment().requeue_signal == signal.SIGUSR2


def test_trainer_takes_the_environment_from_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_slurm(monkeypatch)
    for key, value in {**SLURM_VARS, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}.items():
        monkeypatch.setenv(key, value)
    environment = SLURMEnvironment(requeue_signal=signal.SIGUSR2)
    trainer = quiet_trainer(devices=2, plugins=["ddp", environment])
    assert trainer.plugin.cluster_environment is environment
    assert (trainer.global_rank, trainer.world_size) == (1, 2)
    one = SLURMEnvironment(auto_requeue=False)
    assert quiet_trainer(plugins=[one]).plugin.cluster_environment is one  # one process keeps it too
    with pytest.raises(MisconfigurationException, match="2 cluster environments"):
        quiet_trainer(plugins=[SLURMEnvironment(), LocalEnvironment()])
    from trainer_core.plugins.ddp import DDPPlugin

    with pytest.raises(MisconfigurationException, match="pass the environment in one place"):
        quiet_trainer(devices=2, plugins=[DDPPlugin(cluster_environment=SLURMEnvironment()), environment])


class _TwoRanks:
    """The reduction of a two-rank run whose other rank holds ``other``."""

    world_size = 2

    def __init__(self, other: list[float]) -> None:
        self.plugin = self
        self.other = torch.tensor(other, dtype=torch.float64)

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        return torch.maximum(tensor, self.other)


def test_ranks_agree_on_a_requeue_over_a_stop() -> None:
    """One rank got SIGTERM, the other the requeue signal: both requeue (SIGUSR1's number is below SIGTERM's)."""
    handler = PreemptionHandler(environment=SLURMEnvironment())
    assert signal.SIGUSR1 in handler.signals and handler.requeues
    handler.received = signal.SIGTERM
    assert handler.agreed(_TwoRanks([1024.0 + signal.SIGUSR1, 0.01])) == signal.SIGUSR1  # type: ignore[arg-type]
    handler = PreemptionHandler(environment=SLURMEnvironment())
    handler.received = signal.SIGUSR1
    assert handler.agreed(_TwoRanks([float(signal.SIGTERM), 0.01])) == signal.SIGUSR1  # type: ignore[arg-type]
    # Without auto_requeue the requeue signal is a stop like the others: the largest number wins, as before.
    handler = PreemptionHandler(environment=SLURMEnvironment(auto_requeue=False))
    handler.received = signal.SIGUSR1
    assert handler.agreed(_TwoRanks([float(signal.SIGTERM), 0.01])) == signal.SIGTERM  # type: ignore[arg-type]
    # A requeue signal that comes after a stop on the same rank outranks it.
    handler = PreemptionHandler(environment=SLURMEnvironment(requeue_signal=signal.SIGUSR2))
    handler.arm()
    handler._on_signal(signal.SIGTERM, None)
    handler._on_signal(signal.SIGUSR2, None)
    assert handler.received == signal.SIGUSR2 and signal.SIGUSR2 in handler.signals


@pytest.mark.parametrize("array_task", [False, True], ids=["job", "array-task"])
def test_requeue_command_and_defaults_match_lightning(
    slurm_job: Path, monkeypatch: pytest.MonkeyPatch, array_task: bool
) -> None:
    """Lightning's own SLURM handler, run against the same fake scontrol, asks for the very same requeue."""
    from unittest import mock

    from lightning_fabric.plugins.environments import SLURMEnvironment as LightningSLURMEnvironment
    from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector

    if array_task:
        monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1200")
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "34")
    _SignalConnector(mock.MagicMock(loggers=[], is_global_zero=True))._slurm_sigusr_handler_fn(
        signal.SIGUSR1, None
    )
    lightning_calls = _calls(slurm_job)
    slurm_job.unlink()
    assert requeue_job(SLURMEnvironment(), "/ckpts/preempted.ckpt")
    assert _calls(slurm_job) == lightning_calls == [f"0 requeue {'1200_34' if array_task else JOB_ID}"]
    theirs, ours = LightningSLURMEnvironment(), SLURMEnvironment()
    assert (ours.auto_requeue, ours.requeue_signal) == (theirs.auto_requeue, theirs.requeue_signal)
