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

Beside the restarts, the fault-tolerant plugin (``"ddp_ft"``, torchft): replica groups of one process
each (``tests/jobs/ft_job.py`` under ``tests/helpers/ft_groups.py``, a torchft lighthouse in its own
process) that go on without a dead group and let it heal from a live one, no checkpoint read, no
restart of the others (both kinds skipped when torchft is not installed):

* ``ft``           two groups (lighthouse: heartbeat timeout 1.5 s, join timeout 2 s; job:
                   ``--timeout 5 --step-sleep 0.05``, 400 steps); group 1 is SIGKILLed once it has
                   finished step 11 and started again 1 s later. 400 steps keep the survivor training
                   long after the new process is up (its start-up alone takes seconds): a group that
                   comes back after the others have finished finds no one to heal from, and with
                   ``min_replicas=1`` trains alone from step 0 (the trial then fails). Two rows:

  - *survivors* (group 0): ``recover s`` is the fault -> its first committed step after it;
    ``pause s (gap)`` the largest gap between its consecutive steps around the fault minus its
    median step time (the raw gap in brackets); ``lost`` its committed steps before the fault minus
    (the step committed after the pause - 1), 0 as committed steps never go back; ``uncommitted``
    the step attempts that did not commit (``steps_record``); ``world after`` the groups in the
    quorum of that first committed step (2 when the restarted group was back in time for it).
  - *the rejoining group* (group 1's new process): ``recover s`` is its restart (``Popen``) -> its
    first finished step, split into ``import`` (start-up: interpreter, imports, Trainer and torchft
    Manager up to its first quorum; the rest once ``load`` and ``step`` are taken off), ``load``
    (the heal: ``heal_seconds``, the quorum, receiving the live group's state and loading it) and
    ``step`` (the survivor's median step time, an estimate of the first step itself).

* ``ft_overhead``  no fault: the cost per step of the quorum, the vote and torchft's all-reduce. Two
                   groups (``Lighthouse(min_replicas=2)``, ``--min-groups 2 --batches 400``, 300 steps,
                   no sleep) against plain ``"ddp"`` on two ranks under torchrun (the same job, the same
                   batches); each side's median gap between consecutive steps of rank/group 0 (the first
                   20 steps left out), the difference (``+ms/step``) and the ratio. Both sides compute
                   a sha256 digest of the weights in a callback every step (part of both per-step
                   times). Medians of 3 repeats (``--overhead-repeats``; ``--trials`` when given, 1 with
                   ``--quick``), printed as a table of its own.

Medians of ``--trials`` trials per kind, side by side; every sample goes to
``bench_results/recovery.json``.

    python benchmarks/recovery.py              # 5 trials per kind (about 15 minutes on 2 slow cores)
    python benchmarks/recovery.py --quick      # 1 trial per kind (about 4 minutes)
    python benchmarks/recovery.py --kinds rank --trials 10
    python benchmarks/recovery.py --kinds ft,ft_overhead --quick
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

JOB = common.REPO_ROOT / "tests" / "jobs" / "elastic_job.py"
FT_JOB = common.REPO_ROOT / "tests" / "jobs" / "ft_job.py"
FT_HELPERS = common.REPO_ROOT / "tests" / "helpers"
WATCHDOG = common.REPO_ROOT / "callbacks" / "hang_watchdog.py"
RESULT_PATH = common.RESULTS_DIR / "recovery.json"
FT_KINDS = ("ft", "ft_overhead")
KINDS = ("rank", "node", "hang", *FT_KINDS)
PARTS = ("restart", "import", "pg", "load", "setup", "step")
#: The ``ft`` trial, as tests/reliability/test_fault_tolerance.py runs its groups.
FT_ARGS = ["--timeout", "5", "--step-sleep", "0.05"]
FT_STEPS = 400
FT_KILL_AT = 11
FT_RESTART_AFTER_S = 1.0
FT_HEARTBEAT_MS = 1500
FT_JOIN_MS = 2000
#: The ``ft_overhead`` runs.
OVERHEAD_STEPS = 300
OVERHEAD_SKIP = 20
OVERHEAD_ARGS = ["--batches", "400"]
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


def _ft_helpers() -> Any:
    """``tests/helpers/ft_groups.py`` (``Lighthouse``, ``Groups``), imported from the test tree."""
    if str(FT_HELPERS) not in sys.path:
        sys.path.insert(0, str(FT_HELPERS))
    import ft_groups

    return ft_groups


def run_ft_trial(timeout: float) -> dict[str, Any]:
    """Two ``ddp_ft`` replica groups; group 1 SIGKILLed after step ``FT_KILL_AT`` and started again."""
    ft = _ft_helpers()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-ft-") as tmp:
        out = Path(tmp)
        try:
            lighthouse = ft.Lighthouse(heartbeat_ms=FT_HEARTBEAT_MS, join_ms=FT_JOIN_MS)
        except AssertionError as err:
            raise common.WorkerError(f"ft: the lighthouse did not start: {err}") from None
        groups = ft.Groups(out, lighthouse, 2, [str(FT_STEPS), *FT_ARGS])
        try:
            groups.start_all()
            try:
                groups.wait_for_step(1, FT_KILL_AT, timeout=min(120.0, timeout))
            except AssertionError as err:
                raise common.WorkerError(f"ft: {err}") from None
            kill_t = time.time()
            groups.kill(1)
            time.sleep(FT_RESTART_AFTER_S)
            restart_t = time.time()
            groups.start(1)
            codes = groups.wait(timeout)
        finally:
            groups.stop()
            lighthouse.kill()
        _check_exits(groups, codes, "ft: the groups")
        survivor, rejoined = groups.result(0), groups.result(1)
    return measure_ft(survivor, rejoined, kill_t, restart_t)


def _check_exits(groups: Any, codes: dict[int, int], what: str) -> None:
    """Raise with both groups' logs unless both exited 0."""
    if codes != {0: 0, 1: 0}:
        logs = "\n".join(f"--- group {g}:\n{groups.log(g)}" for g in (0, 1))
        raise common.WorkerError(f"{what} exited with {codes}\n{logs}")


def measure_ft(
    survivor: dict[str, Any], rejoined: dict[str, Any], kill_t: float, restart_t: float
) -> dict[str, Any]:
    """The survivor's pause and lost steps, and the rejoining group's time to its first step, from their results."""
    steps = survivor["steps"]
    times = [s["time"] for s in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    normal = statistics.median(gaps)
    before = [i for i, s in enumerate(steps) if s["time"] <= kill_t]
    if not before:
        raise common.WorkerError("ft: the survivor had finished no step when group 1 was killed")
    last = before[-1]
    done_before = steps[last]["global_step"]
    # A step whose global_step went up committed; an attempt that did not commit leaves it where it was.
    committed_after = [
        i for i in range(last + 1, len(steps)) if steps[i]["global_step"] > steps[i - 1]["global_step"]
    ]
    if not committed_after:
        raise common.WorkerError("ft: the survivor committed no step after the fault")
    first = committed_after[0]
    raw_gap = max(gaps[last:first])
    uncommitted = sum(run["batches"] for run in survivor["steps_record"] or [] if not run["committed"])
    later_gaps = gaps[first:]
    healed = rejoined["heal_seconds"] or []
    if not healed or not rejoined["steps"]:
        raise common.WorkerError(
            f"ft: the restarted group did not heal (heal_seconds={healed}); the survivor finished "
            f"{times[-1] - restart_t:.1f} s after the restart, the restarted group's first step came "
            f"{(rejoined['steps'] or [{'time': float('nan')}])[0]['time'] - restart_t:.1f} s after it"
        )
    heal = healed[-1]
    back = rejoined["steps"][0]
    to_first_step = back["time"] - restart_t
    by_step = {s["global_step"]: s["digest"] for s in steps}
    return {
        "recover_s": round(steps[first]["time"] - kill_t, 3),
        "pause_s": round(raw_gap - normal, 3),
        "gap_s": round(raw_gap, 3),
        "step_s": round(normal, 4),
        "lost_steps": done_before - (steps[first]["global_step"] - 1),
        "fault_step": done_before,
        "resumed_step": steps[first]["global_step"],
        "uncommitted": uncommitted,
        "world_after": int(steps[first]["live"]),
        # The survivor's largest gap once it had recovered: the rejoining group's heal, when it came later.
        "later_gap_s": round(max(later_gaps), 3) if later_gaps else None,
        "rejoin": {
            "recover_s": round(to_first_step, 3),
            "startup_s": round(to_first_step - heal - normal, 3),
            "heal_s": round(heal, 3),
            "step_s": round(normal, 4),
            "heals": len(healed),
            "first_step": back["global_step"],
            "world_after": int(back["live"]),
            "digests_match": all(by_step.get(s["global_step"]) == s["digest"] for s in rejoined["steps"]),
        },
    }


def _step_time(result: dict[str, Any]) -> float:
    times = [s["time"] for s in result["steps"]][OVERHEAD_SKIP:]
    if len(times) < 2:
        raise common.WorkerError(f"ft_overhead: only {len(result['steps'])} steps recorded")
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def _overhead_ft(out: Path, timeout: float) -> float:
    ft = _ft_helpers()
    try:
        lighthouse = ft.Lighthouse(min_replicas=2)
    except AssertionError as err:
        raise common.WorkerError(f"ft_overhead: the lighthouse did not start: {err}") from None
    groups = ft.Groups(out, lighthouse, 2, [str(OVERHEAD_STEPS), "--min-groups", "2", *OVERHEAD_ARGS])
    try:
        groups.start_all()
        codes = groups.wait(timeout)
    finally:
        groups.stop()
        lighthouse.kill()
    _check_exits(groups, codes, "ft_overhead: the ddp_ft groups")
    return _step_time(groups.result(0))


def _overhead_ddp(out: Path, timeout: float, show_output: bool) -> float:
    ft = _ft_helpers()
    cmd = [
        *_torchrun("--standalone", "--nproc-per-node", "2"),
        str(FT_JOB),
        str(out),
        str(OVERHEAD_STEPS),
        "--plugin",
        "ddp",
        *OVERHEAD_ARGS,
    ]
    sink = None if show_output else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=ft.job_env(), stdout=sink, stderr=sink, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise common.WorkerError(f"ft_overhead: the ddp run ran past {timeout:.0f} s") from None
    finally:
        _kill_tree(proc.pid)
        proc.wait()
    if code != 0:
        raise common.WorkerError(f"ft_overhead: the ddp run exited with status {code}")
    return _step_time(json.loads((out / "group0.json").read_text()))


def run_overhead_trial(trial: int, timeout: float, show_output: bool) -> dict[str, Any]:
    """Per-step time of two ``ddp_ft`` groups and of two ``ddp`` ranks, no fault (the order alternates)."""
    measured: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-overhead-") as tmp:
        for side in common.rotated(["ddp_ft", "ddp"], trial):
            t = time.perf_counter()
            if side == "ddp_ft":
                measured[side] = _overhead_ft(Path(tmp) / side, timeout)
            else:
                measured[side] = _overhead_ddp(Path(tmp) / side, timeout, show_output)
            common.log(f"  {side}: {measured[side] * 1000:.2f} ms/step ({time.perf_counter() - t:.0f} s)")
    return {
        "ddp_ft_step_s": round(measured["ddp_ft"], 5),
        "ddp_step_s": round(measured["ddp"], 5),
        "ratio": round(measured["ddp_ft"] / measured["ddp"], 3),
    }


FT_ROWS = {
    "survivors": "ft: replica group killed (ddp_ft, survivors)",
    "rejoin": "ft: replica group killed (ddp_ft, the rejoining group)",
}


def _summarize(samples: dict[str, list[dict[str, Any]]], every: int) -> list[dict[str, Any]]:
    rows = []
    for kind, trials in samples.items():
        if kind == "ft_overhead":
            continue
        ok = [t for t in trials if "error" not in t]
        if kind == "ft":
            rows += _summarize_ft(trials, ok)
            continue
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


def _summarize_ft(trials: list[dict[str, Any]], ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two rows of the table: the surviving group and the one that was killed and came back."""
    base = {"trials": len(trials), "failed": len(trials) - len(ok), "K": None}
    survivors: dict[str, Any] = {"kind": FT_ROWS["survivors"], **base}
    rejoin: dict[str, Any] = {"kind": FT_ROWS["rejoin"], **base}
    if ok:
        med = common.median
        survivors["recover_s"] = med(t["recover_s"] for t in ok)
        survivors["spread_pct"] = common.spread_pct(t["recover_s"] for t in ok)
        survivors["lost_median"] = med(t["lost_steps"] for t in ok)
        survivors["lost_max"] = max(t["lost_steps"] for t in ok)
        survivors["world_after"] = sorted({t["world_after"] for t in ok})
        survivors["pause_s"] = med(t["pause_s"] for t in ok)
        survivors["gap_s"] = med(t["gap_s"] for t in ok)
        survivors["step_s"] = med(t["step_s"] for t in ok)
        survivors["uncommitted_median"] = med(t["uncommitted"] for t in ok)
        survivors["uncommitted_max"] = max(t["uncommitted"] for t in ok)
        later = [t["later_gap_s"] for t in ok if t["later_gap_s"] is not None]
        survivors["later_gap_s"] = med(later) if later else None
        back = [t["rejoin"] for t in ok]
        rejoin["recover_s"] = med(r["recover_s"] for r in back)
        rejoin["spread_pct"] = common.spread_pct(r["recover_s"] for r in back)
        rejoin["world_after"] = sorted({r["world_after"] for r in back})
        rejoin["parts_s"] = {
            "import": med(r["startup_s"] for r in back),
            "load": med(r["heal_s"] for r in back),
            "step": med(r["step_s"] for r in back),
        }
        rejoin["digests_match"] = all(r["digests_match"] for r in back)
    return [survivors, rejoin]


def _summarize_overhead(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in trials if "error" not in t]
    row: dict[str, Any] = {"kind": "ft_overhead", "trials": len(trials), "failed": len(trials) - len(ok)}
    if ok:
        row["ddp_ft_step_s"] = common.median(t["ddp_ft_step_s"] for t in ok)
        row["ddp_step_s"] = common.median(t["ddp_step_s"] for t in ok)
        row["extra_step_s"] = common.median(t["ddp_ft_step_s"] - t["ddp_step_s"] for t in ok)
        row["ratio"] = common.median(t["ratio"] for t in ok)
        row["ratio_spread_pct"] = common.spread_pct(t["ratio"] for t in ok)
    return row


def _render(rows: list[dict[str, Any]]) -> str:
    headers = [
        "fault",
        "ok/trials",
        "recover s",
        "spread %",
        "lost (max)",
        "K",
        "world after",
        *PARTS,
        "pause s (gap)",
        "uncommitted",
    ]
    table = []
    for r in rows:
        if "recover_s" not in r:
            table.append([r["kind"], f"0/{r['trials']}", *["-"] * (len(headers) - 2)])
            continue
        parts = r.get("parts_s", {})
        lost = f"{r['lost_median']:g} ({r['lost_max']})" if "lost_median" in r else "-"
        pause = f"{r['pause_s']:.2f} ({r['gap_s']:.2f})" if "pause_s" in r else "-"
        uncommitted = (
            f"{r['uncommitted_median']:g} ({r['uncommitted_max']})" if "uncommitted_median" in r else "-"
        )
        table.append(
            [
                r["kind"],
                f"{r['trials'] - r['failed']}/{r['trials']}",
                f"{r['recover_s']:.2f}",
                f"{r['spread_pct']:.0f}",
                lost,
                r["K"] if r["K"] is not None else "-",
                ",".join(map(str, r["world_after"])),
                *(f"{parts[p]:.2f}" if p in parts else "-" for p in PARTS),
                pause,
                uncommitted,
            ]
        )
    return common.format_table(headers, table)


def _render_overhead(row: dict[str, Any]) -> str:
    headers = [
        "no fault, 2 groups / 2 ranks",
        "ok/trials",
        "ddp_ft ms/step",
        "ddp ms/step",
        "+ms/step",
        "ratio",
        "spread %",
    ]
    if "ratio" not in row:
        cells = ["ft_overhead", f"0/{row['trials']}", "-", "-", "-", "-", "-"]
    else:
        cells = [
            "ft_overhead (ddp_ft vs ddp)",
            f"{row['trials'] - row['failed']}/{row['trials']}",
            f"{row['ddp_ft_step_s'] * 1000:.2f}",
            f"{row['ddp_step_s'] * 1000:.2f}",
            f"{row['extra_step_s'] * 1000:.2f}",
            f"{row['ratio']:.2f}x",
            f"{row['ratio_spread_pct']:.0f}",
        ]
    return common.format_table(headers, [cells])


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
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=None,
        help="repeats of ft_overhead (default 3; 1 with --quick; --trials when given)",
    )
    parser.add_argument("--out", type=Path, default=RESULT_PATH)
    parser.add_argument("--show-output", action="store_true", help="let the agents print (debugging)")
    args = parser.parse_args(argv)
    kinds = common.parse_cases(parser, args.kinds, KINDS)
    trials = args.trials or (1 if args.quick else 5)
    repeats = args.overhead_repeats or args.trials or (1 if args.quick else 3)
    skipped = {}
    if "hang" in kinds and not WATCHDOG.exists():
        skipped["hang"] = f"{WATCHDOG.relative_to(common.REPO_ROOT)} is missing"
        kinds.remove("hang")
    if importlib.util.find_spec("torchft") is None:
        for kind in [k for k in kinds if k in FT_KINDS]:
            skipped[kind] = "torchft is not installed"
            kinds.remove(kind)
    for kind, reason in skipped.items():
        common.log(f"skipping {kind}: {reason}")
    counts = {kind: repeats if kind == "ft_overhead" else trials for kind in kinds}

    started = time.perf_counter()
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for trial in range(max(counts.values(), default=0)):
        for kind in common.rotated(kinds, trial):  # interleaved: machine noise hits every kind alike
            if trial >= counts[kind]:
                continue
            t = time.perf_counter()
            try:
                if kind == "ft":
                    result = run_ft_trial(args.timeout)
                elif kind == "ft_overhead":
                    result = run_overhead_trial(trial, args.timeout, args.show_output)
                else:
                    result = run_trial(kind, args.every, args.watchdog, args.timeout, args.show_output)
            except common.WorkerError as err:
                result = {"error": str(err)}
            common.log(f"trial {trial} {kind}: {result} ({time.perf_counter() - t:.0f} s)")
            samples[kind].append(result)
    rows = _summarize(samples, args.every)
    overhead = _summarize_overhead(samples["ft_overhead"]) if "ft_overhead" in samples else None
    if rows:
        print(_render(rows))
    if overhead is not None:
        print(("\n" if rows else "") + _render_overhead(overhead))
    common.write_json(
        args.out,
        {
            "benchmark": "recovery",
            "config": {
                "kinds": kinds,
                "trials": trials,
                "every": args.every,
                "watchdog_s": args.watchdog,
                "ft": {
                    "steps": FT_STEPS,
                    "args": FT_ARGS,
                    "kill_at": FT_KILL_AT,
                    "restart_after_s": FT_RESTART_AFTER_S,
                    "heartbeat_ms": FT_HEARTBEAT_MS,
                    "join_ms": FT_JOIN_MS,
                },
                "ft_overhead": {"repeats": repeats, "steps": OVERHEAD_STEPS, "skip": OVERHEAD_SKIP},
            },
            "machine": common.machine_info(),
            "versions": common.package_versions(["torch", "torchft", "trainer-core"]),
            "summary": rows,
            "ft_overhead": overhead,
            "samples": samples,
            "skipped": skipped,
            "seconds": round(time.perf_counter() - started, 1),
        },
    )
    common.log(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    failed = [r["kind"] for r in [*rows, *([overhead] if overhead else [])] if r["failed"]]
    too_many = [r["kind"] for r in rows if r["K"] is not None and r.get("lost_max", 0) > r["K"]]
    went_back = [r["kind"] for r in rows if r["K"] is None and r.get("lost_max", 0) > 0]
    if failed:
        common.log(f"trials failed for: {failed}")
    if too_many:
        common.log(f"more than K steps lost for: {too_many}")
    if went_back:
        common.log(f"committed steps lost (ddp_ft must lose none) for: {went_back}")
    return 1 if failed or too_many or went_back else 0


if __name__ == "__main__":
    sys.exit(main())
