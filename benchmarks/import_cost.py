"""Import cost: what ``import trainer_core`` adds to ``import torch``, beside PyTorch Lightning.

Every process of a run pays its imports: each rank of a distributed job, each CLI call
(``python -m trainer_core.checkpoint ...``). torch itself is the floor; this measures what comes on
top of it. Cases, each in a fresh process:

* ``torch``              ``import torch``
* ``trainer-core``       ``import torch`` then ``import trainer_core``
* ``tc-trainer``         ``import torch`` then ``from trainer_core import Trainer, LightningModule``
* ``pytorch_lightning``  ``import torch`` then ``import pytorch_lightning``
* ``lightning``          ``import torch`` then ``import lightning.pytorch``
                         (each Lightning case skipped with a note when it is not installed)
* ``tc+dcp-io``          ``import torch`` then ``import trainer_core`` and
                         ``from trainer_core.plugins import DistributedCheckpointIO``: the part that
                         loads on first use (``torch.distributed.checkpoint`` and DTensor), paid only
                         by a run that writes sharded checkpoints.

Each process times ``import torch`` and, separately, what it imports next (``time.perf_counter``
around each statement, interpreter start-up excluded), so ``added`` is measured in the same
process as the torch it adds to. ``of it gc`` is the part of ``added`` spent in Python's garbage
collector: with torch's objects alive a full collection takes a tenth of a second or more, and an
import that allocates enough triggers one (a later one then falls in the run instead).

CLI start-up is timed as whole processes: ``python -m trainer_core --help`` beside
``python -c "import torch"``, interleaved the same way (``--cases`` names them ``cli-help`` and
``torch-process``). Cases are interleaved and rotated across repeats so that noise on
a shared machine hits all of them alike; one untimed run per case comes first, and workers cache
bytecode under ``bench_results/pycache`` even when PYTHONDONTWRITEBYTECODE is set (an installed
package ships bytecode; an editable checkout would otherwise be recompiled in every process).

The table shows medians over the repeats; the JSON (``bench_results/import_cost.json``) holds every
sample. Target: ``import trainer_core`` adds at most 0.15 s to ``import torch``.

    python benchmarks/import_cost.py              # 15 processes per case (about a minute)
    python benchmarks/import_cost.py --quick      # 3 per case
    python benchmarks/import_cost.py --importtime # also list the slowest modules trainer_core imports
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

DEFAULT_REPEATS = 15
QUICK_REPEATS = 3
TARGET_CASE = "trainer-core"
TARGET_ADDED_S = 0.15

# What each case imports after torch (None: torch alone).
CASES: dict[str, Optional[str]] = {
    "torch": None,
    "trainer-core": "import trainer_core",
    "tc-trainer": "from trainer_core import Trainer, LightningModule",
    "pytorch_lightning": "import pytorch_lightning",
    "lightning": "import lightning.pytorch",
    "tc+dcp-io": "import trainer_core\nfrom trainer_core.plugins import DistributedCheckpointIO",
}
_OPTIONAL_CASES = ("pytorch_lightning", "lightning")
# Whole processes: the command line after the interpreter.
PROCESS_CASES: dict[str, list[str]] = {
    "torch-process": ["-c", "import torch"],
    "cli-help": ["-m", "trainer_core", "--help"],
}

# The worker is a bare interpreter running this program: importing the benchmark's own helpers
# there would load modules (json, subprocess, ...) that the measured import then finds loaded.
_WORKER = """
import gc, time
start = time.perf_counter()
import torch
torch_done = time.perf_counter()
gc_s = [0.0, 0.0]
def _gc(phase, info):
    if phase == "start":
        gc_s[1] = time.perf_counter()
    else:
        gc_s[0] += time.perf_counter() - gc_s[1]
gc.callbacks.append(_gc)
exec(compile({after!r}, "<import>", "exec"))
end = time.perf_counter()
print("RESULT", torch_done - start, end - torch_done, gc_s[0])
"""


def _worker_cwd() -> str:
    """A folder without the repository's packages in it, so imports go through the installed paths."""
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return str(common.RESULTS_DIR)


