"""A training process killed (SIGKILL) at random moments, mostly mid-save, never leaves a checkpoint
that ``fit(ckpt_path="last")`` would pick and then fail to load."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kill_job import Wide, loader, trainer

TRIALS = 20


def _wait_for_first_checkpoint(folder: Path, child: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.suffix == ".ckpt" for p in folder.glob("*")) or child.poll() is not None:
            return
        time.sleep(0.02)
    raise AssertionError("the child wrote no checkpoint in time")


@pytest.mark.timeout(400)
def test_sigkill_at_random_moments_never_leaves_a_bad_last(tmp_path: Path) -> None:
    rng = random.Random(1234)
    resumed = 0
    for trial in range(TRIALS):
        folder = tmp_path / f"trial{trial}"
        folder.mkdir()
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "kill_job.py"), str(folder)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_for_first_checkpoint(folder, child)
            time.sleep(rng.uniform(0.0, 0.4))
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL, child.stderr.read().decode()[-2000:]
        run = trainer(str(folder), max_steps=0)
        # Loads the newest complete checkpoint: any error here (a torn file) fails the test.
        run.fit(Wide(), loader(), ckpt_path="last")
        assert run.ckpt_path is not None and run.global_step >= 1
        resumed += 1
    assert resumed == TRIALS
