"""Two-rank DDP: a plain ``DistributedDataParallel`` loop vs trainer-core vs PyTorch Lightning.

The tiny job of ``overhead.py`` (Linear(32, 32) - ReLU - Linear(32, 1), SGD, MSE), batch 16 per
rank, 1000 steps per rank, on 2 ranks over gloo on 127.0.0.1, each rank on one thread. The
progress bar, logger, checkpointing, model summary and sanity steps are off in both trainers.

Every implementation starts its ranks the same way: the parent starts rank 0 (a fresh
``python benchmarks/ddp.py --worker IMPL``), and rank 0 starts rank 1 by running the same command
again with ``LOCAL_RANK=1``: the ``"ddp"`` launchers of trainer-core and Lightning do it themselves,
the plain loop does it with ``subprocess.Popen`` as its first act after ``import torch``. Each rank
notes, on the machine-wide CLOCK_BOOTTIME, its own process start (from ``/proc/self/stat``), the
end of its imports, the process group being up (the plain loop after ``init_process_group``, the
trainers in the module's ``setup`` hook), and the start of every ``training_step``.

* ``startup s``   a rank's process start -> its first training step (imports, launching the other
                  rank, process group, wrapping, the DataLoader's first batch).
* ``job->step0``  the parent starting rank 0 -> rank 0's first step: what the user waits for.
* ``us/step``     first step -> last step, divided by the steps between them (no startup).
* ``job s``       the parent starting rank 0 -> every rank's process gone.

Implementations are interleaved and rotated across repeats; one untimed short job per
implementation comes first (bytecode and file caches). The table shows medians over repeats;
ratios are paired (median over repeats of impl / plain of the same repeat). The JSON
(``bench_results/ddp.json``) holds every sample. Targets: trainer-core per step <= 1.05x plain
DDP, startup <= 1.10x plain (both ranks, and job start -> first step).

    python benchmarks/ddp.py                  # 5 repeats, 1000 steps (about 4 minutes on 2 cores)
    python benchmarks/ddp.py --quick          # smoke: 1 repeat, 100 steps
    python benchmarks/ddp.py --profile        # one job per implementation, cProfile on each rank
    python benchmarks/ddp.py --worker trainer-core --steps 1000 --result-dir /tmp/r   # one job by hand
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import overhead  # the tiny job, its model, its data and the shared LightningModule

IMPLS = ("plain", "trainer-core", "lightning")
BASELINE = "plain"
TARGET_IMPL = "trainer-core"
TARGET_STEP_RATIO = 1.05
TARGET_STARTUP_RATIO = 1.10
WORLD_SIZE = 2
DEFAULT_STEPS = 1000
DEFAULT_REPEATS = 5
PRIME_STEPS = 20
JOB_TIMEOUT_S = 300.0

# ----------------------------------------------------------------------------- worker side


class StepClock:
    """The boottime of the first and the last ``tick`` (the start of a training step), and how many."""

    __slots__ = ("count", "first", "last")

    def __init__(self) -> None:
        self.first: Optional[float] = None
        self.last = 0.0
        self.count = 0

    def tick(self) -> None:
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        if self.first is None:
            self.first = now
        self.last = now
        self.count += 1


def _job(steps: int) -> overhead.Job:
    return replace(overhead.JOBS["tiny"], steps=steps)


def _dataset_loader(job: overhead.Job) -> Any:
    """The overhead job's loader, with data for every rank: each rank then draws ``job.steps`` batches."""
    return overhead.build_loader(replace(job, steps=job.steps * WORLD_SIZE))


