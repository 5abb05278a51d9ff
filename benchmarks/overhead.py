"""Per-step overhead: a plain PyTorch loop vs trainer-core vs PyTorch Lightning, side by side.

Two jobs, both on one CPU thread with a ``DataLoader`` over a random ``TensorDataset``, MSE loss
and SGD:

* ``tiny``   Linear(32, 32) - ReLU - Linear(32, 1), batch 16, 2000 steps: the step is almost all
             framework, so this is where per-step overhead shows.
* ``medium`` 4 x Linear(1024, 1024) (ReLU between), batch 64, 200 steps: the step is almost all
             matmul, so overhead should vanish here.

Four modes, each changing one thing from ``off``:

* ``off``  progress bar off, logger off.
* ``bar``  the default progress bar on (the plain loop wraps its loader in ``tqdm``).
* ``log``  ``self.log("loss", loss)`` on every step with the default logger and the default
           ``log_every_n_steps`` (the plain loop writes ``loss.item()`` to a CSV file every 50 steps).
* ``simple`` ``Trainer(profiler="simple")``, the per-hook time table printed at the end (the plain
           loop runs as in ``off``). A second table puts each trainer's cost of profiling beside the
           other's: its ``simple`` run over its own ``off`` run of the same repeat.
* ``watchdog`` trainer-core with ``HangWatchdog()`` (a beat in six hooks per step, a thread that
           looks once a second); ``stragglers`` with ``StragglerMonitor()`` (one process: it takes
           its hooks out of the loop). Lightning has neither and sits these out; the second table
           shows their cost over trainer-core's own ``off`` run.

trainer-core and Lightning train the *same* ``LightningModule`` source (``build_module_class``
takes the framework's base class, so the import is the only difference) with checkpointing,
validation and sanity steps off. Every measurement runs in a fresh process with stdout/stderr on
``os.devnull`` (so progress bars cost the same for everyone); the implementations are interleaved
and rotated across repeats so that noise on a shared machine hits all of them alike. One untimed
short run per implementation and mode comes first (workers cache bytecode under
``bench_results/pycache`` even when PYTHONDONTWRITEBYTECODE is set, so an editable install is not
recompiled inside the timing). Each process warms torch up on a throwaway model, then times:

* ``run ms``       everything the user waits for: ``Trainer(...)`` + ``fit()`` (plain: optimizer,
                   bar and log file creation, the loop, closing them).
* ``loop us/step`` ``on_train_start`` -> ``on_train_end`` divided by the steps (plain: the loop).
* ``fixed ms``     run minus loop: construction, setup and teardown, paid once per run.
* ``cpu x plain``  the run's CPU time (``time.process_time``, all the worker's threads) over the plain
                   loop's: on a machine shared with other jobs, wall time also counts the waits for a
                   core, and this ratio is the steadier one.

The table shows medians, and ratios to the plain loop in the same mode and the same repeat
(median of the paired ratios, robust to a shared machine's drift); the JSON
(``bench_results/overhead.json``) holds every sample. Target: trainer-core <= 1.10x the plain loop
in all three modes on the tiny job.

    python benchmarks/overhead.py                 # 5 repeats, both jobs (about 10 minutes on 2 slow cores)
    python benchmarks/overhead.py --quick         # smoke: 1 repeat, 200 / 10 steps
    python benchmarks/overhead.py --profile --jobs tiny --impls trainer-core
    python benchmarks/overhead.py --quick --jobs tiny --modes off,simple   # the profiler's cost only
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

# ----------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Job:
    name: str
    widths: tuple[int, ...]  # layer sizes, input first: (32, 32, 1) is Linear(32,32)-ReLU-Linear(32,1)
    batch_size: int
    steps: int
    lr: float = 0.01


@dataclass(frozen=True)
class Mode:
    name: str
    progress_bar: bool
    logger: bool
    log_loss: bool
    profiler: str | None = None  # Trainer(profiler=...); the plain loop ignores it
    callbacks: tuple[
        str, ...
    ] = ()  # trainer-core's own callbacks, by class name; Lightning sits the mode out


JOBS = {
    "tiny": Job("tiny", (32, 32, 1), batch_size=16, steps=2000),
    "medium": Job("medium", (1024, 1024, 1024, 1024, 1024), batch_size=64, steps=200),
}
MODES = {
    "off": Mode("off", progress_bar=False, logger=False, log_loss=False),
    "bar": Mode("bar", progress_bar=True, logger=False, log_loss=False),
    "log": Mode("log", progress_bar=False, logger=True, log_loss=True),
    "simple": Mode("simple", progress_bar=False, logger=False, log_loss=False, profiler="simple"),
    "watchdog": Mode(
        "watchdog", progress_bar=False, logger=False, log_loss=False, callbacks=("HangWatchdog",)
    ),
    "stragglers": Mode(
        "stragglers", progress_bar=False, logger=False, log_loss=False, callbacks=("StragglerMonitor",)
    ),
}
# The modes the overhead target applies to; profiling is meant to cost something, and is reported apart.
TARGET_MODES = ("off", "bar", "log")
PROFILER_BASE_MODE = "off"
IMPLS = ("plain", "trainer-core", "lightning")
BASELINE = "plain"
TARGET_IMPL, TARGET_JOB, TARGET_RATIO = "trainer-core", "tiny", 1.10

LOG_EVERY_N_STEPS = 50  # Lightning's default, mirrored by the plain loop's CSV writes
WARMUP_STEPS = 20
PRIME_STEPS = 20
DEFAULT_REPEATS = 5

# ----------------------------------------------------------------------------- the shared model


def build_net(job: Job) -> Any:
    import torch

    layers: list[Any] = []
    for i, (n_in, n_out) in enumerate(zip(job.widths[:-1], job.widths[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(n_in, n_out))
    return torch.nn.Sequential(*layers)


def build_loader(job: Job) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n = job.batch_size * job.steps  # one epoch is exactly the job
    dataset = TensorDataset(torch.randn(n, job.widths[0]), torch.randn(n, job.widths[-1]))
    return DataLoader(
        dataset, batch_size=job.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1)
    )


def build_module_class(base: type) -> type:
    """The one LightningModule both trainers run; ``base`` is the framework's ``LightningModule``."""
    import torch
    import torch.nn.functional as F

    class OverheadModule(base):  # type: ignore[misc, valid-type]
        def __init__(self, net: torch.nn.Module, lr: float, log_loss: bool) -> None:
            super().__init__()
            self.net = net
            self.lr = lr
            self.log_loss = log_loss
            self.train_start_ns = 0
            self.train_end_ns = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            if self.log_loss:
                self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr)

        def on_train_start(self) -> None:
            self.train_start_ns = time.perf_counter_ns()

        def on_train_end(self) -> None:
            self.train_end_ns = time.perf_counter_ns()

    return OverheadModule


