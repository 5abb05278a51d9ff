"""Several optimizers (a GAN with manual optimization, two optimizers, two schedulers) save and resume
exactly: the same losses, bit for bit, on every rank, under the single device, DDP and ZeRO."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import JOBS

JOB = str(JOBS / "gan_job.py")
FULL = os.environ.get("FULL_MATRIX") == "1"


def _run(tmp: Path, *args: str) -> None:
    proc = subprocess.run([sys.executable, JOB, *args], cwd=tmp, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("plugin", "devices"),
    [
        ("single_device", 1),
        ("ddp", 2),
        # ZeRO's consolidation of two optimizers: 28 s, and one optimizer's is in the resume matrix.
        pytest.param(
            "zero", 2, marks=pytest.mark.skipif(not FULL, reason="with FULL_MATRIX=1 (make stress)")
        ),
    ],
)
def test_two_optimizers_resume_exactly(tmp_path: Path, plugin: str, devices: int) -> None:
    common = ("--plugin", plugin, "--devices", str(devices))
    _run(tmp_path, "--out", "full", *common, "--save-at", "7")
    _run(tmp_path, "--out", "resumed", *common, "--resume", str(tmp_path / "full" / "stop.ckpt"))
    for rank in range(devices):
        full = json.loads((tmp_path / "full" / f"rank{rank}.json").read_text())
        resumed = json.loads((tmp_path / "resumed" / f"rank{rank}.json").read_text())
        assert len(resumed["losses"]) > 5
        assert resumed["losses"] == full["losses"][-len(resumed["losses"]) :], f"rank {rank}"
        # Each batch steps both optimizers: global_step counts both (Lightning's rule).
        assert full["global_step"] == resumed["global_step"] == 2 * 3 * (96 // 8 // devices)
        a = torch.load(tmp_path / "full" / f"rank{rank}.pt", weights_only=True)
        b = torch.load(tmp_path / "resumed" / f"rank{rank}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a)
