"""The resume matrix: every way a checkpoint is written x every plugin x loaders and features.

Each cell resumes a checkpoint in the same process group with fresh seeds and runs to the same
step as a run that never stopped; its losses and learning rates on every step, and its final
weights on every rank, must equal the uninterrupted run's bit for bit (``==``, ``torch.equal``).
The writers (``resume_matrix_job.WRITERS``) all run in every scenario. ``make test`` runs a
covering subset: each plugin with each loader, and every pair of the other factors' levels at
least once (``test_the_subset_covers_every_pair`` checks it; ``ddp_spawn``, whose every fit starts
new interpreters, runs one scenario, in ``make stress`` only); ``FULL_MATRIX=1`` (``make stress``)
runs every scenario under every plugin. Checkpoints written between two optimizer steps of
accumulation are compared too, FSDP's included (it saves the gradients it keeps unsharded).

At 3 and 4 ranks (``test_every_writer_resumes_exactly_at_three_and_four_ranks``) every plugin
that spreads a batch over the ranks, from every writer, in ``make stress``; one cell of each size in
``make test``. Two ranks cannot tell a resumed DDP wrapper that reduces in other gradient buckets
(two values add up alike in either order); three can.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, job_env
from resume_matrix_job import LOADERS, MAX_STEPS, WRITERS

JOB = str(JOBS / "resume_matrix_job.py")
PLUGINS = (
    "single_device",
    "ddp",
    "ddp_spawn",
    "ddp_sharded",
    "zero",
    "fsdp_full",
    "fsdp_sharded",
    "pipeline",
)
# Both pipeline ranks must read the same batches; the iterable data set here shuffles from each
# rank's own generator, which dropout on one stage moves apart, so it is no input for a pipeline.
_PIPELINE_LOADERS = ("map", "stateful")
# Writers that need the ranks alive after ``fit`` returns, or a signal sent to the rank's own process.
_NOT_UNDER_SPAWN = {"after_max_steps", "after_max_epochs", "after_early_stopping", "after_timer"}
_NOT_UNDER_SPAWN |= {"after_preemption", "preemption_signal"}
# Each fit under ddp_spawn starts two interpreters (about 6 s here): make test resumes from three writers.
_SPAWN_WRITERS = ("every_n_train_steps", "epoch_end", "after_validation")
# (dropout, scheduler, accumulate): an orthogonal array, every pair of levels once.
_FEATURES = [(0, "step", 1), (0, "epoch", 2), (1, "step", 2), (1, "epoch", 1)]
FULL = os.environ.get("FULL_MATRIX") == "1"


def _spec(loader: str, features: tuple[int, str, int]) -> str:
    dropout, scheduler, accumulate = features
    return f"{loader}:{dropout}:{scheduler}:{accumulate}"


def scenarios(plugin: str, full: bool = FULL) -> list[str]:
    """The plugin's scenarios: all 24 under FULL_MATRIX, else one per loader with rotating features."""
    loaders = _PIPELINE_LOADERS if plugin == "pipeline" else LOADERS
    if full:
        return [
            _spec(loader, f)
            for loader in loaders
            for f in itertools.product((0, 1), ("step", "epoch"), (1, 2))
        ]
    if plugin == "pipeline":
        # Two scenarios with opposite features: each level of each feature under the pipeline.
        return [_spec("map", (0, "step", 1)), _spec("stateful", (1, "epoch", 2))]
    shift = PLUGINS.index(plugin)
    specs = [_spec(loader, _FEATURES[(shift + j) % len(_FEATURES)]) for j, loader in enumerate(LOADERS)]
    # Each fit under ddp_spawn starts two interpreters: one scenario in make test.
    return specs[:1] if plugin == "ddp_spawn" else specs


def test_the_subset_covers_every_pair() -> None:
    """Every pair of factors (plugin, loader, dropout, scheduler, accumulation) meets in some cell."""
    rows = [
        (plugin, *spec.split(":"))
        for plugin in PLUGINS
        for spec in scenarios(plugin)
        if plugin != "ddp_spawn"
    ]
    levels = [sorted({row[i] for row in rows}) for i in range(5)]
    assert [len(level) for level in levels] == [len(PLUGINS) - 1, 3, 2, 2, 2]
    for i, j in itertools.combinations(range(5), 2):
        wanted = set(itertools.product(levels[i], levels[j])) - {("pipeline", "iterable")}
        assert {(row[i], row[j]) for row in rows} == wanted, (i, j)