# ----------------------------------------------------------------------------- worker side


def _import_framework(impl: str) -> Any:
    """The module that provides ``Trainer`` and ``LightningModule`` for ``impl``."""
    if impl == "trainer-core":
        import trainer_core

        return trainer_core
    if impl == "lightning":
        try:
            import lightning.pytorch as framework
        except ImportError:  # the `bench` extra installs the standalone pytorch-lightning package
            import pytorch_lightning as framework
        return framework
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def _warm_up(job: Job) -> None:
    """First-call costs of torch (kernels, allocator, autograd engine, DataLoader) on a throwaway model."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(1234)
    net = build_net(job)
    optimizer = torch.optim.SGD(net.parameters(), lr=job.lr)
    n = job.batch_size * WARMUP_STEPS
    loader = DataLoader(
        TensorDataset(torch.randn(n, job.widths[0]), torch.randn(n, job.widths[-1])), job.batch_size
    )
    for x, y in loader:
        loss = F.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()


def _run_plain(net: Any, loader: Any, job: Job, mode: Mode, out_dir: Path) -> tuple[int, int]:
    """The loop a user writes by hand; returns (run_ns, loop_ns)."""
    import csv

    import torch
    import torch.nn.functional as F

    run_start = time.perf_counter_ns()
    optimizer = torch.optim.SGD(net.parameters(), lr=job.lr)
    net.train()
    batches = loader
    if mode.progress_bar:
        from tqdm import tqdm

        batches = tqdm(loader)
    log_file = writer = None
    if mode.logger:
        log_file = open(out_dir / "metrics.csv", "w", newline="")  # closed inside the timed region
        writer = csv.writer(log_file)
        writer.writerow(["step", "loss"])
    loop_start = time.perf_counter_ns()
    for step, (x, y) in enumerate(batches):
        loss = F.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if writer is not None and (step + 1) % LOG_EVERY_N_STEPS == 0:
            writer.writerow([step, loss.item()])
    loop_end = time.perf_counter_ns()
    if mode.progress_bar:
        batches.close()
    if log_file is not None:
        log_file.close()
    run_end = time.perf_counter_ns()
    return run_end - run_start, loop_end - loop_start


def _trainer_kwargs(trainer_cls: type, job: Job, mode: Mode, out_dir: Path) -> dict[str, Any]:
    """The same arguments for both trainers: those docs/architecture.md lists for trainer-core, plus
    ``enable_model_summary=False`` wherever the Trainer takes it (the summary is not the loop)."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "max_steps": job.steps,
        "enable_checkpointing": False,
        "enable_progress_bar": mode.progress_bar,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(out_dir),
    }
    if not mode.logger:
        kwargs["logger"] = False
    if mode.profiler is not None:
        kwargs["profiler"] = mode.profiler
    if mode.callbacks:
        import trainer_core.callbacks as callbacks

        kwargs["callbacks"] = [getattr(callbacks, name)() for name in mode.callbacks]
    if "enable_model_summary" in inspect.signature(trainer_cls).parameters:
        kwargs["enable_model_summary"] = False
    return kwargs


