"""Full FSDP state dicts gathered to rank 0 in buckets (``plugins/fsdp_gather.py``) on real gloo groups.

What a user relies on: a full checkpoint written through the buckets is the one torch's own full
state dict gives, bit for bit (keys and their order, containers, dtypes, shapes, values, the
optimizer's parameter groups and step counts), for first dimensions the ranks do not divide (ranks
holding fewer rows or none), fp32 / bf16 parameters, int64 and bool buffers, frozen parameters,
Adam and SGD-momentum states, HSDP (which falls back to torch's gather), and buckets smaller than
one row, about one tensor, and larger than the whole state; each collective carries at most one
bucket (or one row, where a row is larger); ranks other than 0 get ``{}``, as from torch.
``FSDPPlugin(state_dict_type="full")`` writes the same file through either path. That such a file
resumes bit for bit is the resume matrix's ``fsdp_full`` column (``tests/checkpoint/test_resume_matrix.py``).

The streamed full save (issue 32): the same bytes as a save that gathers the whole state first, on
local disk and on an object store's path; a callback's ``on_save_checkpoint`` still gets the real
tensors (that save is not streamed); a write failing part-way raises on rank 0, lets the other ranks
finish and keeps the previous file; a fit resumed from the streamed file ends with the weights of a
fit that went straight on; rank 0's peak memory rises by far less than the state it writes.

One launch of ``tests/jobs/fsdp_gather_job.py`` at 2 ranks (about 10 s); 3 ranks with ``FULL_MATRIX=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from launch import JOBS, job_env

from trainer_core.plugins.environments import find_free_port

JOB = str(JOBS / "fsdp_gather_job.py")
FULL = os.environ.get("FULL_MATRIX") == "1"
#: Bytes of one row of the job's widest tensor (``big``: 4 x 3 float32 per row): the most a collective
#: may carry when the bucket is smaller than a row.
WIDEST_ROW = 4 * 3 * 4
#: Tensors in the job's full states (rank 0): parameters and buffers; Adam's two moments and step per
#: trainable parameter; SGD's momentum per trainable parameter.
MODEL_TENSORS = 16
TRAINABLE = 9


def _launch(tmp_path: Path, world: int) -> list[list[dict[str, Any]]]:
    """Start ``world`` ranks apart, as torchrun does; every rank's results."""
    port = find_free_port()
    procs, logs = [], []
    started = time.monotonic()
    for rank in range(world):
        env = job_env()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        logs.append(open(tmp_path / f"rank{rank}.log", "w"))  # closed below
        procs.append(
            subprocess.Popen(
                [sys.executable, JOB, "--out", str(tmp_path)],
                cwd=tmp_path,
                env=env,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
    try:
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, 150 - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still runs after 150 s")
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, proc in enumerate(procs):
        output = (tmp_path / f"rank{rank}.log").read_text()
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{output[-4000:]}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


_LAUNCHED: dict[int, list[list[dict[str, Any]]]] = {}


def _ranks(factory: pytest.TempPathFactory, world: int) -> list[list[dict[str, Any]]]:
    """The job's results at ``world`` ranks: one launch shared by this module's tests."""
    if world not in _LAUNCHED:
        _LAUNCHED[world] = _launch(factory.mktemp(f"fsdp-gather-{world}"), world)
    return _LAUNCHED[world]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1"))]
)
def test_bucketed_full_state_is_torchs_full_state(
    tmp_path_factory: pytest.TempPathFactory, world: int
) -> None:
    ranks = _ranks(tmp_path_factory, world)
    expected_tensors = {
        "adam-model": MODEL_TENSORS,
        "sgd-model": MODEL_TENSORS,
        "hsdp-model": MODEL_TENSORS,
        "adam-optimizer": 3 * TRAINABLE,
        "hsdp-optimizer": 3 * TRAINABLE,
        "sgd-optimizer": TRAINABLE,
    }
    cases = [case["case"] for case in ranks[0]]
    assert len(cases) == (15 if world % 2 == 0 else 13), cases
    for rank, results in enumerate(ranks):
        assert [case["case"] for case in results] == cases
        for case in results:
            where = f"rank {rank}, {case['case']}"
            # Keys, order, containers, dtypes, shapes and values: the same as torch's full state dict.
            assert case["differences"] == [], where
            if case["case"] == "plugin-checkpoint":
                continue
            assert case["can_gather"], where
            name, _, bucket = case["case"].partition("/")
            # Rank 0 holds every tensor; the other ranks an empty dict, as torch gives them.
            assert case["tensors"] == (expected_tensors[name] if rank == 0 else 0), where
            if name.startswith("hsdp"):
                # A 2-D mesh: every DTensor through torch's own gather, no bucket.
                assert case["sent"] == [], where
                continue
            part = case["bucket_bytes"] // world
            assert case["sent"], where
            assert max(case["sent"]) <= max(part, WIDEST_ROW), where
            if bucket == "large":
                assert len(case["sent"]) == 1, where  # the whole state in one collective
            else:
                assert len(case["sent"]) > 1, where
    # Through the plugin: one collective for the model, one for Adam's state; none on torch's path.
    plugin = ranks[0][-1]
    assert plugin["case"] == "plugin-checkpoint"
    assert len(plugin["bucketed"]) == 2 and plugin["torch"] == []


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1"))]
)
def test_streamed_full_save(tmp_path_factory: pytest.TempPathFactory, world: int) -> None:
    """A full save gathered while rank 0 writes it: the file of the save that gathers first, a bounded peak."""
    plugin = [results[-1] for results in _ranks(tmp_path_factory, world)]
    first = plugin[0]
    saves = first["saves"]
    # Streamed only where no hook reads the dict; the same collectives either way, on every rank.
    for rank, results in enumerate(plugin):
        streamed = {name: save["streamed"] for name, save in results["saves"].items()}
        assert streamed == {
            "bucketed": 1,
            "whole": 0,
            "torch": 0,
            "hooked": 0,
            "memory-url": 1,
            "async": 0,  # AsyncCheckpointIO stages the whole dict: gathered first
            "failed": 1,
        }, rank
        assert results["saves"]["bucketed"]["sent"] == results["saves"]["whole"]["sent"], rank
    # Byte for byte the file written after a whole gather (through AsyncCheckpointIO, whose staged copy has
    # bytes of its own, the same checkpoint once loaded); a hook reading the dict got real tensors.
    assert first["same_bytes"] == {
        "whole": True,
        "hooked": True,
        "async": True,
        "memory-url": True,
        "hook_saw_values": True,
    }
    assert saves["hooked"]["seen"]["all_tensors"]
    assert first["differences"] == []  # and torch.load reads it as torch's own gather's file
    # A write failing part-way: rank 0 reports it, the other ranks finish, the previous file stays.
    assert "No space left on device" in saves["failed"]["error"]
    assert all(results["saves"]["failed"]["previous_intact"] for results in plugin)
    assert [results["saves"]["failed"]["error"] for results in plugin[1:]] == [""] * (world - 1)
    # Resumed from the streamed file, two more steps give the weights of four steps in one run.
    assert first["resumed"] == []
    # Rank 0's peak while saving: about a bucket and a tensor (4 MiB each) streamed, the whole state otherwise.
    memory = first["memory"]
    assert memory["same_bytes"]
    assert memory["whole"] > 0.8 * memory["state_bytes"], memory  # the measurement sees a whole state
    assert memory["streamed"] < 0.4 * memory["state_bytes"], memory
