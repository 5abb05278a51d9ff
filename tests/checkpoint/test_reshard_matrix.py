"""The resharding matrix: a checkpoint written under one parallel layout resumes under every other.

Seven layouts (``reshard_job.LAYOUTS``: one process, DDP, FSDP, tensor parallel, data x tensor
parallel, pipeline, pipeline x tensor parallel) each write checkpoints in two formats, one file
(``"full"``) and a folder of shards (``"sharded"``; DDP and one process write a file either way,
so their sharded column is their full column), during an uninterrupted run. Every layout then
resumes, with fresh seeds, from each writer's checkpoint in the middle of that run and trains to
its end. A resumed run must match the writer's uninterrupted run:

* learning rates exactly (the scheduler's state moves between layouts untouched);
* losses and final weights bit for bit when the reader's layout is the writer's, and within
  ``TOLERANCE`` otherwise: another layout sums the same numbers in another order (a row-wise
  tensor-parallel layer adds two partial products, data-parallel ranks average two half-batch
  gradients), so the last bits differ and Adam carries them on.

Each writer's run also matches one process's from step 0 (within ``FROM_SCRATCH_TOLERANCE``), and
a layout's runs in the two formats are bit-equal (writing a checkpoint changes nothing).
``python -m trainer_core.checkpoint inspect`` and ``consolidate`` are checked on the sharded folders
of ``dp2tp2`` and ``pp2tp2``: the consolidated file holds what the folder holds, tensor for tensor,
and one process resumes from it exactly as from the folder.

Most of the cost is starting processes (importing torch), so one launch of the job runs many
trainings in sequence (``LAUNCHES``). ``make test`` runs ``SUBSET`` in four launches: both
directions of ``dp2tp2`` <-> ``single``, ``tp2`` <-> ``fsdp2`` and ``pp2tp2`` <-> ``dp2tp2``,
``pp2tp2`` from itself, and the full file of ``pp2tp2``; a reader whose checkpoint was written by
an earlier launch resumes in fresh processes, one whose checkpoint its own launch wrote resumes in
those processes (with a new Trainer, plugin, module and seed). ``FULL_MATRIX=1`` (``make stress``)
runs all 7 x 7 layouts in both formats, every reader in fresh processes; with
``RESHARD_REPORT=FILE`` it also writes the measured differences of every cell as markdown tables.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from launch import JOBS, job_env
from reshard_job import (
    FILE_WRITERS,
    FORMATS,
    LAYOUTS,
    MAX_STEPS,
    SAVE_EVERY,
    ReshardNet,
    checkpoint_name,
    read_folder,
    write_folder,
)

from trainer_core.checkpoint.cli import main as cli_main
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO

JOB = str(JOBS / "reshard_job.py")
FULL = os.environ.get("FULL_MATRIX") == "1"
REPORT = os.environ.get("RESHARD_REPORT")
#: Largest |difference| allowed between a resumed run and the writer's run when the layouts differ, in
#: losses and in final weights (absolute; losses are about 1, weights about 0.3). Measured: see the report.
TOLERANCE = 1e-6
#: The same for a whole run under another layout than one process's, from step 0: Adam's first steps
#: divide a gradient by its own magnitude, so the last bits of tiny gradients move weights by more.
FROM_SCRATCH_TOLERANCE = 5e-5
#: (pipeline, data, tensor) degrees of the layouts whose folders are inspected.
DEGREES = {"dp2tp2": (1, 2, 2), "pp2tp2": (2, 1, 2)}
#: The sharded folders the command-line tool inspects and consolidates, and one process resumes from.
CONSOLIDATED = ("dp2tp2", "pp2tp2")
#: ``make test``'s cells: (writer, reader, format).
SUBSET = [
    ("dp2tp2", "single", "sharded"),
    ("single", "dp2tp2", "full"),
    ("tp2", "fsdp2", "sharded"),
    ("fsdp2", "tp2", "sharded"),
    ("pp2tp2", "dp2tp2", "sharded"),
    ("dp2tp2", "pp2tp2", "sharded"),
    ("pp2tp2", "pp2tp2", "sharded"),
    # The full file of pipeline x tensor parallel (gathered over both), and its run beside the sharded one.
    ("pp2tp2", "single", "full"),
]
LAUNCH_TIMEOUT = 600 if FULL else 240
# The module's fixture runs every launch under the timeout of whichever test comes first.
pytestmark = pytest.mark.timeout(1800 if FULL else 400)


@dataclass(frozen=True)
class Cell:
    """A reader resuming a writer's checkpoint; ``fmt`` is the writer's format (and the reader's)."""

    writer: str
    reader: str
    fmt: str

    @property
    def source(self) -> str:
        return f"{self.writer}-{self.fmt}"


def writer_format(layout: str, fmt: str) -> str:
    """The format ``layout`` really writes when asked for ``fmt``: one process and DDP always write a file."""
    return "full" if layout in FILE_WRITERS else fmt


def cells() -> list[Cell]:
    if not FULL:
        return [Cell(w, r, fmt) for w, r, fmt in SUBSET]
    return [
        Cell(w, r, fmt)
        for fmt in FORMATS
        for w in LAYOUTS
        for r in LAYOUTS
        if not (w in FILE_WRITERS and fmt == "sharded")
    ]


#: The launches in the order they run: (what they run first, processes). Readers of a world run in a
#: launch of their own after every writer (under FULL_MATRIX always, so that each resumes in fresh
#: processes); in make test a reader whose checkpoint exists by then runs in its world's writer launch.
LAUNCHES = [("writers", 1), ("writers", 2), ("writers", 4), ("readers", 4), ("readers", 2), ("readers", 1)]
Step = tuple[str, int]
#: The step that runs ``python -m trainer_core.checkpoint consolidate`` on the folders of ``CONSOLIDATED``.
CONSOLIDATE: Step = ("consolidate", 0)
#: Steps that may run at once: a launch spends seconds in one process (importing torch, before it
#: starts the other ranks), time in which the machine's second core runs another.
PARALLEL_STEPS = 2


@dataclass
class Plan:
    """The actions of each launch (``reshard_job.py --actions``), keyed by ``LAUNCHES``' entries."""

    root: Path
    fresh_readers: bool
    launches: dict[Step, list[list[str]]] = field(default_factory=dict)
    #: The steps (launches, or the command line's consolidate) whose checkpoints a launch reads.
    needs: dict[Step, set[Step]] = field(default_factory=dict)

    def add_write(self, layout: str, fmt: str) -> None:
        action = ["write", layout, fmt]
        actions = self.launches.setdefault(("writers", LAYOUTS[layout][0]), [])
        if action not in actions:
            actions.append(action)

    def add_read(self, reader: str, fmt: str, source: str, ckpt: Path, writer: Optional[str]) -> None:
        world = LAYOUTS[reader][0]
        where = ("readers", world)
        if writer is not None and not self.fresh_readers:
            if LAUNCHES.index(("writers", LAYOUTS[writer][0])) <= LAUNCHES.index(("writers", world)):
                where = ("writers", world)
        self.launches.setdefault(where, []).append(["read", reader, fmt, source, str(ckpt)])
        need = CONSOLIDATE if writer is None else ("writers", LAYOUTS[writer][0])
        if need != where:
            self.needs.setdefault(where, set()).add(need)

    def written(self) -> list[tuple[str, str]]:
        return [(a[1], a[2]) for actions in self.launches.values() for a in actions if a[0] == "write"]


def resume_checkpoint(root: Path, writer: str, fmt: str) -> Path:
    return root / write_folder(writer, fmt) / checkpoint_name(SAVE_EVERY)


def plan(root: Path, chosen: list[Cell]) -> Plan:
    """The launches of ``chosen`` and of the consolidate checks; in each launch, every write before any read."""
    p = Plan(root, fresh_readers=FULL)
    for cell in chosen:
        p.add_write(cell.writer, cell.fmt)
    for layout in CONSOLIDATED:
        p.add_write(layout, "sharded")
    for cell in chosen:
        ckpt = resume_checkpoint(root, cell.writer, cell.fmt)
        p.add_read(cell.reader, cell.fmt, cell.source, ckpt, cell.writer)
    for layout in CONSOLIDATED:
        # After the command line's consolidate, in the last launch.
        p.add_read("single", "full", f"{layout}-consolidated", consolidated_file(root, layout), None)
        if Cell(layout, "single", "sharded") not in chosen:
            ckpt = resume_checkpoint(root, layout, "sharded")
            p.add_read("single", "sharded", f"{layout}-sharded", ckpt, layout)
    return p


def consolidated_file(root: Path, layout: str) -> Path:
    return root / "consolidated" / f"{layout}.ckpt"


def launch(root: Path, stage: str, world: int, actions: list[list[str]], timings: dict[str, float]) -> None:
    name = f"{stage}-world{world}"
    spec = root / f"{name}.json"
    spec.write_text(json.dumps(actions))
    cmd = [sys.executable, JOB, "--out", str(root), "--world", str(world), "--actions", str(spec)]
    began = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=root, env=job_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    timings[name] = time.perf_counter() - began
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    folders = [write_folder(*a[1:3]) if a[0] == "write" else read_folder(*a[1:4]) for a in actions]
    if proc.returncode != 0 and not any(any((root / f).glob("error.rank*.txt")) for f in folders):
        # Not a failed cell (those leave their traceback beside their record) but the launch itself.
        pytest.fail(f"{name} exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")


def _cli_all(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m trainer_core.checkpoint`` once per argument list, all at once (most of each is importing torch)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer_core.checkpoint", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=job_env(),
        )
        for args in commands
    ]
    results = []
    for args, proc in zip(commands, procs):
        stdout, stderr = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return results