def _run_trainer(
    framework: Any, impl: str, net: Any, loader: Any, job: Job, mode: Mode, out_dir: Path
) -> tuple[int, int]:
    """``Trainer(...).fit(module, loader)``; returns (run_ns, loop_ns)."""
    module = build_module_class(framework.LightningModule)(net, job.lr, mode.log_loss)
    kwargs = _trainer_kwargs(framework.Trainer, job, mode, out_dir)
    run_start = time.perf_counter_ns()
    trainer = framework.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=loader)
    run_end = time.perf_counter_ns()
    if trainer.global_step != job.steps:
        raise RuntimeError(f"{impl} ran {trainer.global_step} optimizer steps, expected {job.steps}")
    if not module.train_end_ns:
        raise RuntimeError(f"{impl} never called on_train_end")
    return run_end - run_start, module.train_end_ns - module.train_start_ns


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Worker entry: one measurement of one (job, mode, implementation) in this fresh process."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    common.pin_to_cpu(spec.get("cpu"))
    job = replace(JOBS[spec["job"]], steps=spec["steps"])
    mode = MODES[spec["mode"]]
    impl = spec["impl"]

    import_start = time.perf_counter()
    framework = None if impl == BASELINE else _import_framework(impl)
    import_s = time.perf_counter() - import_start

    _warm_up(job)
    torch.manual_seed(0)
    net = build_net(job)
    loader = build_loader(job)
    gc.collect()

    profiler = None
    if spec.get("profile_path"):
        import cProfile

        profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        if profiler is not None:
            profiler.enable()
        cpu_start = time.process_time_ns()
        if framework is None:
            run_ns, loop_ns = _run_plain(net, loader, job, mode, Path(tmp))
        else:
            run_ns, loop_ns = _run_trainer(framework, impl, net, loader, job, mode, Path(tmp))
        cpu_ns = time.process_time_ns() - cpu_start
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        _write_profile(profiler, Path(spec["profile_path"]))

    checksum = sum(float(p.detach().double().sum()) for p in net.parameters())
    return {
        "run_ns": run_ns,
        "loop_ns": loop_ns,
        "cpu_ns": cpu_ns,
        "import_s": import_s,
        "checksum": checksum,
    }


def _write_profile(profiler: Any, path: Path) -> None:
    import io
    import pstats

    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(path))
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    path.with_suffix(".txt").write_text(text.getvalue())


# ----------------------------------------------------------------------------- parent side


