"""Time to recover: from a fault to the first optimizer step that completes after it, per kind of fault.

Each trial runs ``tests/jobs/elastic_job.py`` (a tiny seeded DDP job, a checkpoint every ``K`` steps,
``fit()`` without ``ckpt_path``: the restart resumes by itself) under real torchrun agents on loopback
(gloo) and injects one fault:

* ``rank``  ``--standalone --nproc_per_node 2 --max-restarts 2``: rank 1 SIGKILLs itself; torchrun
            stops rank 0 and restarts both;
* ``node``  two agents (``--nnodes 1:2``, c10d rendezvous, one worker each) stand for two nodes; rank 1
            SIGKILLs its agent and itself (the node dies); node 1 continues alone at world size 1;
* ``hang``  as ``rank``, but rank 1 sleeps for ever; ``HangWatchdog(timeout=...)`` ends every rank
            and torchrun restarts them (skipped when ``callbacks/hang_watchdog.py`` is missing).

The fault comes right before a checkpoint is due (step ``3K - 1``), the worst case: ``K - 1`` steps
are lost. Every worker writes its events (process start, imports done, process group up, checkpoint
read, training start, each step) to a file; from them:

* ``recover s``   fault -> first step completed by the restarted workers;
* ``lost``        steps done before the fault minus the step resumed from (at most ``K``);
* the parts of ``recover s``: ``restart`` (fault -> the new workers' interpreters start: detection,
  stopping the old workers, rendezvous, spawn; for ``hang`` the watchdog's timeout is in it),
  ``import`` (torch and trainer-core imported), ``pg`` (to the ``setup`` hook: process group up),
  ``load`` (to the checkpoint read), ``setup`` (to ``on_train_start``: optimizers, the rest of the
  restore), ``step`` (the first step). Each boundary is the slowest rank's.

Medians of ``--trials`` trials per kind, side by side; every sample goes to
``bench_results/recovery.json``.

    python benchmarks/recovery.py              # 5 trials per kind (about 10 minutes on 2 slow cores)
    python benchmarks/recovery.py --quick      # 1 trial per kind (about 2 minutes)
    python benchmarks/recovery.py --kinds rank --trials 10
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

JOB = common.REPO_ROOT / "tests" / "jobs" / "elastic_job.py"
WATCHDOG = common.REPO_ROOT / "callbacks" / "hang_watchdog.py"
RESULT_PATH = common.RESULTS_DIR / "recovery.json"
KINDS = ("rank", "node", "hang")
PARTS = ("restart", "import", "pg", "load", "setup", "step")
#: Fast failure detection on loopback: a heartbeat every second, a node dead after 4 s without one; an
#: agent alone waits 2 s for others before it continues at the smaller size. torchelastic refreshes a
#: heartbeat only once it is a full interval old, so a live node's can be nearly two intervals old: with
#: keep_alive_max_attempt=2 a busy machine declared a live agent dead, and a node that came back formed
#: a world of its own beside it (two runs writing one checkpoint folder).
RDZV_CONF = (
    "join_timeout=60,last_call_timeout=2,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=4"
)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    env = common.worker_env()
    for name in LAUNCH_VARS:
        env.pop(name, None)
    for name in [n for n in env if n.startswith(("TORCHELASTIC_", "SLURM_"))]:
        env.pop(name)
    return env


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.1", *args]


def _free_port() -> int:
    # Below the ephemeral range, as the library picks rendezvous ports (gloo opens many connections).
    from trainer_core.plugins.environments import find_free_port

    return find_free_port()


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in victims:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def run_trial(kind: str, every: int, watchdog: float, timeout: float, show_output: bool) -> dict[str, Any]:
    """One job with one fault; returns the measured figures (raises WorkerError when the job fails)."""
    fault_step = 3 * every - 1
    job_args = [str(JOB), "--every", str(every), "--max-steps", str(4 * every)]
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        out = Path(tmp)
        job_args += ["--out", str(out)]
        if kind == "node":
            port = _free_port()
            conf = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "bench"]
            agent = [*_torchrun("--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "3", *conf)]
            # The node that dies is the one not hosting the rendezvous store (it must live), whatever its rank.
            job_args += ["--devices", "1", "--num-nodes", "2", "--wait-world", "2"]
            job_args += ["--fault", f"node:@node2:{fault_step}:once"]
            # Agent 2 first: it waits for agent 1's store and joins the first round the moment it exists
            # (a node joining a running world makes torch 2.13's agents deadlock: see tests/reliability).
            cmds = [
                [*agent, "--rdzv_conf", f"is_host=0,{RDZV_CONF}", *job_args],
                [*agent, "--rdzv_conf", f"is_host=1,{RDZV_CONF}", *job_args],
            ]
        else:
            job_args += ["--devices", "2", "--fault", f"{kind if kind == 'hang' else 'kill'}:1:{fault_step}"]
            if kind == "hang":
                job_args += ["--watchdog", str(watchdog)]
            cmds = [[*_torchrun("--standalone", "--nproc_per_node", "2", "--max-restarts", "2"), *job_args]]
        sink = None if show_output else subprocess.DEVNULL
        procs: list[subprocess.Popen] = []
        deadline = time.monotonic() + timeout
        try:
            for i, cmd in enumerate(cmds):
                env = {**_env(), "ELASTIC_NODE": f"node{len(cmds) - i}"}  # the first started is node 2
                procs.append(
                    subprocess.Popen(cmd, env=env, cwd=tmp, stdout=sink, stderr=sink, start_new_session=True)
                )
            try:
                code = procs[-1].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise common.WorkerError(f"{kind}: the job ran past {timeout:.0f} s") from None
        finally:
            for proc in procs:
                _kill_tree(proc.pid)
                proc.wait()
        if code != 0:
            raise common.WorkerError(f"{kind}: torchrun exited with status {code}")
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return measure(events, every)


def measure(events: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Recovery time, its parts and the steps lost, from one faulted job's events."""
    (fault,) = [e for e in events if e["event"] == "fault"]
    t0 = fault["t"]
    after = [e for e in events if e["event"] == "step" and e["attempt"] > fault["attempt"]]
    if not after:
        raise common.WorkerError("no step completed after the fault")
    attempt = after[0]["attempt"]
    mine = [e for e in events if e["attempt"] == attempt]

    def latest(kind: str, field: str = "t") -> Optional[float]:
        values = [e[field] for e in mine if e["event"] == kind]
        return max(values) if values else None

    starts = [e["import_start_t"] for e in mine if e["event"] == "start"]
    first_step = min(e["t"] for e in after)
    bounds = [t0, min(starts), latest("start", "imported_t"), latest("setup")]
    loaded = latest("loaded")
    bounds.append(loaded if loaded is not None else bounds[-1])
    bounds += [latest("resumed"), first_step]
    parts = {name: round(bounds[i + 1] - bounds[i], 3) for i, name in enumerate(PARTS)}
    resumed = {e["step"] for e in mine if e["event"] == "resumed"}
    if len(resumed) != 1:
        raise common.WorkerError(
            f"the ranks of attempt {attempt} resumed at different steps: {sorted(resumed)}"
        )
    (resumed_step,) = resumed
    done_before = max(e["step"] for e in events if e["event"] == "step" and e["attempt"] == fault["attempt"])
    return {
        "recover_s": round(first_step - t0, 3),
        "lost_steps": done_before - resumed_step,
        "fault_step": done_before,
        "resumed_step": resumed_step,
        "world_after": mine[0]["world"],
        "attempts_to_recover": attempt - fault["attempt"],
        "parts_s": parts,
    }