def _run_plain(job: overhead.Job, clock: StepClock, marks: dict[str, float]) -> dict[str, Any]:
    """The loop a user writes by hand around ``DistributedDataParallel``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    marks["imported"] = common.boottime()
    rank = common.local_rank()
    child = None
    if rank == 0:  # what the trainers' "ddp" launchers do: this very command again, as rank 1
        env = {**os.environ, "LOCAL_RANK": "1", "WORLD_SIZE": str(WORLD_SIZE)}
        child = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env=env)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=WORLD_SIZE)
    marks["process_group"] = common.boottime()

    torch.manual_seed(0)
    net = overhead.build_net(job)
    model = DistributedDataParallel(net)
    dataset = _dataset_loader(job).dataset
    # The sampler both trainers put in place of the user's RandomSampler (seed 0, shuffled).
    sampler = DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=job.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=job.lr)
    for x, y in loader:
        clock.tick()
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    marks["fit_returned"] = common.boottime()
    dist.destroy_process_group()
    if child is not None:
        child.wait()
    return {"checksum": sum(float(p.detach().double().sum()) for p in net.parameters())}


def _run_trainer(impl: str, job: overhead.Job, clock: StepClock, marks: dict[str, float]) -> dict[str, Any]:
    """``Trainer(devices=2, ddp).fit(module, loader)`` with the overhead benchmark's module."""
    import torch

    framework = overhead._import_framework(impl)
    marks["imported"] = common.boottime()
    base = overhead.build_module_class(framework.LightningModule)

    class TimedModule(base):  # type: ignore[misc, valid-type]
        def setup(self, stage: str) -> None:
            marks.setdefault("process_group", common.boottime())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            clock.tick()
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    net = overhead.build_net(job)
    module = TimedModule(net, job.lr, False)
    loader = _dataset_loader(job)
    kwargs = overhead._trainer_kwargs(framework.Trainer, job, overhead.MODES["off"], Path.cwd())
    kwargs["devices"] = WORLD_SIZE
    if impl == "trainer-core":
        kwargs["plugins"] = "ddp"
    else:
        kwargs["strategy"] = "ddp"
    trainer = framework.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=loader)
    marks["fit_returned"] = common.boottime()
    if trainer.global_step != job.steps:
        raise RuntimeError(
            f"{impl} ran {trainer.global_step} optimizer steps on this rank, expected {job.steps}"
        )
    return {"checksum": sum(float(p.detach().double().sum()) for p in net.parameters())}


def run_rank(impl: str, steps: int, profile_dir: Optional[str]) -> dict[str, Any]:
    """Worker entry: one rank of one job; the parent or this job's rank 0 started this process."""
    marks = {"process_start": common.process_start_boottime(), "main": common.boottime()}
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    clock = StepClock()
    job = _job(steps)
    if impl == BASELINE:
        result = _run_plain(job, clock, marks)
    elif impl in IMPLS:
        result = _run_trainer(impl, job, clock, marks)
    else:
        raise ValueError(f"--worker {impl!r}: choose from {', '.join(IMPLS)}")
    if profiler is not None:
        profiler.disable()
        common.write_profile(profiler, Path(profile_dir) / f"ddp-{impl}-rank{common.local_rank()}.prof")
    if clock.count != steps or clock.first is None:
        raise RuntimeError(f"{impl} ran {clock.count} training steps on this rank, expected {steps}")
    marks["first_step"], marks["last_step"] = clock.first, clock.last
    return {"marks": marks, "steps": clock.count, **result}


def _worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=IMPLS, required=True)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--profile-dir", default=None)
    args = parser.parse_args(argv)
    common.serve_rank_worker(args.result_dir, lambda: run_rank(args.worker, args.steps, args.profile_dir))
    return 0


# ----------------------------------------------------------------------------- parent side


def _run_job(impl: str, steps: int, args: argparse.Namespace, profile_dir: Optional[Path] = None) -> dict:
    command = [str(Path(__file__).resolve()), "--worker", impl, "--steps", str(steps)]
    if profile_dir is not None:
        command += ["--profile-dir", str(profile_dir)]
    return common.run_rank_job(command, WORLD_SIZE, timeout=JOB_TIMEOUT_S, show_output=args.show_output)


def _sample(impl: str, repeat: int, steps: int, job: dict) -> dict[str, Any]:
    """The numbers of one job: per rank startup and step time, the job's wall time."""
    sample: dict[str, Any] = {"impl": impl, "repeat": repeat, "steps": steps, "job_s": job["job_s"]}
    for rank, res in enumerate(job["ranks"]):
        m = res["marks"]
        sample[f"rank{rank}"] = {
            "startup_s": m["first_step"] - m["process_start"],
            "imports_s": m["imported"] - m["process_start"],
            "to_process_group_s": m["process_group"] - m["process_start"],
            "job_to_first_step_s": m["first_step"] - job["start_boottime"],
            "us_per_step": (m["last_step"] - m["first_step"]) / (res["steps"] - 1) * 1e6,
            "after_last_step_s": job["start_boottime"] + job["job_s"] - m["last_step"],
            "checksum": res["checksum"],
            "marks": m,
        }
    return sample


