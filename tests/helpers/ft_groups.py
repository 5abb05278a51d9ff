"""Replica groups of ``tests/jobs/ft_job.py`` and a lighthouse, as real processes a test can kill and start again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from launch import JOBS, job_env

JOB = JOBS / "ft_job.py"


class Lighthouse:
    """torchft's lighthouse in its own process (``tests/jobs/ft_lighthouse.py``)."""

    def __init__(
        self, min_replicas: int = 1, join_ms: int = 2000, heartbeat_ms: int = 1500, log: Optional[Path] = None
    ) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(JOBS / "ft_lighthouse.py"),
                str(min_replicas),
                str(join_ms),
                str(heartbeat_ms),
            ],
            stdout=subprocess.PIPE,
            stderr=open(log, "w") if log is not None else subprocess.DEVNULL,
            env=dict(job_env(), RUST_LOG="info" if log is not None else "error"),
            text=True,
        )
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().strip()
        assert self.address.startswith("http"), self.address

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Groups:
    """``ft_job.py`` once per replica group, with their output in ``out`` and logs in ``out/logs``."""

    def __init__(self, out: Path, lighthouse: Lighthouse, groups: int, args: list[str]) -> None:
        self.out = out
        self.lighthouse = lighthouse
        self.groups = groups
        self.args = args
        self.processes: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, int] = {}
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, group: int, extra: Optional[list[str]] = None) -> subprocess.Popen:
        self.starts[group] = self.starts.get(group, 0) + 1
        log = open(self.out / "logs" / f"group{group}-{self.starts[group]}.log", "w")
        env = dict(
            job_env(),
            TORCHFT_LIGHTHOUSE=self.lighthouse.address,
            REPLICA_GROUP_ID=str(group),
            NUM_REPLICA_GROUPS=str(self.groups),
            RUST_LOG="error",
        )
        process = subprocess.Popen(
            [sys.executable, str(JOB), str(self.out), *self.args, *(extra or [])],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes[group] = process
        return process

    def start_all(self) -> None:
        for group in range(self.groups):
            self.start(group)

    def kill(self, group: int) -> None:
        process = self.processes[group]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def progress(self, group: int) -> list[list[int]]:
        """``[global_step, epoch, batch]`` of every batch the group's processes finished, in order."""
        path = self.out / f"progress{group}.txt"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for_step(self, group: int, step: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.progress(group)
            if done and done[-1][0] >= step:
                return
            if self.processes[group].poll() is not None:
                raise AssertionError(
                    f"group {group} exited with {self.processes[group].returncode}:\n{self.log(group)}"
                )
            time.sleep(0.05)
        raise AssertionError(f"group {group} did not reach step {step} in {timeout} s:\n{self.log(group)}")

    def wait(self, timeout: float = 120) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for group, process in self.processes.items():
            try:
                codes[group] = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                codes[group] = process.wait()
        return codes

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def log(self, group: int) -> str:
        path = self.out / "logs" / f"group{group}-{self.starts.get(group, 1)}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def result(self, group: int) -> dict[str, Any]:
        return json.loads((self.out / f"group{group}.json").read_text())
