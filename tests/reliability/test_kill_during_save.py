"""A training process killed with SIGKILL at random moments, mostly mid-save, with each kind of save.

For every trial: a child trains, saving a checkpoint after every step (monolithic files, sharded
DCP folders, or background writes with ``AsyncCheckpointIO``); it is killed at a random moment
after its first checkpoint; then ``fit(ckpt_path="last")`` in this process must pick a complete
checkpoint, load it, and finish with exactly the weights of a run that was never interrupted.

CI kills ``KILL_TRIALS`` children per kind (3 by default); ``make stress`` kills 50. Each test
prints its counts (trials, kills, kills mid-save, resumes, failures, temporaries left after the next
save) and, when ``RELIABILITY_REPORT`` names a folder, writes them there as JSON for RELIABILITY.md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kill_job import SAVE_KINDS, Wide, final_weights, loader, run_child, trainer

from trainer_core.plugins.io import TorchCheckpointIO
from trainer_core.plugins.io.checkpoint_io import is_temporary_name

TRIALS = int(os.environ.get("KILL_TRIALS", "3"))
MAX_STEPS = 48
# Kill moments are drawn from [0, KILL_WINDOW[kind]) seconds after the first checkpoint appears:
# about the time the child needs for its remaining steps, so most kills land mid-run, many mid-save.
KILL_WINDOW = {"monolithic": 0.9, "sharded": 1.4, "async": 0.7}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child and the resumed runs: the same kernels, bit for bit
    try:
        return final_weights(MAX_STEPS)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def forkserver() -> multiprocessing.context.BaseContext:
    """Children forked from a server that imported torch once: a trial starts in milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kill_job"])
    return context


def _wait_for_first_checkpoint(folder: Path, child: multiprocessing.Process, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.endswith(".ckpt") for p in folder.iterdir()) or not child.is_alive():
            return
        time.sleep(0.005)
    raise AssertionError("the child wrote no checkpoint in time")


def _report(kind: str, counts: dict[str, object]) -> None:
    print(f"\nkill during {kind} saves: {counts}")
    folder = os.environ.get("RELIABILITY_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"kill_{kind}.json").write_text(json.dumps(counts, indent=1))


@pytest.mark.timeout(60 + 60 * TRIALS)
@pytest.mark.parametrize("kind", SAVE_KINDS)
def test_sigkill_during_save_then_last_resumes_exactly(
    kind: str,
    tmp_path: Path,
    reference: dict[str, torch.Tensor],
    forkserver: multiprocessing.context.BaseContext,
) -> None:
    rng = random.Random(f"kill-{kind}")
    counts: dict[str, Any] = {
        "trials": 0,
        "killed": 0,
        "finished_before_kill": 0,
        "resumes": 0,
        "failures": 0,
    }
    resumed_from: list[str] = []
    failures: list[str] = []
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the resumed runs are tiny: more threads only add contention
    try:
        _trials(kind, tmp_path, reference, forkserver, rng, counts, resumed_from, failures)
    finally:
        torch.set_num_threads(threads)
    counts["seconds"] = round(time.monotonic() - started, 1)
    counts["resumed_from_sample"] = resumed_from[:10]
    _report(kind, counts)
    assert not failures, "\n".join(failures)
    assert counts["killed"] == TRIALS and counts["resumes"] == counts["trials"]
    assert counts["temporaries_left_after_next_save"] == 0


def _trials(
    kind: str,
    tmp_path: Path,
    reference: dict[str, torch.Tensor],
    forkserver: multiprocessing.context.BaseContext,
    rng: random.Random,
    counts: dict[str, Any],
    resumed_from: list[str],
    failures: list[str],
) -> None:
    counts["temporaries_left_after_next_save"] = counts["killed_mid_save"] = 0
    window = KILL_WINDOW[kind]
    trial = 0
    killed_at = time.time()
    while counts["killed"] < TRIALS and trial < 2 * TRIALS + 5:
        trial += 1
        folder = tmp_path / f"trial{trial}"
        folder.mkdir()
        child = forkserver.Process(target=run_child, args=(str(folder), kind, MAX_STEPS))
        child.start()
        try:
            _wait_for_first_checkpoint(folder, child)
            time.sleep(rng.uniform(0.0, window))
            child.kill()
            killed_at = time.time()
        finally:
            child.join(timeout=30)
        counts["trials"] += 1
        if child.exitcode == 0:
            # The child was faster than the window: not a kill (its resume is still checked), and
            # later kills come sooner, so that TRIALS of them land mid-run.
            counts["finished_before_kill"] += 1
            window *= 0.8
        else:
            assert child.exitcode == -signal.SIGKILL, f"trial {trial}: the child exited with {child.exitcode}"
            counts["killed"] += 1
            # A temporary file or folder on disk: the kill landed in the middle of a save.
            counts["killed_mid_save"] += any(is_temporary_name(p.name) for p in folder.iterdir())
        last = TorchCheckpointIO().latest_complete(str(folder)) if kind != "sharded" else None
        model = Wide()
        # Resume in this process (saving every 10 steps).
        run = trainer(str(folder), MAX_STEPS, kind, every_n_train_steps=10)
        try:
            run.fit(model, loader(), ckpt_path="last")
        except Exception as err:  # a torn checkpoint picked, or any other failure: counted, then asserted
            counts["failures"] += 1
            failures.append(f"trial {trial}: {type(err).__name__}: {err}")
            continue
        assert run.ckpt_path is not None, f"trial {trial}: no checkpoint was found to resume from"
        assert last is None or run.ckpt_path == last
        counts["resumes"] += 1
        resumed_from.append(Path(run.ckpt_path).name)
        different = [k for k in reference if not torch.equal(reference[k], model.state_dict()[k])]
        if different:
            counts["failures"] += 1
            failures.append(f"trial {trial}: resumed from {run.ckpt_path}, final weights differ: {different}")
        # The next save into the folder removes whatever the killed writer left there (a temporary
        # younger than 0.1 s is spared; a kill in the child's last step resumes with no step to run).
        time.sleep(max(0.0, 0.15 - (time.time() - killed_at)))
        run.save_checkpoint(str(folder / "after-resume.ckpt"))
        wait = getattr(run.strategy.checkpoint_io, "wait", None)
        if wait is not None:
            wait()
        counts["temporaries_left_after_next_save"] += sum(is_temporary_name(p.name) for p in folder.iterdir())