def _measure(args: argparse.Namespace, impls: list[str]) -> tuple[list[dict], dict[str, str]]:
    samples: list[dict] = []
    failures: dict[str, str] = {}
    common.log("priming (one short untimed job per implementation)")
    for impl in impls:
        try:
            _run_job(impl, PRIME_STEPS, args)
        except common.WorkerError as err:
            failures[impl] = str(err)
            common.log(f"{impl} failed; dropping it from this run:\n{err}")
    for repeat in range(args.repeats):
        for impl in common.rotated(impls, repeat):
            if impl in failures:
                continue
            try:
                job = _run_job(impl, args.steps, args)
            except common.WorkerError as err:
                failures[impl] = str(err)
                common.log(f"{impl} failed; dropping it from this run:\n{err}")
                continue
            sample = _sample(impl, repeat, args.steps, job)
            samples.append(sample)
            r0, r1 = sample["rank0"], sample["rank1"]
            common.log(
                f"[{repeat + 1}/{args.repeats}] {impl:<12} job {sample['job_s']:6.2f} s  startup "
                f"{r0['startup_s']:5.2f}/{r1['startup_s']:5.2f} s  step "
                f"{r0['us_per_step']:6.1f}/{r1['us_per_step']:6.1f} us (rank 0/1)"
            )
    return samples, failures


# (name in the summary, how to read it from a sample)
METRICS = {
    "job_s": lambda s: s["job_s"],
    "job_to_first_step_s": lambda s: s["rank0"]["job_to_first_step_s"],
    "startup_rank0_s": lambda s: s["rank0"]["startup_s"],
    "startup_rank1_s": lambda s: s["rank1"]["startup_s"],
    "imports_rank0_s": lambda s: s["rank0"]["imports_s"],
    "to_process_group_rank0_s": lambda s: s["rank0"]["to_process_group_s"],
    "us_per_step_rank0": lambda s: s["rank0"]["us_per_step"],
    "us_per_step_rank1": lambda s: s["rank1"]["us_per_step"],
    "after_last_step_s": lambda s: max(s["rank0"]["after_last_step_s"], s["rank1"]["after_last_step_s"]),
}


def _summarize(samples: list[dict], impls: list[str]) -> list[dict]:
    base = {s["repeat"]: s for s in samples if s["impl"] == BASELINE}
    base_checksum = next(iter(base.values()))["rank0"]["checksum"] if base else None
    rows = []
    for impl in impls:
        mine = [s for s in samples if s["impl"] == impl]
        if not mine:
            continue
        paired = [(s, base[s["repeat"]]) for s in mine if s["repeat"] in base]
        row: dict[str, Any] = {"impl": impl, "repeats": len(mine)}
        for name, read in METRICS.items():
            row[name] = common.median(read(s) for s in mine)
            row[f"{name}_ratio"] = common.median(read(s) / read(b) for s, b in paired) if paired else None
        row["step_spread_pct"] = common.spread_pct(s["rank0"]["us_per_step"] for s in mine)
        checksum = mine[0]["rank0"]["checksum"]
        row["same_result_as_plain"] = (
            None
            if base_checksum is None
            else abs(checksum - base_checksum) <= 1e-5 * max(1.0, abs(base_checksum))
        )
        rows.append(row)
    return rows


def _print_table(rows: list[dict]) -> None:
    def ratio(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}x"

    columns = [
        ("us/step r0", "us_per_step_rank0", "{:.1f}"),
        ("us/step r1", "us_per_step_rank1", "{:.1f}"),
        ("startup r0 s", "startup_rank0_s", "{:.2f}"),
        ("startup r1 s", "startup_rank1_s", "{:.2f}"),
        ("job->step0 s", "job_to_first_step_s", "{:.2f}"),
        ("job s", "job_s", "{:.2f}"),
    ]
    headers = ["impl"] + [h for col in columns for h in (col[0], "x plain")]
    table = []
    for r in rows:
        cells = [r["impl"]]
        for _, key, fmt in columns:
            cells += [fmt.format(r[key]), ratio(r[f"{key}_ratio"])]
        table.append(cells)
    print(common.format_table(headers, table))
    detail = [
        (
            r["impl"],
            f"{r['imports_rank0_s']:.2f}",
            f"{r['to_process_group_rank0_s']:.2f}",
            f"{r['startup_rank0_s'] - r['to_process_group_rank0_s']:.2f}",
            f"{r['after_last_step_s']:.2f}",
            f"{r['step_spread_pct']:.0f}%",
        )
        for r in rows
    ]
    print()
    print("rank 0 startup, split (medians): imports | start -> process group up | then -> first step")
    print(
        common.format_table(
            ("impl", "imports s", "->group s", "->step0 s", "last step->job end s", "step spread"), detail
        )
    )
    for r in rows:
        if r["same_result_as_plain"] is False:
            print(f"WARNING: {r['impl']} ends with other weights than the plain DDP loop")