def _run_case(after: Optional[str], timeout: float = 300.0) -> dict[str, float]:
    """One fresh process: seconds for ``import torch`` and for what it imports next."""
    program = _WORKER.format(after=after or "")
    proc = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env=common.worker_env(),
        cwd=_worker_cwd(),
        timeout=timeout,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise common.WorkerError(f"import of {after!r} failed: {tail[0]}")
    torch_s, added_s, gc_s = (float(x) for x in lines[-1].split()[1:4])
    return {"torch_s": torch_s, "added_s": added_s, "gc_s": gc_s, "total_s": torch_s + added_s}


def _run_process(args: list[str], timeout: float = 300.0) -> dict[str, float]:
    """One whole process (interpreter start-up included): its wall-clock seconds."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        env=common.worker_env(),
        cwd=_worker_cwd(),
        timeout=timeout,
        check=False,
    )
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise common.WorkerError(f"{' '.join(args)} failed: {tail[0]}")
    return {"wall_s": wall_s}


def _run(name: str, cases: dict[str, Optional[str]]) -> dict[str, float]:
    if name in PROCESS_CASES:
        return _run_process(PROCESS_CASES[name])
    return _run_case(cases[name])


def _measure(cases: dict[str, Optional[str]], repeats: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    samples: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    common.log("priming (one untimed process per case: bytecode and file-system caches)")
    for name in cases:
        try:
            _run(name, cases)
        except (common.WorkerError, subprocess.TimeoutExpired) as err:
            failures[name] = str(err)
            common.log(f"{name} failed; dropping it from this run: {err}")
    names = [name for name in cases if name not in failures]
    for repeat in range(repeats):
        for name in common.rotated(names, repeat):
            if name in failures:
                continue
            try:
                result = _run(name, cases)
            except (common.WorkerError, subprocess.TimeoutExpired) as err:
                failures[name] = str(err)
                common.log(f"{name} failed; dropping it from this run: {err}")
                continue
            samples.append({"case": name, "repeat": repeat, **result})
            if "wall_s" in result:
                common.log(f"[{repeat + 1}/{repeats}] {name:<17} process {result['wall_s']:.3f} s")
            else:
                common.log(
                    f"[{repeat + 1}/{repeats}] {name:<17} torch {result['torch_s']:.3f} s  "
                    f"then {result['added_s']:.3f} s (gc {result['gc_s']:.3f} s)"
                )
    return samples, failures


def _summarize(samples: list[dict[str, Any]], cases: dict[str, Optional[str]]) -> list[dict[str, Any]]:
    rows = []
    for name, after in cases.items():
        mine = [s for s in samples if s["case"] == name]
        if not mine or name in PROCESS_CASES:
            continue
        rows.append(
            {
                "case": name,
                "imports": "import torch" + ("; " + after.replace("\n", "; ") if after else ""),
                "repeats": len(mine),
                "total_s": common.median(s["total_s"] for s in mine),
                "torch_s": common.median(s["torch_s"] for s in mine),
                "added_s": common.median(s["added_s"] for s in mine),
                "gc_s": common.median(s["gc_s"] for s in mine),
                "added_spread_pct": common.spread_pct(s["added_s"] for s in mine) if after else 0.0,
            }
        )
    return rows


def _target(rows: list[dict[str, Any]], failures: dict[str, str]) -> dict[str, Any]:
    added = next((r["added_s"] for r in rows if r["case"] == TARGET_CASE), None)
    return {
        "case": TARGET_CASE,
        "max_added_s": TARGET_ADDED_S,
        "added_s": added,
        "met": added is not None and added <= TARGET_ADDED_S,
        "not_measured": failures.get(TARGET_CASE),
    }


def _print_table(rows: list[dict[str, Any]], target: dict[str, Any]) -> None:
    table = [
        (
            r["case"],
            f"{r['total_s']:.3f}",
            f"{r['torch_s']:.3f}",
            f"{r['added_s']:.3f}" if r["case"] != "torch" else "-",
            f"{r['gc_s']:.3f}" if r["case"] != "torch" else "-",
            f"{r['added_spread_pct']:.0f}%" if r["case"] != "torch" else "-",
            f"<= {TARGET_ADDED_S:.2f}" if r["case"] == TARGET_CASE else "",
        )
        for r in rows
    ]
    headers = ("case", "total s", "of it torch s", "added s", "of it gc s", "spread", "target s")
    print(common.format_table(headers, table, align="<>>>>><"))
    head = f"target: import trainer_core adds <= {TARGET_ADDED_S:.2f} s to import torch (median)"
    if target["added_s"] is None:
        print(f"{head}: not measured ({target['not_measured'] or 'case not selected'})")
    else:
        print(f"{head}: {target['added_s']:.3f} s -> {'MET' if target['met'] else 'MISSED'}")


def _summarize_processes(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median wall time of each whole-process case, and what it adds to a process that imports torch."""
    walls = {
        name: common.median(s["wall_s"] for s in samples if s["case"] == name)
        for name in PROCESS_CASES
        if any(s["case"] == name for s in samples)
    }
    floor = walls.get("torch-process")
    return [
        {
            "case": name,
            "command": "python " + " ".join(PROCESS_CASES[name]),
            "wall_s": wall,
            "added_s": None if floor is None else wall - floor,
        }
        for name, wall in walls.items()
    ]


