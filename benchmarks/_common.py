"""Shared helpers for the benchmarks: worker subprocesses, timing statistics, tables, JSON.

Every measurement runs in a fresh worker process (``python <script> --worker SPEC --result PATH``)
so that one framework's imports, caches and monkey-patches never touch another's numbers, and
measurements of different implementations are interleaved so that machine noise hits all of them
alike. The worker's stdout and stderr go to ``os.devnull`` (progress bars cost the same for
everyone); a failing worker reports its traceback through the result file instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench_results"

# Thread pools sized before torch is imported; torch.set_num_threads(1) in the worker covers
# intra-op, these cover OpenMP/MKL pools and tokenizers-style libraries spawned at import.
_SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
}
# Installed packages ship compiled bytecode; a project installed in editable mode does not, and
# with PYTHONDONTWRITEBYTECODE set it would be recompiled in every worker, inside the timing of
# its first lazy import. Workers therefore always cache bytecode, outside the source tree.
_BYTECODE_CACHE = RESULTS_DIR / "pycache"


def worker_env() -> dict[str, str]:
    """The environment of every worker: single-threaded pools and a bytecode cache."""
    env = {**os.environ, **_SINGLE_THREAD_ENV, "PYTHONPYCACHEPREFIX": str(_BYTECODE_CACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its traceback or exit status."""


# ----------------------------------------------------------------------------- parent side


def run_worker(
    script: str | Path,
    spec: dict[str, Any],
    *,
    timeout: float = 900.0,
    show_output: bool = False,
    cwd: str | Path | None = None,
) -> dict[str, Any]:
    """Run ``script --worker SPEC`` in a fresh interpreter and return the dict it reports."""
    env = worker_env()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, str(script), "--worker", json.dumps(spec), "--result", str(result_path)]
        sink = None if show_output else subprocess.DEVNULL
        try:
            proc = subprocess.run(
                cmd, stdout=sink, stderr=sink, env=env, cwd=str(cwd or tmp), timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise WorkerError(f"worker {spec} ran past {timeout:.0f} s") from err
        if not result_path.exists():
            raise WorkerError(f"worker {spec} exited with status {proc.returncode} and wrote no result")
        result = json.loads(result_path.read_text())
    if "error" in result:
        raise WorkerError(f"worker {spec} failed:\n{result['error']}")
    return result


def probe_import(statement: str) -> str | None:
    """Run ``statement`` in a fresh interpreter; return None if it works, else the error's last line."""
    proc = subprocess.run(
        [sys.executable, "-c", statement],
        capture_output=True,
        text=True,
        env=worker_env(),
    )
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    """``items`` rotated left by ``by``: repeat ``r`` starts with a different implementation."""
    if not items:
        return []
    k = by % len(items)
    return list(items[k:]) + list(items[:k])


# ----------------------------------------------------------------------------- worker side


def serve_worker(argv: Sequence[str], handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Entry point of a worker: parse ``--worker``/``--result``, run ``handler``, write its result."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--result", required=True)
    args, _ = parser.parse_known_args(argv)
    spec = json.loads(args.worker)
    try:
        result = handler(spec)
    except BaseException:  # the parent needs every failure reported, KeyboardInterrupt included
        result = {"error": traceback.format_exc()}
    Path(args.result).write_text(json.dumps(result))


def pin_to_cpu(cpu: int | None) -> None:
    """Pin this process to one core (optional; on a shared machine it can cut migrations)."""
    if cpu is None:
        return
    import psutil

    psutil.Process().cpu_affinity([cpu])


class Stopwatch:
    """``perf_counter_ns`` start/stop pairs; ``elapsed_ns`` of the last pair."""

    __slots__ = ("start_ns", "stop_ns")

    def __init__(self) -> None:
        self.start_ns = 0
        self.stop_ns = 0

    def start(self) -> None:
        self.start_ns = time.perf_counter_ns()

    def stop(self) -> None:
        self.stop_ns = time.perf_counter_ns()

    @property
    def elapsed_ns(self) -> int:
        return self.stop_ns - self.start_ns


# ----------------------------------------------------------------------------- statistics and output


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def spread_pct(values: Iterable[float]) -> float:
    """(max - min) / median, in percent: how far apart the repeats landed."""
    values = list(values)
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return 100.0 * (max(values) - min(values)) / mid if mid else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; ``align`` holds one of ``<``/``>`` per column (default: text left, numbers right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    if align is None:
        align = "".join(
            ">" if all(_looks_numeric(row[i]) for row in cells[1:]) and len(cells) > 1 else "<"
            for i in range(len(headers))
        )

    def line(row: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, align, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def _looks_numeric(text: str) -> bool:
    text = text.strip().rstrip("x%")
    try:
        float(text)
    except ValueError:
        return text in ("", "-", "n/a")
    return True


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, load, Python and package versions."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        freq = psutil.cpu_freq()
        if freq is not None:
            info["cpu_mhz"] = round(freq.current)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return info


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed distribution versions (None when missing), without importing the packages."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def log(message: str) -> None:
    """Progress lines go to stderr so that stdout holds only the table."""
    print(message, file=sys.stderr, flush=True)