@dataclass
class Matrix:
    root: Path
    cells: list[Cell]
    plan: Plan
    cli: dict[str, subprocess.CompletedProcess[str]]
    timings: dict[str, float]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    """Every step of the plan, each as soon as the checkpoints it reads exist, at most ``PARALLEL_STEPS`` at once."""
    root = tmp_path_factory.mktemp("reshard")
    chosen = cells()
    p = plan(root, chosen)
    timings: dict[str, float] = {}
    cli: dict[str, subprocess.CompletedProcess[str]] = {}

    def consolidate() -> None:
        (root / "consolidated").mkdir()
        commands = {
            layout: [
                "consolidate",
                str(resume_checkpoint(root, layout, "sharded")),
                str(consolidated_file(root, layout)),
            ]
            for layout in CONSOLIDATED
        }
        began = time.perf_counter()
        cli.update(zip(commands, _cli_all(list(commands.values()), root)))
        timings["consolidate"] = time.perf_counter() - began

    steps: dict[Step, Callable[[], None]] = {}
    for key in LAUNCHES:
        if key in p.launches:
            steps[key] = functools.partial(launch, root, key[0], key[1], p.launches[key], timings)
        if key == ("writers", 4):
            steps[CONSOLIDATE] = consolidate
    needs = dict(p.needs)
    needs[CONSOLIDATE] = {("writers", LAYOUTS[layout][0]) for layout in CONSOLIDATED}
    began = time.perf_counter()
    run_steps(steps, needs)
    timings["total"] = time.perf_counter() - began
    (root / "timings.json").write_text(json.dumps(timings))
    return Matrix(root, chosen, p, cli, timings)


