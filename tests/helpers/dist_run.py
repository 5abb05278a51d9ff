"""Running ``tests/jobs/dist_job.py`` the way a user runs a script, and reading what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, LAUNCH_VARS

from trainer_core.plugins.io import TorchCheckpointIO

JOB = str(JOBS / "dist_job.py")


def run(tmp: Path, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    proc = subprocess.run(
        [sys.executable, JOB, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"job {args} exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def rank_result(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def weights(out: Path, name: str = "rank0.pt") -> dict[str, torch.Tensor]:
    return torch.load(out / name, weights_only=True)


def load_ckpt(path: Path) -> dict[str, Any]:
    return TorchCheckpointIO().load_checkpoint(str(path))
