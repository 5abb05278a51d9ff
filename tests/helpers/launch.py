"""How the tests start a job script the way a user starts it: without the launch variables of any outer run."""

from __future__ import annotations

import os
from pathlib import Path

#: The repository (``examples/``, the source folders) and the job scripts the tests start by path.
ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "jobs"

#: What torchrun, our launcher or SLURM put in the environment: a job started from a test must not inherit
#: them, or it would think it is a rank of the test's own run.
LAUNCH_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "LOCAL_WORLD_SIZE",
        "TRAINER_CORE_LAUNCHED",
    }
)


def job_env() -> dict[str, str]:
    """This process's environment without launch variables, one thread per rank (the machine has 2 cores)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    return env