def _available_impls(wanted: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    probes = {
        "trainer-core": "from trainer_core import Trainer, LightningModule",
        "lightning": "try:\n import lightning.pytorch\nexcept ImportError:\n import pytorch_lightning",
    }
    available, skipped = [], {}
    for impl in wanted:
        reason = common.probe_import(probes[impl]) if impl in probes else None
        if reason is None:
            available.append(impl)
        else:
            skipped[impl] = reason
    return available, skipped


def _runs_in(impl: str, mode: Mode) -> bool:
    """Lightning has no callbacks of these kinds: it sits out the modes that add trainer-core's own."""
    return not (mode.callbacks and impl == "lightning")


def _prime(args: argparse.Namespace, impls: list[str], modes: list[Mode], failures: dict[str, str]) -> None:
    """One short untimed run per (implementation, mode): fills the bytecode and file-system caches,
    so that no implementation pays a first-ever compile of its lazily imported modules in a sample."""
    for mode in modes:
        for impl in impls:
            if impl in failures or not _runs_in(impl, mode):
                continue
            spec = {"job": "tiny", "steps": PRIME_STEPS, "mode": mode.name, "impl": impl, "cpu": args.pin_cpu}
            try:
                common.run_worker(__file__, spec, show_output=args.show_output)
            except common.WorkerError as err:
                failures[impl] = str(err)
                common.log(f"{impl} failed; dropping it from this run:\n{err}")


def _measure(
    args: argparse.Namespace, impls: list[str], jobs: list[Job], modes: list[Mode]
) -> tuple[list[dict], dict]:
    samples: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    common.log("priming (one short untimed run per implementation and mode)")
    _prime(args, impls, modes, failures)
    for repeat in range(args.repeats):
        for job in jobs:
            for mode in modes:
                for impl in common.rotated(impls, repeat):
                    if impl in failures or not _runs_in(impl, mode):
                        continue
                    spec = {
                        "job": job.name,
                        "steps": job.steps,
                        "mode": mode.name,
                        "impl": impl,
                        "cpu": args.pin_cpu,
                    }
                    try:
                        result = common.run_worker(__file__, spec, show_output=args.show_output)
                    except common.WorkerError as err:
                        failures[impl] = str(err)
                        common.log(f"{impl} failed; dropping it from this run:\n{err}")
                        continue
                    sample = {**spec, "repeat": repeat, **result}
                    sample["run_ms"] = result["run_ns"] / 1e6
                    sample["cpu_ms"] = result["cpu_ns"] / 1e6
                    sample["loop_us_per_step"] = result["loop_ns"] / 1e3 / job.steps
                    samples.append(sample)
                    common.log(
                        f"[{repeat + 1}/{args.repeats}] {job.name:<6} {mode.name:<3} {impl:<12} "
                        f"{sample['run_ms']:9.1f} ms  {sample['loop_us_per_step']:9.1f} us/step"
                    )
    return samples, failures


def _summarize(samples: list[dict], impls: list[str], jobs: list[Job], modes: list[Mode]) -> list[dict]:
    """Medians per cell; ratios are *paired*: the median over repeats of impl / plain measured in
    the same repeat (minutes apart at most), which cancels most of a shared machine's slow drift."""
    rows = []
    for job in jobs:
        for mode in modes:
            group = [s for s in samples if s["job"] == job.name and s["mode"] == mode.name]
            base = {s["repeat"]: s for s in group if s["impl"] == BASELINE}
            base_checksum = next(iter(base.values()))["checksum"] if base else None
            for impl in impls:
                mine = [s for s in group if s["impl"] == impl]
                if not mine:
                    continue
                paired = [(s, base[s["repeat"]]) for s in mine if s["repeat"] in base]
                checksum = mine[0]["checksum"]
                rows.append(
                    {
                        "job": job.name,
                        "mode": mode.name,
                        "impl": impl,
                        "repeats": len(mine),
                        "run_ms": common.median(s["run_ms"] for s in mine),
                        "run_ratio": common.median(s["run_ms"] / b["run_ms"] for s, b in paired)
                        if paired
                        else None,
                        "cpu_ratio": common.median(s["cpu_ms"] / b["cpu_ms"] for s, b in paired)
                        if paired
                        else None,
                        "fixed_ms": common.median(s["run_ms"] - s["loop_ns"] / 1e6 for s in mine),
                        "loop_us_per_step": common.median(s["loop_us_per_step"] for s in mine),
                        "step_ratio": common.median(
                            s["loop_us_per_step"] / b["loop_us_per_step"] for s, b in paired
                        )
                        if paired
                        else None,
                        "run_spread_pct": common.spread_pct(s["run_ms"] for s in mine),
                        "same_result_as_plain": (
                            None
                            if base_checksum is None
                            else abs(checksum - base_checksum) <= 1e-6 * max(1.0, abs(base_checksum))
                        ),
                    }
                )
    return rows


def _print_table(rows: list[dict]) -> None:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    table = [
        (
            r["job"],
            r["mode"],
            r["impl"],
            f"{r['run_ms']:.1f}",
            ratio(r["run_ratio"]),
            ratio(r["cpu_ratio"]),
            f"{r['loop_us_per_step']:.1f}",
            ratio(r["step_ratio"]),
            f"{r['fixed_ms']:.1f}",
            f"{r['run_spread_pct']:.0f}%",
        )
        for r in rows
    ]
    headers = (
        "job",
        "mode",
        "impl",
        "run ms",
        "x plain",
        "cpu x plain",
        "loop us/step",
        "x plain",
        "fixed ms",
        "spread",
    )
    print(common.format_table(headers, table))
    for r in rows:
        if r["same_result_as_plain"] is False:
            print(
                f"WARNING: {r['impl']} ({r['job']}/{r['mode']}) ends with other weights than the plain loop"
            )


def _target(rows: list[dict], modes: list[Mode], skipped: dict[str, str], failures: dict[str, str]) -> dict:
    """trainer-core's whole-run ratio to the plain loop on the tiny job, per mode."""
    why_not = skipped.get(TARGET_IMPL) or failures.get(TARGET_IMPL)
    ratios = {
        r["mode"]: r["run_ratio"]
        for r in rows
        if r["impl"] == TARGET_IMPL
        and r["job"] == TARGET_JOB
        and r["run_ratio"] is not None
        and r["mode"] in TARGET_MODES
    }
    wanted = [m for m in modes if m.name in TARGET_MODES]
    met = bool(ratios) and len(ratios) == len(wanted) and all(v <= TARGET_RATIO for v in ratios.values())
    return {
        "impl": TARGET_IMPL,
        "job": TARGET_JOB,
        "max_ratio": TARGET_RATIO,
        "ratios": ratios,
        "met": met,
        "not_measured": why_not,
    }


def _profiler_cost(samples: list[dict], impls: list[str], jobs: list[Job]) -> list[dict]:
    """Each trainer's profiled (or watched) runs over its own plain runs, paired by repeat (medians of the ratios)."""
    rows = []
    profiled_modes = [m for m in MODES.values() if m.profiler is not None or m.callbacks]
    for job in jobs:
        for mode in profiled_modes:
            for impl in impls:
                if impl == BASELINE:
                    continue
                mine = [s for s in samples if s["job"] == job.name and s["impl"] == impl]
                base = {s["repeat"]: s for s in mine if s["mode"] == PROFILER_BASE_MODE}
                paired = [
                    (s, base[s["repeat"]]) for s in mine if s["mode"] == mode.name and s["repeat"] in base
                ]
                if not paired:
                    continue
                rows.append(
                    {
                        "job": job.name,
                        "mode": mode.name,
                        "impl": impl,
                        "repeats": len(paired),
                        "run_ms": common.median(s["run_ms"] for s, _ in paired),
                        "run_ratio": common.median(s["run_ms"] / b["run_ms"] for s, b in paired),
                        "loop_us_per_step": common.median(s["loop_us_per_step"] for s, _ in paired),
                        "step_ratio": common.median(
                            s["loop_us_per_step"] / b["loop_us_per_step"] for s, b in paired
                        ),
                        "added_us_per_step": common.median(
                            s["loop_us_per_step"] - b["loop_us_per_step"] for s, b in paired
                        ),
                    }
                )
    return rows


def _print_profiler_cost(rows: list[dict]) -> None:
    if not rows:
        return
    table = [
        (
            r["job"],
            r["mode"] if r["mode"] in ("watchdog", "stragglers") else f'profiler="{r["mode"]}"',
            r["impl"],
            f"{r['run_ms']:.1f}",
            f"{r['run_ratio']:.2f}x",
            f"{r['loop_us_per_step']:.1f}",
            f"{r['step_ratio']:.2f}x",
            f"{r['added_us_per_step']:+.1f}",
        )
        for r in rows
    ]
    headers = (
        "job",
        "mode",
        "impl",
        "run ms",
        f"x own {PROFILER_BASE_MODE}",
        "loop us/step",
        "x own",
        "+us/step",
    )
    print(
        f"cost of profiling and of the watchdogs (each trainer against its own `{PROFILER_BASE_MODE}` run, same repeat):"
    )
    print(common.format_table(headers, table))


def _print_target(target: dict) -> None:
    head = f"target: {target['impl']} <= {target['max_ratio']:.2f}x the plain loop ({target['job']} job, whole run)"
    if not target["ratios"]:
        print(f"{head}: not measured ({target['not_measured'] or 'job or implementation not selected'})")
        return
    parts = [
        f"{mode} {ratio:.2f}x {'ok' if ratio <= target['max_ratio'] else 'OVER'}"
        for mode, ratio in target["ratios"].items()
    ]
    print(f"{head}: {', '.join(parts)} -> {'MET' if target['met'] else 'MISSED'}")


def _profile(args: argparse.Namespace, impls: list[str], jobs: list[Job], modes: list[Mode]) -> None:
    out_dir = Path(args.out).parent / "profile"
    _prime(args, impls, modes, {})
    for job in jobs:
        for mode in modes:
            for impl in impls:
                path = out_dir / f"{job.name}-{mode.name}-{impl}.prof"
                spec = {
                    "job": job.name,
                    "steps": job.steps,
                    "mode": mode.name,
                    "impl": impl,
                    "cpu": args.pin_cpu,
                    "profile_path": str(path),
                }
                common.run_worker(__file__, spec, show_output=args.show_output)
                top = path.with_suffix(".txt").read_text().splitlines()
                print(f"== {job.name}/{mode.name}/{impl}: {path} (top by own time)")
                start = next((i for i, line in enumerate(top) if "ncalls" in line), 0)
                print("\n".join(top[start : start + 16]))


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"fresh-process repeats per cell (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"steps of the tiny job (default {JOBS['tiny'].steps})"
    )
    parser.add_argument(
        "--medium-steps",
        type=int,
        default=None,
        help=f"steps of the medium job (default {JOBS['medium'].steps})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat, 200 tiny and 10 medium steps"
    )
    parser.add_argument(
        "--jobs", default=",".join(JOBS), help="comma-separated subset of: " + ", ".join(JOBS)
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES)
    )
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ", ".join(IMPLS)
    )
    parser.add_argument("--pin-cpu", type=int, default=None, help="pin every worker to this core")
    parser.add_argument(
        "--profile", action="store_true", help="run each cell once under cProfile instead of timing"
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 when the target is missed")
    parser.add_argument(
        "--show-output", action="store_true", help="let workers print (progress bars included)"
    )
    parser.add_argument(
        "--out", default=str(common.RESULTS_DIR / "overhead.json"), help="where the JSON goes"
    )
    args = parser.parse_args(argv)
    quick = {"repeats": 1, "steps": 200, "medium_steps": 10} if args.quick else {}
    defaults = {"repeats": DEFAULT_REPEATS, "steps": JOBS["tiny"].steps, "medium_steps": JOBS["medium"].steps}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick.get(name, default))
    for flag, choices in (("jobs", JOBS), ("modes", MODES), ("impls", IMPLS)):
        chosen = [c.strip() for c in getattr(args, flag).split(",") if c.strip()]
        unknown = [c for c in chosen if c not in choices]
        if unknown:
            parser.error(f"--{flag}: unknown {unknown}; choose from {', '.join(choices)}")
        setattr(args, flag, chosen)
    if args.repeats < 1 or args.steps < 1 or args.medium_steps < 1:
        parser.error("--repeats, --steps and --medium-steps must be positive")
    return args