def run_steps(steps: dict[Step, Callable[[], None]], needs: dict[Step, set[Step]]) -> None:
    """Run ``steps`` in their order, each once the steps it needs are done; the first failure stops new ones."""
    waiting = list(steps)
    done: set[Step] = set()
    running: dict[concurrent.futures.Future[None], Step] = {}
    with concurrent.futures.ThreadPoolExecutor(PARALLEL_STEPS) as pool:
        while waiting or running:
            for key in list(waiting):
                if len(running) < PARALLEL_STEPS and needs.get(key, set()) <= done:
                    running[pool.submit(steps[key])] = key
                    waiting.remove(key)
            assert running, f"steps {waiting} need steps that never run: {needs}"
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                future.result()
                done.add(running.pop(future))


# ---------------------------------------------------------------------- reading what the runs left
def load_checkpoint(path: Path) -> dict[str, Any]:
    """A file, or a sharded folder read whole in this process (no process group)."""
    if path.is_dir():
        return DistributedCheckpointIO().load_checkpoint(str(path), map_location="cpu")
    return TorchCheckpointIO().load_checkpoint(str(path), map_location="cpu")


def load_record(folder: Path) -> dict[str, Any]:
    record = json.loads((folder / "record.json").read_text())
    record["steps"] = {int(step): tuple(value) for step, value in record["steps"].items()}
    return record


