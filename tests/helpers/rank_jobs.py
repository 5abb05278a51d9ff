"""Starting ``tests/jobs/plugin_unit_job.py`` at several ranks, as torchrun does, and reading what each recorded.

The per-plugin unit tests (``tests/plugins/test_ddp.py``, ``test_zero.py``, ...) run one case of the job
per file: every rank joins a real gloo group on 127.0.0.1, drives the plugin through its public methods,
and saves the facts it observed (tensors, names, types) to ``rank<r>.pt``; the test asserts on them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, job_env

from trainer_core.plugins.environments import find_free_port

JOB = str(JOBS / "plugin_unit_job.py")


def run_case(tmp_path: Path, case: str, world: int = 2, timeout: float = 90) -> list[dict[str, Any]]:
    """Run ``case`` of the job at ``world`` ranks; each rank's recorded facts, in rank order."""
    port = find_free_port()
    procs, logs = [], []
    started = time.monotonic()
    for rank in range(world):
        env = job_env()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        logs.append(open(tmp_path / f"rank{rank}.log", "w"))  # closed below
        procs.append(
            subprocess.Popen(
                [sys.executable, JOB, case, "--out", str(tmp_path)],
                cwd=tmp_path,
                env=env,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
    try:
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{case}: rank {rank} still runs after {timeout:.0f} s")
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, proc in enumerate(procs):
        output = (tmp_path / f"rank{rank}.log").read_text()
        assert proc.returncode == 0, f"{case}: rank {rank} exited with {proc.returncode}:\n{output[-4000:]}"
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


def assert_tensors_close(actual: Any, expected: Any, atol: float = 0.0, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values are equal (tensors within ``atol``), key for key."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual, key=str) == sorted(expected, key=str), (
            f"{where}: keys {sorted(actual, key=str)} != {sorted(expected, key=str)}"
        )
        for key in expected:
            assert_tensors_close(actual[key], expected[key], atol, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: {len(actual)} items, expected {len(expected)}"
        for index, (act, exp) in enumerate(zip(actual, expected)):
            assert_tensors_close(act, exp, atol, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        actual = torch.as_tensor(actual)
        assert actual.shape == expected.shape, (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        diff = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
        assert diff <= atol, f"{where}: differs by {diff:.3g} (allowed {atol})"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_sharded_optimizer_facts(ranks: list[dict[str, Any]], atol: float = 1e-6) -> None:
    """What ``ZeroPlugin`` and ``DDPShardedPlugin`` both promise, from the job's ``zero``/``ddp_sharded`` case.

    Trained weights equal the single process's on the combined batch (gradient clipping by the
    total norm included); the optimizer state is consolidated on every rank and held by rank 0 only,
    equal to the single process's; loading the name-keyed state gives each rank its own part,
    consolidates back to the same state, and continues exactly as the optimizer that never stopped.
    """
    assert all(norm > 0.05 for norm in ranks[0]["reference_norms"]), "the clip threshold never clipped"
    for rank, facts in enumerate(ranks):
        assert_tensors_close(facts["weights"], facts["reference_weights"], atol, f"rank {rank} weights")
    rank0, rank1 = ranks
    assert rank1["optimizer_state"] == {} and rank1["named_state"] == {}
    assert_tensors_close(rank0["optimizer_state"]["state"], rank0["reference_state"]["state"], atol, "state")
    assert rank0["optimizer_state"]["param_groups"] == rank0["reference_state"]["param_groups"]
    names = ["layer.weight", "layer.bias", "head.weight", "head.bias"]
    assert sorted(rank0["named_state"]["state"]) == sorted(names)
    assert rank0["named_state"]["param_groups"][0]["params"] == names
    for index, name in enumerate(names):
        assert_tensors_close(
            rank0["named_state"]["state"][name], rank0["optimizer_state"]["state"][index], 0.0, name
        )
    # The rule is the base plugin's: plain DDP consolidates the same optimizer the same way.
    assert_tensors_close(rank0["ddp_state"], rank0["optimizer_state"], 0.0, "under DDPPlugin")
    assert rank1["ddp_state"] == {}

    owned = [set(facts["own_state_names"]) for facts in ranks]
    assert all(owned) and not owned[0] & owned[1] and owned[0] | owned[1] == set(names), owned
    assert_tensors_close(rank0["reloaded_named_state"], rank0["named_state"], 0.0, "reloaded state")
    assert rank1["reloaded_named_state"] == {}
    for rank, facts in enumerate(ranks):
        assert_tensors_close(
            facts["reloaded_weights"], facts["continued_weights"], 0.0, f"rank {rank} resumed"
        )