def main(argv: Sequence[str]) -> int:
    if "--worker" in argv:
        common.serve_worker(argv, run_one)
        return 0
    args = _parse_args(argv)
    steps = {"tiny": args.steps, "medium": args.medium_steps}
    jobs = [replace(JOBS[name], steps=steps[name]) for name in args.jobs]
    modes = [MODES[name] for name in args.modes]
    impls, skipped = _available_impls(args.impls)
    for impl, reason in skipped.items():
        common.log(f"skipping {impl}: not importable ({reason})")

    if args.profile:
        _profile(args, impls, jobs, modes)
        return 0

    started = time.time()
    samples, failures = _measure(args, impls, jobs, modes)
    rows = _summarize(samples, impls, jobs, modes)
    _print_table(rows)
    profiler_rows = _profiler_cost(samples, impls, jobs)
    _print_profiler_cost(profiler_rows)
    target = _target(rows, modes, skipped, failures)
    _print_target(target)
    for impl, error in failures.items():
        print(f"{impl} failed: {error.strip().splitlines()[-1]}")

    payload = {
        "benchmark": "overhead",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "config": {
            "repeats": args.repeats,
            "jobs": [asdict(job) for job in jobs],
            "modes": [asdict(mode) for mode in modes],
            "impls": impls,
            "pin_cpu": args.pin_cpu,
            "log_every_n_steps": LOG_EVERY_N_STEPS,
            "warmup_steps": WARMUP_STEPS,
        },
        "machine": common.machine_info(),
        "versions": common.package_versions(
            ["torch", "pytorch-lightning", "lightning", "trainer-core", "tqdm"]
        ),
        "skipped": skipped,
        "failures": failures,
        "summary": rows,
        "profiler_cost": profiler_rows,
        "target": target,
        "samples": samples,
    }
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path}")
    if args.check and not target["met"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