def failure(folder: Path) -> str:
    """The last line of the traceback a failed run left (``reshard_job`` writes one per rank)."""
    errors = sorted(folder.glob("error.rank*.txt"))
    if not errors:
        return "no error recorded (its launch stopped at an earlier failure, or its writer failed)"
    return errors[0].read_text().strip().splitlines()[-1]


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(folder / checkpoint_name(MAX_STEPS))["state_dict"]


@dataclass
class Comparison:
    """How a resumed run differs from the writer's uninterrupted run."""

    loss_diff: float = 0.0
    weight_diff: float = 0.0
    exact: bool = True
    lrs_equal: bool = True
    problems: list[str] = field(default_factory=list)

    def text(self) -> str:
        if self.problems and not self.loss_diff and not self.weight_diff:
            return "FAIL: " + "; ".join(self.problems)[:120]
        if self.exact:
            numbers = "exact"
        else:
            numbers = f"{self.loss_diff:.1e} / {self.weight_diff:.1e}"
        lr = "" if self.lrs_equal else ", lr differs"
        return numbers + lr + (" FAIL" if self.problems else "")


def compare(
    root: Path,
    writer_run: str,
    reader_run: str,
    exact: bool,
    start: int = SAVE_EVERY,
    tolerance: float = TOLERANCE,
) -> Comparison:
    """The run in ``reader_run``, started at step ``start``, against the uninterrupted one in ``writer_run``.

    Both are folders under ``root``; ``exact``: bit for bit, else within ``tolerance``.
    """
    result = Comparison()
    reader_folder = root / reader_run
    if not (reader_folder / "record.json").exists():
        result.exact = False
        result.problems.append(f"no run in {reader_run}: {failure(reader_folder)}")
        return result
    reference = load_record(root / writer_run)["steps"]
    resumed = load_record(reader_folder)
    if resumed["start_step"] != start:
        result.problems.append(f"started at step {resumed['start_step']}, not {start}")
    steps = resumed["steps"]
    if sorted(steps) != list(range(start + 1, MAX_STEPS + 1)):
        result.problems.append(f"ran steps {sorted(steps)}")
    group_lrs = {int(step): lrs for step, lrs in resumed["group_lrs"].items()}
    for step, (loss, lr) in steps.items():
        ref_loss, ref_lr = reference[step]
        # Rank 0's rate, and those of every param group on every rank.
        result.lrs_equal &= lr == ref_lr and all(other == ref_lr for other in group_lrs[step])
        result.exact &= loss == ref_loss
        result.loss_diff = max(result.loss_diff, abs(loss - ref_loss))
    ref_weights = final_weights(root / writer_run)
    weights = final_weights(reader_folder)
    if sorted(weights) != sorted(ref_weights):
        result.problems.append(f"final weights name {sorted(set(weights) ^ set(ref_weights))}")
    for name in set(weights) & set(ref_weights):
        result.exact &= torch.equal(weights[name], ref_weights[name])
        result.weight_diff = max(result.weight_diff, (weights[name] - ref_weights[name]).abs().max().item())
    if not result.lrs_equal:
        result.problems.append("learning rates differ")
    if exact and not result.exact:
        result.problems.append(
            f"not bit for bit (losses {result.loss_diff:.2e}, weights {result.weight_diff:.2e})"
        )
    if max(result.loss_diff, result.weight_diff) > tolerance:
        result.problems.append(
            f"losses {result.loss_diff:.2e}, weights {result.weight_diff:.2e} > {tolerance}"
        )
    return result