def _print_processes(rows: list[dict[str, Any]]) -> None:
    table = [
        (r["command"], f"{r['wall_s']:.3f}", "-" if r["added_s"] is None else f"{r['added_s']:.3f}")
        for r in rows
    ]
    print(common.format_table(("process", "wall s", "over import torch s"), table, align="<>>"))


def _importtime(after: str, top: int = 15) -> list[tuple[str, float]]:
    """The slowest modules (cumulative seconds) that ``after`` imports once torch is loaded."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import torch\n{after}"],
        capture_output=True,
        text=True,
        env=common.worker_env(),
        cwd=_worker_cwd(),
        check=False,
    )
    lines = proc.stderr.splitlines()
    # importtime reports a module when its import ends: everything after torch's line is ours.
    start = next((i for i, line in enumerate(lines) if line.rstrip().endswith("| torch")), -1)
    found: dict[str, float] = {}
    for line in lines[start + 1 :]:
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|", 2)
        # ``from a.b import c`` reports ``a.b`` again at each level that asks for it: keep the largest.
        found[name.strip()] = max(found.get(name.strip(), 0.0), int(cumulative) / 1e6)
    return sorted(found.items(), key=lambda item: -item[1])[:top]


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"fresh processes per case (default {DEFAULT_REPEATS})"
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} processes per case")
    known = [*CASES, *PROCESS_CASES]
    parser.add_argument(
        "--cases", default=",".join(known), help="comma-separated subset of: " + ", ".join(known)
    )
    parser.add_argument(
        "--importtime", action="store_true", help="also list the slowest modules import trainer_core loads"
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 when the target is missed")
    parser.add_argument(
        "--out", default=str(common.RESULTS_DIR / "import_cost.json"), help="where the JSON goes"
    )
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    args.cases = common.parse_cases(parser, args.cases, known)
    return args


def main(argv: Sequence[str]) -> int:
    args = _parse_args(argv)
    cases = {name: CASES.get(name) for name in args.cases}
    skipped: dict[str, str] = {}
    for name in _OPTIONAL_CASES:
        reason = common.probe_import(cases[name] or "") if name in cases else None
        if reason is not None:
            skipped[name] = reason
            common.log(f"skipping {name}: not importable ({reason})")
            del cases[name]

    started = time.time()
    samples, failures = _measure(cases, args.repeats)
    rows = _summarize(samples, cases)
    processes = _summarize_processes(samples)
    target = _target(rows, failures)
    _print_table(rows, target)
    if processes:
        _print_processes(processes)
    for name, reason in skipped.items():
        print(f"{name} skipped: {reason}")
    for name, error in failures.items():
        print(f"{name} failed: {error.strip().splitlines()[-1]}")
    slowest = _importtime(CASES[TARGET_CASE] or "") if args.importtime else []
    if slowest:
        print("\nslowest modules import trainer_core loads after torch (cumulative s, one process):")
        print(common.format_table(("module", "s"), [(name, f"{s:.3f}") for name, s in slowest]))

    payload = {
        "benchmark": "import_cost",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "config": {"repeats": args.repeats, "cases": cases},
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "pytorch-lightning", "lightning", "trainer-core"]),
        "skipped": skipped,
        "failures": failures,
        "summary": rows,
        "processes": processes,
        "target": target,
        "importtime": slowest,
        "samples": samples,
    }
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path}")
    return 1 if args.check and not target["met"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
