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


# ----------------------------------------------------------------------------- multi-process jobs
#
# A distributed worker is one job of several ranks: the parent starts rank 0 only, and rank 0
# starts the other ranks the way its implementation does (a framework's launcher re-running the
# script, or the plain loop's own ``subprocess.Popen``). Each rank writes ``rank<N>.json`` into the
# job's result folder. Times that must compare across processes use CLOCK_BOOTTIME, the clock in
# which the kernel counts a process's start time (``/proc/<pid>/stat``, field 22).


def boottime() -> float:
    """Seconds since boot: one clock shared by every process, and the one process start times use."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start_boottime(pid: int | str = "self") -> float:
    """When process ``pid`` started, in :func:`boottime` seconds (clock-tick resolution, 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for MASTER_PORT)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_rank() -> int:
    """This process's rank among the job's processes on this machine (``LOCAL_RANK``; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def serve_rank_worker(result_dir: str | Path, handler: Callable[[], dict[str, Any]]) -> None:
    """One rank of a job: run ``handler`` and write its result (or traceback) to ``rank<N>.json``."""
    rank = local_rank()
    try:
        result = handler()
    except BaseException:  # the parent needs every failure reported, KeyboardInterrupt included
        result = {"error": traceback.format_exc()}
    result["pid"] = os.getpid()
    path = Path(result_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # the parent polls for the file: it must never see half of it


def run_rank_job(
    command: Sequence[str],
    world_size: int,
    *,
    timeout: float = 900.0,
    show_output: bool = False,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start rank 0 of a job (``command`` plus ``--result-dir DIR``) and wait for every rank to end.

    Returns ``{"ranks": [result of rank 0, 1, ...], "start_boottime": ..., "job_s": ...}``, where
    ``job_s`` runs from just before rank 0 starts until the last rank's process is gone. Rank 0 is
    started in a session of its own so that a hung job is ended whole (every rank it started).
    """
    import signal

    env = {**worker_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(extra_env or {})}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        env.pop(name, None)  # rank 0 must see itself as the first process of a fresh job
    with tempfile.TemporaryDirectory(prefix="bench-job-") as tmp:
        result_dir = Path(tmp) / "results"
        result_dir.mkdir()
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        cmd = [sys.executable, *command, "--result-dir", str(result_dir)]
        sink = None if show_output else subprocess.DEVNULL
        deadline = time.monotonic() + timeout
        start = boottime()
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=sink, env=env, cwd=str(run_dir), start_new_session=True
        )
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            end = boottime()
            results = []
            for rank in range(world_size):
                path = result_dir / f"rank{rank}.json"
                while not path.exists():
                    if rank == 0 or time.monotonic() > deadline:  # rank 0 has exited already
                        raise WorkerError(
                            f"rank {rank} of {command} wrote no result (rank 0 exit status {proc.returncode})"
                        )
                    time.sleep(0.005)
                result = json.loads(path.read_text())
                if "error" in result:
                    raise WorkerError(f"job {command} failed on rank {rank}:\n{result['error']}")
                if rank:
                    _wait_gone(result["pid"], deadline)
                    end = max(end, boottime())
                results.append(result)
        except subprocess.TimeoutExpired as err:
            raise WorkerError(f"job {command} ran past {timeout:.0f} s") from err
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of this job is still running
            except ProcessLookupError:
                pass
            proc.wait()
    return {"ranks": results, "start_boottime": start, "job_s": end - start}


def _wait_gone(pid: int, deadline: float) -> None:
    """Wait until process ``pid`` (not our child) has exited; a zombie counts as exited, since its
    reaping is up to its parent, or to PID 1 once rank 0 is gone, and that can take a second."""
    import psutil

    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.005)
    raise subprocess.TimeoutExpired(str(pid), 0)


def write_profile(profiler: Any, path: str | Path, lines: int = 40) -> Path:
    """Dump a ``cProfile.Profile`` to ``path`` and its top ``lines`` (own time, cumulative) to ``path``.txt."""
    import io
    import pstats

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(path))
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    txt = path.with_suffix(".txt")
    txt.write_text(text.getvalue())
    return txt


def parse_cases(parser: Any, text: str, known: Sequence[str]) -> list[str]:
    """A comma-separated ``--cases`` value as a list, or a parser error naming the unknown ones."""
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in cases if c not in known]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(known)}")
    return cases