def compare_cell(root: Path, cell: Cell) -> Comparison:
    return compare(
        root,
        write_folder(cell.writer, cell.fmt),
        read_folder(cell.reader, cell.fmt, cell.source),
        exact=cell.reader == cell.writer,
    )


# ---------------------------------------------------------------------- the tests
def test_every_layout_resumes_every_other(matrix: Matrix) -> None:
    failures = []
    results = {}
    for cell in matrix.cells:
        results[cell] = result = compare_cell(matrix.root, cell)
        if result.problems:
            failures.append(f"{cell.writer} -> {cell.reader} ({cell.fmt}): " + "; ".join(result.problems))
    if REPORT:
        write_report(Path(REPORT), matrix, results)
    assert not failures, f"{len(failures)} of {len(matrix.cells)} cells failed:\n" + "\n".join(failures)


def test_every_writer_trains_like_one_process(matrix: Matrix) -> None:
    """Each writer's uninterrupted run matches one process's; a layout's runs in the two formats are bit-equal."""
    written = matrix.plan.written()
    failures = []
    for layout, fmt in written:
        result = compare_writer(matrix.root, layout, fmt)
        if result.problems:
            failures.append(f"{layout} ({fmt}): " + "; ".join(result.problems))
    assert not failures, "\n".join(failures)
    both = sorted({layout for layout, fmt in written if (layout, "full") in written and fmt == "sharded"})
    assert both == (sorted(set(LAYOUTS) - set(FILE_WRITERS)) if FULL else ["pp2tp2"])
    for layout in both:
        full, sharded = (write_folder(layout, fmt) for fmt in FORMATS)
        assert compare(matrix.root, full, sharded, exact=True, start=0).problems == [], layout


def compare_writer(root: Path, layout: str, fmt: str) -> Comparison:
    exact = layout == "single"
    return compare(
        root, write_folder("single", "full"), write_folder(layout, fmt), exact, 0, FROM_SCRATCH_TOLERANCE
    )


def test_each_format_writes_what_it_promises(matrix: Matrix) -> None:
    """``"sharded"``: a folder with one shard file per rank; ``"full"`` (and one process, DDP): one file."""
    for layout, fmt in matrix.plan.written():
        for step in (SAVE_EVERY, MAX_STEPS):
            path = matrix.root / write_folder(layout, fmt) / checkpoint_name(step)
            if writer_format(layout, fmt) == "sharded":
                shards = sorted(p.name for p in path.glob("*.distcp"))
                assert path.is_dir() and len(shards) == LAYOUTS[layout][0], (layout, fmt, shards)
            else:
                assert path.is_file(), (layout, fmt, step)