def _run_job(
    out: Path, plugin: str, specs: list[str], devices: int = 2, writers: tuple[str, ...] = ()
) -> None:
    env = job_env()
    devices = 1 if plugin == "single_device" else devices
    cmd = [sys.executable, JOB, "--out", str(out), "--plugin", plugin, "--devices", str(devices)]
    if plugin == "ddp_spawn" and not FULL:
        writers = writers or _SPAWN_WRITERS
    if writers:
        cmd += ["--resume-only", ",".join(writers)]
    proc = subprocess.run(
        [*cmd, "--scenarios", ",".join(specs)], cwd=out, env=env, capture_output=True, text=True, timeout=840
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{plugin} {specs} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def _mismatches(folder: Path, writer: str, rank: int) -> list[str]:
    """How the run resumed from ``writer``'s checkpoint differs from the uninterrupted run on ``rank``."""
    ref_steps = json.loads((folder / f"reference.rank{rank}.json").read_text())["steps"]
    ref_weights = torch.load(folder / f"reference.rank{rank}.pt", weights_only=True)
    record = folder / f"{writer}.rank{rank}.json"
    if not record.exists():
        return [
            f"no resumed run (checkpoint: {json.loads((folder / 'written.json').read_text()).get(writer)})"
        ]
    resumed = json.loads(record.read_text())
    steps: dict[str, Any] = resumed["steps"]
    numbers = sorted(int(s) for s in steps)
    problems = []
    start = resumed["start"]
    if start["total_batch_idx"] == 0:
        problems.append("the resumed run started from the beginning")
    if numbers != list(range(start["global_step"] + 1, MAX_STEPS + 1)):
        problems.append(
            f"resumed from step {start['global_step']} but ran steps {numbers}, not the rest to {MAX_STEPS}"
        )
    for step in numbers:
        if steps[str(step)] != ref_steps.get(str(step)):
            problems.append(f"step {step}: (loss, lr) {steps[str(step)]} vs {ref_steps.get(str(step))}")
    weights = torch.load(folder / f"{writer}.rank{rank}.pt", weights_only=True)
    for name, tensor in ref_weights.items():
        if not torch.equal(tensor, weights[name]):
            problems.append(f"final {name} differs by {(tensor - weights[name]).abs().max().item():.3g}")
    return problems


def _failures(out: Path, plugin: str, writers: list[str], ranks: list[int]) -> list[str]:
    """Every (scenario, writer, rank) whose resumed run differs from the uninterrupted one, with how."""
    failures = []
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        for writer in writers:
            for rank in ranks:
                problems = _mismatches(folder, writer, rank)
                if problems:
                    failures.append(f"{folder.name} / {writer} / rank {rank}: " + "; ".join(problems[:3]))
    return failures


# ddp_spawn's resume from every writer (70 s: each fit starts new interpreters) runs in make stress;
# make test resumes under ddp_spawn in tests/plugins/test_distributed.py.
_SPAWN_IN_STRESS = pytest.mark.skipif(
    not FULL, reason="FULL_MATRIX=1 (make stress): every fit spawns interpreters"
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "plugin", [pytest.param(p, marks=_SPAWN_IN_STRESS) if p == "ddp_spawn" else p for p in PLUGINS]
)
def test_every_writer_resumes_exactly(tmp_path: Path, plugin: str) -> None:
    specs = scenarios(plugin)
    _run_job(tmp_path, plugin, specs)
    ranks = [0] if plugin == "single_device" else [0, 1]
    writers = [w for w in WRITERS if not (plugin == "ddp_spawn" and w in _NOT_UNDER_SPAWN)]
    if plugin == "ddp_spawn" and not FULL:
        writers = list(_SPAWN_WRITERS)
    failures = _failures(tmp_path, plugin, writers, ranks)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == len(specs)
    if plugin == "ddp_spawn":
        for folder in (p for p in tmp_path.iterdir() if p.is_dir()):
            refusal = (folder / "refused.txt").read_text()
            assert "refused.ckpt" in refusal and "weights_only=True" in refusal, refusal
            assert not (folder / "refused.ckpt").exists()
            assert "optimizer_states" not in torch.load(folder / "weights.ckpt", weights_only=True)
    assert not failures, f"{len(failures)} cells of {plugin} did not resume exactly:\n" + "\n".join(failures)


# From three ranks on gloo's ring all-reduce adds the ranks' values in an order set by a value's place in
# DDP's gradient bucket, so these rows fail where a resumed wrapper reduces in other buckets than the run
# that went on. Every plugin that spreads one batch over the ranks, at 3 and 4 ranks, in make stress;
# make test runs one cell of each size, with two writers (the reference run and one fit writing every
# ModelCheckpoint's files are the cell's fixed cost).
WIDE_PLUGINS = ("ddp", "ddp_spawn", "zero", "ddp_sharded", "fsdp_full", "fsdp_sharded")
WIDE_DEVICES = (3, 4)
_WIDE_IN_TEST = {
    ("ddp", 3): ("map:0:step:1", ("every_n_train_steps", "epoch_end")),
    ("zero", 4): ("stateful:1:epoch:2", ("every_n_train_steps", "after_validation")),
}
_WIDE_IN_STRESS = pytest.mark.skipif(
    not FULL, reason="FULL_MATRIX=1 (make stress): every writer at 3 and 4 ranks"
)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("plugin", "devices"),
    [
        pytest.param(p, n, marks=() if (p, n) in _WIDE_IN_TEST else _WIDE_IN_STRESS)
        for p in WIDE_PLUGINS
        for n in WIDE_DEVICES
    ],
)
def test_every_writer_resumes_exactly_at_three_and_four_ranks(
    tmp_path: Path, plugin: str, devices: int
) -> None:
    if FULL:
        specs, writers = scenarios(plugin, full=False), ()
    else:
        spec, writers = _WIDE_IN_TEST[plugin, devices]
        specs = [spec]
    _run_job(tmp_path, plugin, specs, devices=devices, writers=writers)
    compared = list(writers) or [w for w in WRITERS if not (plugin == "ddp_spawn" and w in _NOT_UNDER_SPAWN)]
    failures = _failures(tmp_path, plugin, compared, list(range(devices)))
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == len(specs)
    assert not failures, (
        f"{len(failures)} cells of {plugin} at {devices} ranks did not resume exactly:\n"
        + "\n".join(failures)
    )