def _summarize(samples: dict[str, list[dict[str, Any]]], every: int) -> list[dict[str, Any]]:
    rows = []
    for kind, trials in samples.items():
        ok = [t for t in trials if "error" not in t]
        row: dict[str, Any] = {
            "kind": kind,
            "trials": len(trials),
            "failed": len(trials) - len(ok),
            "K": every,
        }
        if ok:
            row["recover_s"] = common.median(t["recover_s"] for t in ok)
            row["spread_pct"] = common.spread_pct(t["recover_s"] for t in ok)
            row["lost_median"] = common.median(t["lost_steps"] for t in ok)
            row["lost_max"] = max(t["lost_steps"] for t in ok)
            row["world_after"] = sorted({t["world_after"] for t in ok})
            row["parts_s"] = {p: common.median(t["parts_s"][p] for t in ok) for p in PARTS}
        rows.append(row)
    return rows


def _render(rows: list[dict[str, Any]]) -> str:
    headers = ["fault", "ok/trials", "recover s", "spread %", "lost (max)", "K", "world after", *PARTS]
    table = []
    for r in rows:
        if "recover_s" not in r:
            table.append([r["kind"], f"0/{r['trials']}", *["-"] * (len(headers) - 2)])
            continue
        table.append(
            [
                r["kind"],
                f"{r['trials'] - r['failed']}/{r['trials']}",
                f"{r['recover_s']:.2f}",
                f"{r['spread_pct']:.0f}",
                f"{r['lost_median']:g} ({r['lost_max']})",
                r["K"],
                ",".join(map(str, r["world_after"])),
                *(f"{r['parts_s'][p]:.2f}" for p in PARTS),
            ]
        )
    return common.format_table(headers, table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument(
        "--trials", type=int, default=None, help="trials per kind (default 5; 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="one trial per kind")
    parser.add_argument("--every", type=int, default=4, help="K: a checkpoint every K steps (default 4)")
    parser.add_argument("--watchdog", type=float, default=3.0, help="HangWatchdog timeout in seconds")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a trial counts as hung")
    parser.add_argument("--out", type=Path, default=RESULT_PATH)
    parser.add_argument("--show-output", action="store_true", help="let the agents print (debugging)")
    args = parser.parse_args(argv)
    kinds = common.parse_cases(parser, args.kinds, KINDS)
    trials = args.trials or (1 if args.quick else 5)
    skipped = {}
    if "hang" in kinds and not WATCHDOG.exists():
        skipped["hang"] = f"{WATCHDOG.relative_to(common.REPO_ROOT)} is missing"
        kinds.remove("hang")
    for kind, reason in skipped.items():
        common.log(f"skipping {kind}: {reason}")

    started = time.perf_counter()
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for trial in range(trials):
        for kind in common.rotated(kinds, trial):  # interleaved: machine noise hits every kind alike
            t = time.perf_counter()
            try:
                result = run_trial(kind, args.every, args.watchdog, args.timeout, args.show_output)
            except common.WorkerError as err:
                result = {"error": str(err)}
            common.log(f"trial {trial} {kind}: {result} ({time.perf_counter() - t:.0f} s)")
            samples[kind].append(result)
    rows = _summarize(samples, args.every)
    print(_render(rows))
    common.write_json(
        args.out,
        {
            "benchmark": "recovery",
            "config": {"kinds": kinds, "trials": trials, "every": args.every, "watchdog_s": args.watchdog},
            "machine": common.machine_info(),
            "versions": common.package_versions(["torch", "trainer-core"]),
            "summary": rows,
            "samples": samples,
            "skipped": skipped,
            "seconds": round(time.perf_counter() - started, 1),
        },
    )
    common.log(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    failed = [r["kind"] for r in rows if r["failed"]]
    too_many = [r["kind"] for r in rows if r.get("lost_max", 0) > r["K"]]
    if failed:
        common.log(f"trials failed for: {failed}")
    if too_many:
        common.log(f"more than K steps lost for: {too_many}")
    return 1 if failed or too_many else 0


if __name__ == "__main__":
    sys.exit(main())