def _target(rows: list[dict], failures: dict[str, str], skipped: dict[str, str]) -> dict[str, Any]:
    row = next((r for r in rows if r["impl"] == TARGET_IMPL), None)
    if row is None or row["us_per_step_rank0_ratio"] is None:
        return {
            "met": False,
            "not_measured": failures.get(TARGET_IMPL) or skipped.get(TARGET_IMPL) or "no plain run",
        }
    checks = {
        "us_per_step_rank0": (row["us_per_step_rank0_ratio"], TARGET_STEP_RATIO),
        "us_per_step_rank1": (row["us_per_step_rank1_ratio"], TARGET_STEP_RATIO),
        "startup_rank0_s": (row["startup_rank0_s_ratio"], TARGET_STARTUP_RATIO),
        "startup_rank1_s": (row["startup_rank1_s_ratio"], TARGET_STARTUP_RATIO),
        "job_to_first_step_s": (row["job_to_first_step_s_ratio"], TARGET_STARTUP_RATIO),
    }
    return {
        "impl": TARGET_IMPL,
        "checks": {k: {"ratio": v, "max": m, "ok": v <= m} for k, (v, m) in checks.items()},
        "met": all(v <= m for v, m in checks.values()),
    }


def _print_target(target: dict[str, Any]) -> None:
    if "checks" not in target:
        print(f"target: not measured ({target['not_measured']})")
        return
    parts = [
        f"{name} {c['ratio']:.2f}x (<= {c['max']:.2f}) {'ok' if c['ok'] else 'OVER'}"
        for name, c in target["checks"].items()
    ]
    print(
        f"target ({target['impl']} vs plain DDP): "
        + ", ".join(parts)
        + f" -> {'MET' if target['met'] else 'MISSED'}"
    )


def _profile(args: argparse.Namespace, impls: list[str]) -> None:
    out_dir = Path(args.out).parent / "profile"
    for impl in impls:
        _run_job(impl, PRIME_STEPS, args)
        _run_job(impl, args.steps, args, profile_dir=out_dir)
        for rank in range(WORLD_SIZE):
            txt = out_dir / f"ddp-{impl}-rank{rank}.txt"
            lines = txt.read_text().splitlines()
            start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
            print(f"== {impl} rank {rank}: {txt} (top by own time)")
            print("\n".join(lines[start : start + 14]))


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"jobs per implementation (default {DEFAULT_REPEATS})"
    )
    parser.add_argument("--steps", type=int, default=None, help=f"steps per rank (default {DEFAULT_STEPS})")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 100 steps")
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ", ".join(IMPLS)
    )
    parser.add_argument(
        "--profile", action="store_true", help="one job per implementation under cProfile, per rank"
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    parser.add_argument("--show-output", action="store_true", help="let the ranks print")
    parser.add_argument("--out", default=str(common.RESULTS_DIR / "ddp.json"), help="where the JSON goes")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    if args.steps is None:
        args.steps = 100 if args.quick else DEFAULT_STEPS
    args.impls = [c.strip() for c in args.impls.split(",") if c.strip()]
    unknown = [c for c in args.impls if c not in IMPLS]
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPLS)}")
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be positive and --steps at least 2")
    return args


def main(argv: Sequence[str]) -> int:
    if "--worker" in argv:
        return _worker_main(argv)
    args = _parse_args(argv)
    impls, skipped = overhead._available_impls(args.impls)
    for impl, reason in skipped.items():
        common.log(f"skipping {impl}: not importable ({reason})")
    if args.profile:
        _profile(args, impls)
        return 0

    started = time.time()
    samples, failures = _measure(args, impls)
    rows = _summarize(samples, impls)
    _print_table(rows)
    target = _target(rows, failures, skipped)
    _print_target(target)
    for impl, error in failures.items():
        print(f"{impl} failed: {error.strip().splitlines()[-1]}")
    payload = {
        "benchmark": "ddp",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "config": {
            "repeats": args.repeats,
            "steps_per_rank": args.steps,
            "world_size": WORLD_SIZE,
            "backend": "gloo",
            "job": asdict(_job(args.steps)),
            "impls": impls,
        },
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "pytorch-lightning", "lightning", "trainer-core"]),
        "skipped": skipped,
        "failures": failures,
        "summary": rows,
        "target": target,
        "samples": samples,
    }
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path}")
    return 1 if args.check and not target["met"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
