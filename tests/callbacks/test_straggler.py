"""StragglerMonitor: the slowest rank named, in the loggers and in a warning, from each rank's local work.

The 2-rank run (tests/jobs/straggler_job.py, gloo) has rank 1 take 60 ms more than rank 0 per
batch for 10 steps (loading its batches in the first 5, in ``training_step`` in the next 5), then
not: the CSV shows rank 1 slowest with the spread above the factor in those windows and below it
afterwards, and rank 0's warning names rank 1 once. In one process, the windows are checked on a
controlled clock (what counts, what is left out), the comparison and its rate-limited warning on
given numbers, and a one-process run logs and warns nothing and leaves the training loop's hook
lists without the monitor.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from boring import BoringModel, random_loader
from launch import JOBS, job_env

from trainer_core import Trainer
from trainer_core.callbacks import straggler as straggler_module
from trainer_core.callbacks.straggler import StragglerMonitor, summarize
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger

JOB = JOBS / "straggler_job.py"


# ---------------------------------------------------------------------------------------- two real ranks
FULL = os.environ.get("FULL_MATRIX") == "1"


def _run_job(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(JOB), "--out", "out", *args],
        cwd=cwd,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.timeout(180)
def test_two_ranks_name_the_slow_rank_in_the_logger_and_one_warning(tmp_path: Path) -> None:
    proc = _run_job(tmp_path)
    out = tmp_path / "out"
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    (metrics_csv,) = (out / "logs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("straggler/spread")]
    # The default monitor's figures, one row per 5 optimizer steps, at the step of the window's last batch.
    assert [int(r["step"]) for r in rows] == [4, 9, 14, 19]
    for row, times in zip(rows, seen[0]["windows"]):
        assert float(row["straggler/slowest_time"]) == pytest.approx(max(times))
        assert float(row["straggler/median_time"]) == pytest.approx(min(times))
        assert float(row["straggler/spread"]) == pytest.approx(max(times) / min(times))

    # Steps 1-5: rank 1 loads each batch 60 ms slower. Seen between batches, although training_step
    # all-reduces (a sync_dist log) and rank 0 waits there for rank 1.
    first = rows[0]
    assert float(first["straggler/slowest_rank"]) == 1.0
    assert float(first["straggler/slowest_time"]) >= 0.06
    assert float(first["straggler/spread"]) > 2.0
    # Steps 6-10 (rank 1's training_step 60 ms slower) are not between batches; nor is rank 0's 200 ms
    # validation after step 10, nor the end of the delays.
    for row in rows[1:]:
        assert float(row["straggler/slowest_time"]) < 0.03

    # With time_forward=True: the sync_dist all-reduce in training_step hides the data-loading delay
    # (both ranks read about 80 ms), and the training_step delay of steps 6-10 shows.
    forward = [summarize(times, 2.0) for times in seen[0]["forward_windows"]]
    assert all(f is not None for f in forward)
    assert forward[0].median_time >= 0.06 and forward[0].spread < 2.0  # type: ignore[union-attr]
    assert forward[1].slowest_rank == 1 and forward[1].slowest_time >= 0.08  # type: ignore[union-attr]
    assert forward[1].spread > 2.0  # type: ignore[union-attr]
    for later in forward[2:]:
        assert 0.02 <= later.median_time and later.spread < 2.0  # type: ignore[union-attr]

    # Every rank saw the same numbers; only the monitor that times the forward is called there.
    assert seen[0]["windows"] == seen[1]["windows"]
    assert seen[0]["forward_windows"] == seen[1]["forward_windows"]
    for rank in seen:
        assert (rank["default_times_backward"], rank["forward_times_backward"]) == (False, True)
        assert len(rank["hosts"]) == 2

    # Named once, by rank 0, with its host and ratio.
    warned = [line for line in proc.stderr.splitlines() if "StragglerMonitor: rank" in line]
    assert len(warned) == 1, proc.stderr[-4000:]
    assert f"rank 1 (host {seen[0]['hosts'][1]}):" in warned[0]
    assert "x the median" in warned[0] and "up to step 5" in warned[0] and "rank 0 (" not in warned[0]


@pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1 (make stress)")
@pytest.mark.timeout(180)
def test_under_fsdp_the_time_between_batches_still_names_the_slow_rank(tmp_path: Path) -> None:
    """FSDP gathers the parameters in the forward: only the default figures name the data-loading straggler."""
    proc = _run_job(tmp_path, "--plugin", "fsdp")
    seen = json.loads((tmp_path / "out" / "rank0.json").read_text())
    between = [summarize(times, 2.0) for times in seen["windows"]]
    assert between[0] is not None and between[0].slowest_rank == 1 and between[0].spread > 2.0
    assert all(w is not None and w.slowest_time < 0.03 for w in between[1:])
    forward = summarize(seen["forward_windows"][0], 2.0)
    assert forward is not None and forward.spread < 2.0  # rank 0 waited for rank 1 inside the forward
    warned = [line for line in proc.stderr.splitlines() if "StragglerMonitor: rank" in line]
    assert len(warned) == 1 and "rank 1 (host" in warned[0]


# ---------------------------------------------------------------------------------------- one process
class _LoggingModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_one_process_logs_and_warns_nothing_and_leaves_the_loop_untouched(tmp_path: Path) -> None:
    monitor = StragglerMonitor(every_n_steps=2)
    trainer = Trainer(
        max_steps=6,
        logger=CSVLogger(save_dir=str(tmp_path), name="run"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[monitor],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_LoggingModel(), random_loader(12, 4, batch_size=2))
    assert trainer.global_step == 6
    assert not [w for w in caught if "Straggler" in str(w.message)]
    assert monitor.summary is None and monitor.rank_times == []
    # The Trainer calls no hook of the monitor per batch: the lists it built hold nothing of it.
    hooks = trainer.hook_runner.batch
    for name in ("on_train_batch_start", "on_before_backward", "on_train_batch_end"):
        assert not [fn for fn in getattr(hooks, name) if getattr(fn, "func", fn).__self__ is monitor], name
    (metrics_csv,) = tmp_path.rglob("metrics.csv")
    logged = metrics_csv.read_text()
    assert "loss" in logged and "straggler/" not in logged


# ---------------------------------------------------------------------------------------- the windows
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("time_forward", "first", "second", "warning"),
    [
        (False, 2.0, 1.0, r"rank 0 \(host \?\): 2000.0 ms, 4.0x the median of 500.0 ms"),
        (True, 3.0, 2.0, r"rank 0 \(host \?\): 3000.0 ms, 6.0x the median of 500.0 ms"),
    ],
)
def test_windows_count_local_work_and_leave_out_validation_saves_and_epoch_starts(
    monkeypatch: pytest.MonkeyPatch, time_forward: bool, first: float, second: float, warning: str
) -> None:
    """Hooks called by hand at set times; the other rank's mean is 0.5 s."""
    clock = _Clock()
    monkeypatch.setattr(straggler_module.time, "perf_counter", clock)
    gathered: list[torch.Tensor] = []

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tensor)
        return torch.stack([tensor, torch.tensor([0.5], dtype=torch.float64)])

    logged: list[tuple[dict[str, Any], int]] = []
    trainer: Any = SimpleNamespace(
        batches_that_stepped=0,
        is_global_zero=True,
        plugin=SimpleNamespace(all_gather=all_gather, root_device=torch.device("cpu")),
        metrics=SimpleNamespace(log=lambda metrics, step: logged.append((metrics, step))),
    )
    monitor = StragglerMonitor(every_n_steps=8, factor=2.0, time_forward=time_forward)
    monitor._active = True
    monitor.on_train_start(trainer, None)

    def batch(start: float, backwards: list[float], end: float) -> None:
        clock.now = start
        monitor.on_train_batch_start(trainer, None, None, 0)
        for at in backwards:
            clock.now = at
            monitor.on_before_backward(trainer, None, None)
        clock.now = end
        trainer.batches_that_stepped += 1
        monitor.on_train_batch_end(trainer, None, None, None, 0)

    # (time between batches, forward) of the batches that count: (1, 2), (3, 1), (2, -).
    batch(-5, [-4], -3)  # the fit's first batch: no time before it to count, left out
    batch(-2, [-1], 2)  # the second: DDP rebuilds its buckets in this forward (a broadcast), left out
    batch(3, [5], 6)  # 1 s since the last batch, 2 s forward
    clock.now = 7
    monitor.on_validation_start(trainer, None)
    clock.now = 17
    monitor.on_validation_end(trainer, None)
    batch(18, [19], 20)  # after a validation: left out
    monitor.on_save_checkpoint(trainer, None, {})
    batch(30, [31], 32)  # after a save: left out
    batch(35, [36, 40], 41)  # 3 s before; two backwards (manual optimization): up to the first, 1 s
    monitor.on_train_epoch_end(trainer, None)
    batch(50, [51], 52)  # an epoch's first batch: left out
    assert not gathered
    with pytest.warns(UserWarning, match=warning):
        batch(54, [], 60)  # 2 s before, no backward (a skipped batch): the 2 s only; step 8 compares
    assert len(gathered) == 1 and gathered[0].dtype == torch.float64
    assert monitor.rank_times == [pytest.approx(first), 0.5]
    ((metrics, step),) = logged
    assert step == 7
    assert metrics == {
        "straggler/slowest_rank": 0,
        "straggler/slowest_time": pytest.approx(first),
        "straggler/median_time": 0.5,
        "straggler/spread": pytest.approx(first / 0.5),
    }
    # The window starts again: the next comparison is 8 steps later, over the new batches only
    # (1 s between batches, 1 s forward); rank 0 stays slow, so no new warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(8):
            batch(61 + 3 * i, [62 + 3 * i], 63 + 3 * i)
    assert len(gathered) == 2 and monitor.rank_times == [pytest.approx(second), 0.5]


