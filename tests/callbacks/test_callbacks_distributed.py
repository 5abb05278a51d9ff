"""The built-in callbacks under 2 real gloo ranks (FSDP, sharded folder checkpoints): tests/jobs/callbacks_job.py.

What a user relies on: EarlyStopping stops every rank at the same epoch even when only one rank's
metric says so; ModelCheckpoint keeps the right sharded folders, deletes the others and points
``last`` at the newest; LearningRateMonitor logs the scheduler's values once (rank 0's CSV);
GradientAccumulationScheduler changes the number of optimizer steps per epoch on every rank; and a
run resumed from ``last`` continues with the scheduled factor.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch import JOBS

JOB = str(JOBS / "callbacks_job.py")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _run(cwd: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, JOB, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=150
    )
    if proc.returncode != 0:
        pytest.fail(
            f"job {args} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def _result(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


@pytest.mark.timeout(300)
def test_callbacks_agree_across_two_ranks_and_resume(tmp_path: Path) -> None:
    _run(tmp_path, "--out", "out")
    out = tmp_path / "out"
    ranks = [_result(out, r) for r in (0, 1)]
    ckpts = out / "ckpts"

    # EarlyStopping: only rank 1's metric stopped improving (epochs 2 and 3, patience 2); rank 0's own
    # count is 0, yet both ranks left the loop after epoch 3 together.
    for seen in ranks:
        assert seen["world_size"] == 2
        assert seen["stopped_epoch"] == 3 and seen["current_epoch"] == 4
    assert ranks[0]["wait_count"] == 0 and ranks[1]["wait_count"] == 2

    # GradientAccumulationScheduler({1: 2}): 8 batches per rank and epoch, 8 steps in epoch 0, then 4.
    for seen in ranks:
        assert seen["accumulate"] == [1, 2, 2, 2]
        assert seen["steps_at_epoch_end"] == [8, 12, 16, 20]

    # ModelCheckpoint(top 2 by val_score 0.5, 0.3, 0.4, 0.2): folders of epochs 1 and 3 stay, 0 and 2 are gone;
    # `last` links to the newest, which was also the best.
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "epoch=1-step=12.ckpt",
        "epoch=3-step=20.ckpt",
        "last.ckpt",
    ]
    assert all((ckpts / n / ".metadata").is_file() for n in ("epoch=1-step=12.ckpt", "epoch=3-step=20.ckpt"))
    assert os.path.islink(ckpts / "last.ckpt") and os.readlink(ckpts / "last.ckpt") == "epoch=3-step=20.ckpt"
    for seen in ranks:
        assert seen["best_model_path"] == str(ckpts / "epoch=3-step=20.ckpt")
        assert seen["best_k_models"] == {
            str(ckpts / "epoch=1-step=12.ckpt"): pytest.approx(0.3),
            str(ckpts / "epoch=3-step=20.ckpt"): pytest.approx(0.2),
        }

    # LearningRateMonitor: StepLR halves the rate each epoch; one value per epoch, logged once (rank 0).
    expected_lrs = [0.1, 0.05, 0.025, 0.0125]
    for seen in ranks:
        assert seen["lrs"]["lr-SGD"] == pytest.approx(expected_lrs)
    (metrics_csv,) = (out / "logs").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_csv.open()))
    assert [float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")] == pytest.approx(expected_lrs)
    assert [int(r["step"]) for r in rows if r.get("lr-SGD")] == [0, 8, 12, 16]

    # Resume from `last` (a link to a sharded folder): epochs 4 and 5 run with the scheduled factor 2.
    _run(tmp_path, "--out", "out", "--resume", "last")
    for rank in (0, 1):
        seen = _result(out, rank)
        assert seen["ckpt_path"] == str(ckpts / "last.ckpt")
        assert seen["accumulate"] == [2, 2]
        assert seen["steps_at_epoch_end"] == [24, 28]
        assert seen["lrs"]["lr-SGD"] == pytest.approx([0.00625, 0.003125])
    # Neither new epoch was in the top 2, so `last` now holds the newest state itself, not a link.
    assert not os.path.islink(ckpts / "last.ckpt") and (ckpts / "last.ckpt" / ".metadata").is_file()
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "epoch=1-step=12.ckpt",
        "epoch=3-step=20.ckpt",
        "last.ckpt",
    ]


@pytest.mark.timeout(200)
def test_timer_stops_both_ranks_together_and_rich_draws_on_rank_zero_only(tmp_path: Path) -> None:
    """Rank 1's clock runs 0.5 s ahead of rank 0's: it runs out of time first and both ranks stop."""
    _run(tmp_path, "--out", "out", "--timer")
    out = tmp_path / "out"
    seen = [json.loads((out / f"timer.rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0]["global_step"] == seen[1]["global_step"] > 0
    # Rank 1 spent its 0.9 s; rank 0, alone, would have gone on (and waited for rank 1 forever).
    assert seen[1]["elapsed"] >= 0.9 > seen[0]["elapsed"]
    # The stop ended the epoch properly: ModelCheckpoint saved the state reached.
    step = seen[0]["global_step"]
    assert (out / "ckpts" / "last.ckpt").is_file()
    assert any(p.name.endswith(f"step={step}.ckpt") for p in (out / "ckpts").iterdir())
    bar = (out / "bar.rank0.txt").read_text()
    assert "Epoch 0" in bar and "8/8" in bar
    assert (out / "bar.rank1.txt").read_text() == ""