@pytest.mark.parametrize("layout", CONSOLIDATED)
def test_inspect_and_consolidate_a_sharded_folder(matrix: Matrix, layout: str) -> None:
    """``inspect`` reports the folder's step, writer and size; ``consolidate`` writes what it holds, and it resumes."""
    folder = resume_checkpoint(matrix.root, layout, "sharded")
    # The command's own code in this process (the consolidate below runs as a user runs it).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli_main(["inspect", "--json", str(folder)]) == 0
    report = json.loads(printed.getvalue())
    n_params = len(list(ReshardNet().parameters()))
    assert report["global_step"] == SAVE_EVERY
    pp, dp, tp = DEGREES[layout]
    assert report["plugin"] == {
        "name": "model_parallel",
        "world_size": LAYOUTS[layout][0],
        "layout": {"pipeline_parallel": pp, "data_parallel": dp, "tensor_parallel": tp},
        "precision": "32-true",
    }
    assert report["sharded"] and report["shard_files"] >= 1 and report["resumable"]
    assert report["parameter_names"] == n_params
    assert report["optimizers"] == 1 and report["lr_schedulers"] == 1

    merged = matrix.cli[layout]
    assert merged.returncode == 0, merged.stderr
    assert f"global_step {SAVE_EVERY}" in merged.stdout
    out = consolidated_file(matrix.root, layout)
    assert out.is_file()
    whole, written = load_checkpoint(folder), load_checkpoint(out)
    assert sorted(whole) == sorted(written)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch"):
        assert_same(whole[key], written[key], key)
    assert len(written["state_dict"]) == len(ReshardNet().state_dict())
    # One process resumes from the file exactly as from the folder, and like the writer's own run.
    from_file = read_folder("single", "full", f"{layout}-consolidated")
    from_folder = read_folder("single", "sharded", f"{layout}-sharded")
    assert compare(matrix.root, from_folder, from_file, exact=True).problems == []
    writer = compare(matrix.root, write_folder(layout, "sharded"), from_file, exact=False)
    assert writer.problems == [], writer.problems


def assert_same(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` hold the same structure, equal values and bit-equal tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# ---------------------------------------------------------------------- the report
def write_report(path: Path, matrix: Matrix, results: dict[Cell, Comparison]) -> None:
    """Markdown: one 7 x 7 table per format, each cell ``max |loss diff| / max |weight diff|`` or ``exact``."""
    layouts = list(LAYOUTS)
    lines = [
        "# Resharding matrix",
        "",
        f"Writer (row) trains {MAX_STEPS} steps and checkpoints at step {SAVE_EVERY}; reader (column) resumes "
        f"from that checkpoint with fresh seeds in new processes and trains to step {MAX_STEPS}. Each cell: "
        "max |loss diff| over the resumed steps / max |final weight diff|, against the writer's uninterrupted "
        "run; `exact` where both are bit for bit. Learning rates are equal in every cell unless marked. "
        f"Tolerance across layouts: {TOLERANCE}.",
        "",
    ]
    for fmt in FORMATS:
        lines += [f"## Format `{fmt}`", ""]
        if fmt == "sharded":
            lines += [
                f"Rows {', '.join(FILE_WRITERS)} write one file in either format: their rows are the `full` table's.",
                "",
            ]
        lines.append("| writer \\ reader | " + " | ".join(layouts) + " |")
        lines.append("|---" * (len(layouts) + 1) + "|")
        for w in layouts:
            row = []
            for r in layouts:
                cell = Cell(w, r, writer_format(w, fmt))
                row.append(results[cell].text() if cell in results else "")
            lines.append(f"| {w} | " + " | ".join(row) + " |")
        lines.append("")
    diffs = [c for c in results.values() if not c.exact]
    if diffs:
        lines.append(
            f"Largest differences across layouts: losses {max(c.loss_diff for c in diffs):.2e}, "
            f"weights {max(c.weight_diff for c in diffs):.2e}."
        )
    lines += [
        "",
        "## Writers against one process",
        "",
        f"Each writer's uninterrupted run (steps 1-{MAX_STEPS}) against `single`'s: max |loss diff| / max |final "
        f"weight diff| (tolerance {FROM_SCRATCH_TOLERANCE}); a layout's runs in the two formats are bit-equal.",
        "",
        "| writer | " + " | ".join(FORMATS) + " |",
        "|---" * (len(FORMATS) + 1) + "|",
    ]
    written = matrix.plan.written()
    for w in layouts:
        row = [
            compare_writer(matrix.root, w, fmt).text() if (w, fmt) in written else "(as full)"
            for fmt in FORMATS
        ]
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append("Launch wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in matrix.timings.items()))
    path.write_text("\n".join(lines) + "\n")