# ---------------------------------------------------------------------------------------- the comparison
def test_summary_compares_with_the_lower_median_and_skips_ranks_that_counted_nothing() -> None:
    two = summarize([0.02, 0.08], factor=2.0)
    # With two ranks the slow one is compared with the other (a midpoint would cap the ratio below 2).
    assert two is not None
    assert (two.slowest_rank, two.slowest_time, two.median_time) == (1, 0.08, 0.02)
    assert two.spread == pytest.approx(4.0) and two.stragglers == (1,)

    four = summarize([0.011, 0.05, 0.01, 0.03], factor=2.0)
    assert four is not None
    assert (four.slowest_rank, four.median_time, four.stragglers) == (1, 0.011, (1, 3))

    assert summarize([0.01, 0.0105, 0.0099], factor=1.5).stragglers == ()  # type: ignore[union-attr]
    skipped = summarize([math.nan, 0.01, 0.03], factor=2.0)
    assert skipped is not None and skipped.median_time == 0.01 and skipped.stragglers == (2,)
    assert summarize([math.nan, 0.01], factor=2.0) is None
    zero = summarize([0.0, 0.0, 0.01], factor=2.0)
    assert zero is not None and zero.spread == math.inf and zero.stragglers == (2,)
    # Times of microseconds: 3x, but 80 us slower is not a straggler at min_delay=1 ms; 2 ms slower is.
    tiny = summarize([40e-6, 120e-6, 2.05e-3, 45e-6], factor=2.0, min_delay=1e-3)
    assert tiny is not None and tiny.spread == pytest.approx(2.05e-3 / 45e-6) and tiny.stragglers == (2,)


