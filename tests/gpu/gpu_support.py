"""What the GPU suite's tests share: whether they run, on what, and how they start ``tests/jobs/gpu_job.py``.

Nothing here imports torch unless a CUDA device may be present (or the dry run asks for the suite),
so collecting the suite on a machine without a GPU costs nothing and ends in one clear skip.

``GPU_SUITE_DEVICE=cpu`` is the dry run: the same tests on the CPU (gloo between ranks, CPU autocast),
``GPU_SUITE_CPU_DEVICES`` standing in for the number of GPUs (2 by default, so the two-GPU tests run
too). What only CUDA has (nccl, pinned staging buffers, the CUDA generator) is checked by its CPU
analogue there; each test says which.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch import JOBS, job_env

JOB = str(JOBS / "gpu_job.py")
MODE = os.environ.get("GPU_SUITE_DEVICE", "cuda").strip().lower() or "cuda"
if MODE not in ("cuda", "cpu"):
    raise ValueError(f"GPU_SUITE_DEVICE={MODE!r}: use 'cuda' (the default) or 'cpu' (the dry run).")
DRY_RUN = MODE == "cpu"
#: The accelerator every job of the suite runs on.
DEVICE = MODE
#: A job's seconds before the test fails it (a hung collective ends here, not at the pytest timeout):
#: a job takes about 10 s on a GPU, up to 30 s on two busy CPU cores.
JOB_TIMEOUT = float(os.environ.get("GPU_SUITE_JOB_TIMEOUT", "100" if DRY_RUN else "60"))


def _cuda_device_count() -> int:
    """CUDA devices this Python's torch sees; 0 without importing torch where no NVIDIA device node exists."""
    if "torch" not in sys.modules and not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


DEVICE_COUNT = int(os.environ.get("GPU_SUITE_CPU_DEVICES", "2")) if DRY_RUN else _cuda_device_count()
ENABLED = DEVICE_COUNT > 0
SKIP_REASON = (
    "no CUDA device found (torch.cuda.is_available() is False); "
    "GPU_SUITE_DEVICE=cpu runs these tests on the CPU as a dry run"
)
#: Ranks of the multi-process tests: 2 where there are two devices, else 1 (a one-rank process group).
RANKS = min(2, DEVICE_COUNT)

#: The marks of every module of the suite.
SUITE_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not ENABLED, reason=SKIP_REASON)]
needs_two_devices = pytest.mark.skipif(
    ENABLED and DEVICE_COUNT < 2,
    reason=f"needs 2 CUDA devices, found {DEVICE_COUNT} (torch.cuda.device_count())",
)


def expected_backend() -> str:
    return "nccl" if DEVICE == "cuda" else "gloo"


def device_of_rank(rank: int) -> str:
    """The device a rank's parameters live on: its own GPU, or the CPU in the dry run."""
    return f"cuda:{rank}" if DEVICE == "cuda" else "cpu"


#: Process groups of the jobs running now: a job is in a session of its own, so whoever stops pytest
#: (scripts/gpu_suite.py's limit sends SIGTERM) would not stop it; the handler below does.
_LIVE_JOBS: set[int] = set()


def _stop_jobs_and_exit(signum: int, frame: Any) -> None:
    """Stop the running jobs, then this process at once: pytest would report the signal as a failure of
    the running test and go on to the next one."""
    for pgid in list(_LIVE_JOBS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(128 + signum)


if ENABLED:
    signal.signal(signal.SIGTERM, _stop_jobs_and_exit)


def run_job(out: Path, *args: str, timeout: float = JOB_TIMEOUT) -> None:
    """Start ``gpu_job.py`` as a user starts a script, on the suite's accelerator; it must succeed."""
    out.mkdir(parents=True, exist_ok=True)
    env = job_env()
    if DRY_RUN:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on the CPU on a machine with GPUs too
    cmd = [sys.executable, JOB, "--out", str(out), "--accelerator", DEVICE, *args]
    # A session of its own: on a timeout the whole job goes, also the ranks its launcher started.
    proc = subprocess.Popen(
        cmd,
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _LIVE_JOBS.add(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    finally:
        _LIVE_JOBS.discard(proc.pid)
    if timed_out:
        pytest.fail(
            f"gpu_job {' '.join(args)} ran past {timeout:.0f} s:\n{_tail(stdout, 3000)}\n{_tail(stderr)}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"gpu_job {' '.join(args)} exited with {proc.returncode}:\n{_tail(stdout, 3000)}\n{_tail(stderr)}"
        )


def _tail(text: Any, n: int = 6000) -> str:
    return (text or "")[-n:]


def record(out: Path, run: str, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of ``run`` wrote at the end of training (``train`` scenario)."""
    return json.loads((out / f"{run}.rank{rank}.json").read_text())


def tensors(out: Path, run: str, rank: int) -> dict[str, Any]:
    """``trace`` (flat full weights after each batch) and ``final`` (full weights) of one rank."""
    import torch

    return torch.load(out / f"{run}.rank{rank}.pt", weights_only=True)


def assert_close(actual: dict[str, Any], expected: dict[str, Any], atol: float, where: str) -> None:
    assert list(actual) == list(expected), f"{where}: {list(actual)} != {list(expected)}"
    for name, want in expected.items():
        diff = (actual[name].float() - want.float()).abs().max().item()
        assert diff <= atol, f"{where}: {name} differs by {diff:.3g} (allowed {atol})"


def assert_equal(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    import torch

    assert list(actual) == list(expected), f"{where}: {list(actual)} != {list(expected)}"
    for name, want in expected.items():
        got = actual[name]
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
        assert torch.equal(got, want), f"{where}: {name} is not bit-identical (max difference {diff})"


class LazyRuns(dict):
    """Runs made when a test first asks for them and shared by the module's tests; a failed run fails
    every test that asks for it at once, instead of being run (and waited for) again."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self._make = make
        self._failed: dict[str, str] = {}

    def __missing__(self, key: str) -> Any:
        if key in self._failed:
            pytest.fail(f"the shared run {key!r} failed earlier in this module:\n{self._failed[key]}")
        try:
            self[key] = self._make(key)
        except BaseException as err:  # pytest.fail raises an exception outside Exception
            self._failed[key] = str(err)[-3000:]
            raise
        return self[key]