def test_a_rank_is_named_when_it_falls_behind_not_again_while_it_stays_behind() -> None:
    logged: list[dict[str, Any]] = []
    trainer: Any = SimpleNamespace(
        batches_that_stepped=50,
        is_global_zero=True,
        metrics=SimpleNamespace(log=lambda metrics, step: logged.append(metrics)),
    )
    monitor = StragglerMonitor(factor=1.5)
    monitor.hosts = ["node-a", "node-a", "node-b", "node-b"]
    fine = [0.01, 0.01, 0.01, 0.01]
    slow2 = [0.01, 0.01, 0.03, 0.01]
    slow2_3 = [0.01, 0.01, 0.03, 0.02]
    named: list[str] = []
    for times in (slow2, slow2, fine, slow2, slow2_3, slow2_3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor.report(trainer, times)
        named.append(" | ".join(str(w.message) for w in caught))
    assert len(logged) == 6
    assert "rank 2 (host node-b): 30.0 ms, 3.0x the median of 10.0 ms per batch" in named[0]
    assert "up to step 50" in named[0] and "factor=1.5" in named[0]
    assert named[1] == named[2] == ""  # still slow; then recovered
    assert "rank 2 (host node-b)" in named[3]  # slow again: named again
    # Rank 3 joins: only the new one is named, once.
    assert "rank 3 (host node-b): 20.0 ms, 2.0x" in named[4] and "rank 2" not in named[4]
    assert named[5] == ""

    # Other ranks log the same numbers and warn nothing.
    trainer.is_global_zero = False
    other = StragglerMonitor(factor=1.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.report(trainer, slow2)
    assert not caught and logged[-1] == logged[0]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"every_n_steps": 2.5}, "every_n_steps=2.5"),
        ({"every_n_steps": True}, "every_n_steps=True"),
        ({"factor": 1.0}, "factor=1.0"),
        ({"factor": 0.5}, "factor=0.5"),
        ({"factor": math.nan}, "factor=nan"),
        ({"factor": "2"}, "factor='2'"),
        ({"min_delay": -0.001}, "min_delay=-0.001"),
        ({"min_delay": math.nan}, "min_delay=nan"),
        ({"time_forward": None}, "time_forward=None"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(MisconfigurationException, match=f"StragglerMonitor\\({named}\\)"):
        StragglerMonitor(**kwargs)


def test_defaults_and_integer_factor() -> None:
    monitor = StragglerMonitor()
    assert (monitor.every_n_steps, monitor.factor, monitor.min_delay, monitor.time_forward) == (
        50,
        1.5,
        0.001,
        False,
    )
    assert StragglerMonitor(factor=2).factor == 2.0
