"""Mixed precision's step time under every plugin: bf16-mixed and 16-mixed against 32-true, beside a plain loop.

The question: does ``Trainer(precision="bf16-mixed")`` cost anything beyond the ``torch.autocast`` it
puts around the forward? On this CPU (no bf16 or fp16 hardware) autocast itself makes a step many
times slower, so a step's bf16/fp32 ratio says nothing alone; the plain loop's ratio next to it does.

The model is an MLP, ``Linear(256, 512) - ReLU - Linear(512, 256) - ReLU - Linear(256, 512) - ReLU -
Linear(512, 256)``, on an MSE loss with SGD, batch 32, the same fixed batches for everyone (no
shuffling), one thread per process:

* ``single_device`` (1 process), ``ddp``, ``ddp_sharded``, ``zero``, ``fsdp`` (the root sharded),
  ``pipeline`` (2 stages cut before ``layers.2``, 1F1B, 4 micro-batches) and ``model_parallel``
  (tensor parallel 2: ``layers.0``/``layers.2`` column-wise, ``layers.1``/``layers.3`` row-wise),
  2 ranks over gloo on 127.0.0.1, each under ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"``;
* ``plain``: the loop a user writes by hand, one process: the same network, data and optimizer;
  fp32 runs no context at all, bf16 runs the forward and loss under ``torch.autocast("cpu",
  dtype=torch.bfloat16)``, fp16 under ``torch.autocast("cpu", dtype=torch.float16)`` with torch's
  ``GradScaler`` (``scale(loss).backward()``, ``step``, ``update``);
* ``plain_ddp``: the same around ``DistributedDataParallel`` at 2 ranks (``DistributedSampler``
  without shuffling, as the Trainer puts in).

**Two jobs, everything interleaved inside them.** On 2 cores shared with other work, a 2-rank job
spends 8 to 20 s importing torch twice before its first step, and the machine's load drifts by
tens of percent between jobs; timing each case in a fresh job made the comparisons as noisy as
the cases were long. So every case runs ``--repeats`` times as one ``fit`` (or one plain loop)
inside one of two long-lived jobs: ``single`` (1 process: ``plain``, ``single_device``) and
``multi`` (2 ranks started as ``torchrun`` would, one process group for the job: ``plain_ddp`` and
every 2-rank plugin). Each repeat runs every case of the job once, rotated, a baseline next to its
plugin; a ratio pairs the two runs of the same repeat (seconds apart), median over repeats. Each
run builds its module, optimizer, loader and ``Trainer`` afresh (seed 0); a short untimed loop in
every precision warms each process's kernels first.

Each rank notes the start of every training step (the Trainer: a callback's
``on_train_batch_start``; the plain loop: the top of its loop body). ``ms`` is the median time
between the starts of two steps after ``--warmup`` steps, on rank 0, then the median over repeats;
``cpu`` ratios use rank 0's process CPU time per step over the same window, which leaves out
waiting for a core or for the other rank (on a busy machine the steadier of the two).

**Own cost of the precision plugin.** ``single_device`` is compared with ``plain`` and ``ddp``
with ``plain_ddp``, precision by precision: if the plugin adds nothing of its own, the Trainer's
bf16/fp32 ratio equals the plain loop's autocast/fp32 ratio, and Trainer/plain is the same in
bf16 as in fp32. ``own ms`` is that difference in time: (Trainer - plain) in the precision minus
(Trainer - plain) in fp32, per repeat, median. The weights after the last step are compared as
well (the same arithmetic: they agree to float rounding). A step of milliseconds cannot resolve a
microsecond, so the ``single`` job also times, per repeat, what the plugin does per step on its
own (7 interleaved rounds): entering and leaving ``MixedPrecision("bf16-mixed").forward_context()``
against the plain loop's ``torch.autocast``, and ``MixedPrecision("16-mixed").optimizer_step`` against
the plain ``scaler.step(); scaler.update()``.

A case that raises (a precision a plugin refuses) or makes no progress for ``--run-timeout``
seconds (a hang: a watchdog thread ends the job) is reported in the table with its error, and the
job goes on (is started again) without it. The JSON (``bench_results/precision.json``) holds every
sample and the failures.

    python benchmarks/precision.py            # 4 repeats, 40 steps (about 7 minutes on 2 busy cores)
    python benchmarks/precision.py --quick    # smoke: 1 repeat, 14 steps, 32-true and bf16-mixed (about 70 s)
    python benchmarks/precision.py --plugins fsdp,ddp_sharded --precisions 32-true,16-mixed
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

PLUGINS = ("single_device", "ddp", "ddp_sharded", "zero", "fsdp", "pipeline", "model_parallel")
# The plain loops, and the plugin each one is the baseline of.
BASELINES = {"plain": "single_device", "plain_ddp": "ddp"}
# The two jobs and what runs in each, in order: each baseline next to its plugin.
JOBS = {
    "single": ("plain", "single_device"),
    "multi": ("plain_ddp", "ddp", "ddp_sharded", "zero", "fsdp", "pipeline", "model_parallel"),
}
JOB_WORLD = {"single": 1, "multi": 2}
IMPLS = tuple(impl for impls in JOBS.values() for impl in impls)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
REFERENCE = "32-true"
AUTOCAST_DTYPES = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}
MICRO = "micro"  # the per-call timing of the precision plugin's own work, in the single job
WIDTHS = (256, 512, 256, 512, 256)
TP_PLAN = ("colwise", "rowwise", "colwise", "rowwise")  # per layer, under model_parallel
PIPELINE_SPLIT = "layers.2"
MICROBATCHES = 4
LR = 0.01
PRIME_STEPS = 3
MICRO_CALLS = 20_000
MICRO_ROUNDS = 7
MAX_STARTS = 6  # starts of one job: the first, then one after each hang or crash
DEFAULTS = {
    "repeats": 4,
    "steps": 40,
    "warmup": 8,
    "batch": 32,
    "run_timeout": 90.0,
    "plugins": ",".join(IMPLS),
    "precisions": ",".join(PRECISIONS),
}
# A smoke run: every plugin and baseline once, in fp32 and bf16.
QUICK = {"repeats": 1, "steps": 14, "warmup": 4, "run_timeout": 60.0, "precisions": "32-true,bf16-mixed"}


def _job_of(impl: str) -> str:
    return next(job for job, impls in JOBS.items() if impl in impls)


def _key(impl: str, precision: Optional[str]) -> str:
    return impl if precision is None else f"{impl}/{precision}"


# ----------------------------------------------------------------------------- the model and data


def _net_class(base: type) -> type:
    """The MLP on ``base`` (``nn.Module`` for the plain loops, ``LightningModule`` for the Trainer)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MLP(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < last:
                    x = F.relu(x)
            return x

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(output, target)

    return MLP


def _dataset(spec: dict[str, Any]) -> Any:
    """Enough batches for every rank of a 2-way data-parallel run; a 1-way run stops at ``steps``."""
    import torch
    from torch.utils.data import TensorDataset

    n = spec["batch"] * spec["steps"] * 2
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, WIDTHS[0], generator=g), torch.randn(n, WIDTHS[-1], generator=g))


def _checksum(module: Any) -> Optional[float]:
    """The sum of the weights; ``None`` where this rank holds only parts of them (sharded, pipelined)."""
    import torch

    params = list(module.parameters())
    if any(type(p.data) is not torch.Tensor or p.is_meta for p in params):
        return None
    return sum(float(p.detach().double().sum()) for p in params)


# ----------------------------------------------------------------------------- worker side: one run


class StepClock:
    """Wall and process CPU time at the start of every step."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []

    def tick(self) -> None:
        self.ticks.append((time.perf_counter(), time.process_time()))

    def result(self, spec: dict[str, Any]) -> dict[str, Any]:
        ticks = self.ticks
        if len(ticks) != spec["steps"]:
            raise RuntimeError(f"ran {len(ticks)} training steps, expected {spec['steps']}")
        timed = ticks[spec["warmup"] :]
        gaps = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
        return {
            "step_s": common.median(gaps),
            "mean_step_s": (timed[-1][0] - timed[0][0]) / (len(timed) - 1),
            "cpu_step_s": (timed[-1][1] - timed[0][1]) / (len(timed) - 1),
        }


def _scaler_result(scaler: Any) -> dict[str, Any]:
    return {
        "scaler": None if scaler is None else type(scaler).__name__,
        "loss_scale": None if scaler is None else float(scaler.get_scale()),
    }


def _plugin(impl: str) -> Any:
    from trainer_core.plugins.registry import plugin_from_name

    if impl == "pipeline":
        return plugin_from_name(
            "pipeline", split_points=[PIPELINE_SPLIT], schedule="1F1B", n_microbatches=MICROBATCHES
        )
    if impl == "model_parallel":
        return plugin_from_name("model_parallel", data_parallel_size=1, tensor_parallel_size=2)
    return plugin_from_name(impl)


def _run_trainer(impl: str, precision: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from trainer_core import LightningModule, Trainer
    from trainer_core.callbacks import Callback

    clock = StepClock()

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            clock.tick()

    class Module(_net_class(LightningModule)):  # type: ignore[misc]
        def configure_model(self) -> None:
            mesh = self.device_mesh
            # The pipeline's mesh has a tensor-parallel dimension too, of size 1: nothing to split there.
            if (
                mesh is not None
                and "tensor_parallel" in (mesh.mesh_dim_names or ())
                and mesh["tensor_parallel"].size() > 1
            ):
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
                plan = {f"layers.{i}": styles[style]() for i, style in enumerate(TP_PLAN)}
                parallelize_module(self, mesh["tensor_parallel"], plan)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.loss_fn(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    torch.manual_seed(0)
    module = Module()
    trainer = Trainer(
        accelerator="cpu",
        devices=JOB_WORLD[_job_of(impl)],
        plugins=_plugin(impl),
        precision=precision,
        max_epochs=1,
        max_steps=spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(Path.cwd()),
        callbacks=[Clock()],
    )
    trainer.fit(module, train_dataloaders=DataLoader(_dataset(spec), batch_size=spec["batch"]))
    if trainer.global_step != spec["steps"]:
        raise RuntimeError(f"fit took {trainer.global_step} optimizer steps, expected {spec['steps']}")
    return {
        **clock.result(spec),
        "checksum": _checksum(module),
        **_scaler_result(trainer.plugin.precision.scaler),
    }


def _run_plain(impl: str, precision: str, spec: dict[str, Any], timed: bool = True) -> dict[str, Any]:
    """The hand-written loop, in one process (``plain``) or around DDP (``plain_ddp``)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = _dataset(spec)
    torch.manual_seed(0)
    net = _net_class(torch.nn.Module)()
    model, sampler = net, None
    if impl == "plain_ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
        sampler = DistributedSampler(dataset, dist.get_world_size(), dist.get_rank(), shuffle=False)
    loader = DataLoader(dataset, batch_size=spec["batch"], sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    dtype = getattr(torch, AUTOCAST_DTYPES[precision]) if precision in AUTOCAST_DTYPES else None
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    clock = StepClock()
    for step, (x, y) in enumerate(loader):
        if step == spec["steps"]:
            break
        clock.tick()
        if dtype is None:
            loss = F.mse_loss(model(x), y)
        else:
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    if not timed:
        return {}
    return {**clock.result(spec), "checksum": _checksum(net), **_scaler_result(scaler)}


def _run_micro(spec: dict[str, Any]) -> dict[str, Any]:
    """What the precision plugin does per step, on its own, against the plain loop's code: ns per call.

    ``autocast`` / ``forward_context``: entering and leaving the forward's context (bf16-mixed), as
    the plain loop and the training step run it. ``autocast_reused``: one ``torch.autocast`` built
    once and entered every step (what building the context once per epoch would cost).
    ``scaler`` / ``scaler_plugin``: a 16-mixed update of a one-layer model whose gradients are
    already there (the closure returns the loss at once): torch's ``GradScaler`` ``step`` and
    ``update``, against ``MixedPrecision("16-mixed").optimizer_step`` (closure, unscale, step, update).
    """
    import torch

    from trainer_core.precision import MixedPrecision

    calls = spec["micro_calls"]
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    reused = torch.autocast("cpu", dtype=torch.bfloat16)

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def autocast(n: int) -> None:
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pass

    def forward_context(n: int) -> None:
        needs_context = bf16.forward_context_needed  # decided once per epoch, as the training step does
        for _ in range(n):
            if needs_context:
                with bf16.forward_context():
                    pass

    def autocast_reused(n: int) -> None:
        for _ in range(n):
            with reused:
                pass

    # Scale 1, never grown: every call unscales and steps the same gradients (no drift into denormals).
    def make_scaler() -> Any:
        return torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)

    def make_optimizer() -> Any:
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 16)
        for p in layer.parameters():
            p.grad = torch.full_like(p, 1e-3)
        return torch.optim.SGD(layer.parameters(), lr=0.0)

    loss = torch.zeros(())
    plain_scaler, plain_optimizer = make_scaler(), make_optimizer()
    fp16, plugin_optimizer = MixedPrecision("16-mixed", "cpu"), make_optimizer()
    fp16.scaler = None
    fp16.setup(make_scaler)  # what the plugin does once its processes exist
    for s in (plain_scaler, fp16.scaler):
        s.scale(loss)  # a scaler steps only after it has scaled a loss (it makes its scale tensor then)

    def scaler(n: int) -> None:
        for _ in range(n):
            plain_scaler.step(plain_optimizer)
            plain_scaler.update()

    def scaler_plugin(n: int) -> None:
        def closure() -> Any:  # the forward and backward, already done
            return loss

        for _ in range(n):
            fp16.optimizer_step(plugin_optimizer, closure)

    variants = {
        "empty": (empty, calls),
        "autocast": (autocast, calls),
        "forward_context": (forward_context, calls),
        "autocast_reused": (autocast_reused, calls),
        "scaler": (scaler, calls // 40),
        "scaler_plugin": (scaler_plugin, calls // 40),
    }
    for fn, n in variants.values():
        fn(n // 10)  # first calls: caches, lazily built dispatch tables
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(MICRO_ROUNDS):
        for name in common.rotated(list(variants), round_):
            fn, n = variants[name]
            start = time.perf_counter_ns()
            fn(n)
            samples[name].append((time.perf_counter_ns() - start) / n)
    return {"ns_per_call": samples}


# ----------------------------------------------------------------------------- worker side: one job


def _start_other_ranks(world: int) -> list[subprocess.Popen]:
    """This very command again, once per other rank, with the variables ``torchrun`` sets."""
    children = []
    for rank in range(1, world):
        env = {**os.environ, **_rank_env(rank, world)}
        children.append(
            subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env=env)
        )
    return children


def _rank_env(rank: int, world: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }


class _Progress:
    """One JSON line per event of this rank (start, done, error, hung), flushed as it happens: the
    parent reads it while the job runs, and after a hang or a crash, to know what is left to run."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a")
        self._lock = threading.Lock()

    def write(self, event: str, entry: dict[str, Any], **extra: Any) -> None:
        with self._lock:
            self._file.write(json.dumps({"event": event, **entry, **extra}) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())


def _on_hang(progress: _Progress, entry: dict[str, Any], timeout: float) -> None:
    """The watchdog's end of a run that made no progress: note it, and end this process at once."""
    progress.write("hung", entry, error=f"no progress for {timeout:.0f} s (a hang; the job was ended)")
    os._exit(3)


def _ranks_still_together() -> bool:
    """After a run failed: whether every rank is still there to run the next one (a refusal raised on
    all ranks leaves them so; a rank that crashed or hung does not)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    except Exception:
        return False
    return True


def _run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Worker entry: one rank of one job; runs ``spec["todo"]`` in order, reporting each run as it ends."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    world = spec["world"]
    rank = common.local_rank()
    children: list[subprocess.Popen] = []
    if world > 1:
        import torch.distributed as dist

        if rank == 0:
            children = _start_other_ranks(world)
        # The Trainer then sees a torchrun job (TorchElasticEnvironment) and launches nothing.
        os.environ.update(_rank_env(rank, world))
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    for precision in PRECISIONS:  # this process's first steps in each dtype, untimed
        _run_plain("plain", precision, {**spec, "steps": PRIME_STEPS}, timed=False)
    progress = _Progress(Path(spec["progress_dir"]) / f"rank{rank}.jsonl")
    failed: set[str] = set()
    for entry in spec["todo"]:
        key = _key(entry["impl"], entry["precision"])
        if key in failed:
            continue
        progress.write("start", entry)
        watchdog = threading.Timer(spec["run_timeout"], _on_hang, (progress, entry, spec["run_timeout"]))
        watchdog.daemon = True
        watchdog.start()
        try:
            if entry["impl"] == MICRO:
                result = _run_micro(spec)
            elif entry["impl"] in BASELINES:
                result = _run_plain(entry["impl"], entry["precision"], spec)
            else:
                result = _run_trainer(entry["impl"], entry["precision"], spec)
        except Exception:
            watchdog.cancel()  # the barrier below has its own timeout
            failed.add(key)
            progress.write("error", entry, error=traceback.format_exc())
            if world > 1 and not _ranks_still_together():
                progress.write("broken", entry, error="the process group broke with this run; the job ends")
                os._exit(4)
        else:
            progress.write("done", entry, result=result)
        finally:
            watchdog.cancel()
        gc.collect()
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    for child in children:
        child.wait(timeout=spec["run_timeout"])
    return {"runs": len(spec["todo"])}


# ----------------------------------------------------------------------------- parent side


def _schedule(job: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs of ``job`` in order: every case once per repeat, rotated, each baseline by its plugin."""
    cases = [(impl, p) for impl in JOBS[job] if impl in args.impls for p in args.precisions]
    todo = []
    for repeat in range(args.repeats):
        for impl, precision in common.rotated(cases, repeat * len(cases) // args.repeats):
            todo.append({"repeat": repeat, "impl": impl, "precision": precision})
        if job == "single" and args.micro:
            todo.append({"repeat": repeat, "impl": MICRO, "precision": None})
    return todo


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process ended while writing it
            break
    return events


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["repeat"], a["impl"], a["precision"]) == (b["repeat"], b["impl"], b["precision"])


def _log_event(event: dict[str, Any], repeats: int) -> None:
    head = f"[{event['repeat'] + 1}/{repeats}] {_key(event['impl'], event['precision']):<28}"
    if event["event"] == "done" and event["impl"] == MICRO:
        ns = {k: common.median(v) for k, v in event["result"]["ns_per_call"].items()}
        common.log(
            f"{head} autocast {ns['autocast']:.0f} ns, forward_context {ns['forward_context']:.0f} ns, "
            f"scaler {ns['scaler']:.0f} ns, plugin's optimizer_step {ns['scaler_plugin']:.0f} ns"
        )
    elif event["event"] == "done":
        r = event["result"]
        common.log(
            f"{head} {r['step_s'] * 1e3:7.2f} ms/step (cpu {r['cpu_step_s'] * 1e3:7.2f})"
            + (f", loss scale {r['loss_scale']:g}" if r.get("loss_scale") is not None else "")
        )
    elif event["event"] in ("error", "hung"):
        common.log(f"{head} FAILED: {_short_error(event['error'])}")


def _start_job(job: str, todo: list[dict[str, Any]], args: argparse.Namespace) -> tuple[list, dict, str]:
    """Run ``todo`` as one job; returns (done events of rank 0 with rank 1's result, failures, job error)."""
    world = JOB_WORLD[job]
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as progress_dir:
        spec = {
            "world": world,
            "todo": todo,
            "progress_dir": progress_dir,
            "run_timeout": args.run_timeout,
            "micro_calls": args.micro_calls,
            **args.model,
        }
        command = [str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                common.run_rank_job(
                    command,
                    world,
                    timeout=60.0 + len(todo) * args.run_timeout,
                    show_output=args.show_output,
                )
            except common.WorkerError as err:
                outcome["error"] = str(err)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        rank0 = Path(progress_dir) / "rank0.jsonl"
        seen = 0
        while thread.is_alive():  # the runs as they end
            thread.join(timeout=0.5)
            events = _read_events(rank0)
            for event in events[seen:]:
                _log_event(event, args.repeats)
            seen = len(events)
        events = [_read_events(Path(progress_dir) / f"rank{rank}.jsonl") for rank in range(world)]
    for event in events[0][seen:]:
        _log_event(event, args.repeats)
    done: list[dict[str, Any]] = []
    failures: dict[str, dict[str, str]] = {}
    for rank, mine in enumerate(events):
        for event in mine:
            if event["event"] in ("error", "hung"):  # a rank's first word on a run is its cause
                failures.setdefault(_key(event["impl"], event["precision"]), {}).setdefault(
                    f"rank {rank}", event["error"]
                )
    for event in events[0]:
        if event["event"] != "done" or _key(event["impl"], event["precision"]) in failures:
            continue
        others = [
            next((e["result"] for e in mine if e["event"] == "done" and _same_run(e, event)), None)
            for mine in events[1:]
        ]
        done.append({**event, "other_ranks": others})
    return done, failures, outcome.get("error", "")


def _measure(args: argparse.Namespace) -> tuple[list[dict], dict[str, dict[str, str]], list[dict]]:
    runs: list[dict[str, Any]] = []
    failures: dict[str, dict[str, str]] = {}
    starts: list[dict[str, Any]] = []
    for job in JOBS:
        todo = _schedule(job, args)
        for attempt in range(MAX_STARTS):
            if not todo:
                break
            common.log(f"job {job!r} (start {attempt + 1}): {len(todo)} runs")
            started = time.monotonic()
            done, failed, error = _start_job(job, todo, args)
            starts.append(
                {"job": job, "runs": len(todo), "done": len(done), "wall_s": time.monotonic() - started}
            )
            runs += done
            failures.update(failed)
            left = [
                e
                for e in todo
                if not any(_same_run(e, d) for d in done) and _key(e["impl"], e["precision"]) not in failures
            ]
            if left and error and not failed:
                if len(left) == len(todo):  # no run even started: the job itself fails
                    for e in left:
                        failures.setdefault(_key(e["impl"], e["precision"]), {"job": error})
                    left = []
                else:  # ended mid-run without a word (a crash): blame the run it was in
                    failures.setdefault(_key(left[0]["impl"], left[0]["precision"]), {"job": error})
                    left = [e for e in left if _key(e["impl"], e["precision"]) not in failures]
            todo = left
    return runs, failures, starts


def _short_error(error: str) -> str:
    """The line of a traceback that says what went wrong (the exception's)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or "no progress" in line or "ran past" in line:
            return line[:300]
    return lines[-1][:300] if lines else "failed"


def _by_repeat(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    """The samples of ``a`` and ``b`` from the same repeat, in pairs."""
    by_repeat = {s["repeat"]: s for s in b}
    return [(s, by_repeat[s["repeat"]]) for s in a if s["repeat"] in by_repeat]


def _paired_median(a: list[dict], b: list[dict], read: Any) -> Optional[float]:
    values = [read(x, y) for x, y in _by_repeat(a, b)]
    return common.median(values) if values else None


def _ratio(field: str) -> Any:
    return lambda x, y: x[field] / y[field]


def _summarize(samples: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for key, mine in samples.items():
        cases[key] = {
            "repeats": len(mine),
            "step_ms": common.median(s["step_s"] for s in mine) * 1e3,
            "cpu_step_ms": common.median(s["cpu_step_s"] for s in mine) * 1e3,
            "spread_pct": common.spread_pct(s["step_s"] for s in mine),
            "scaler": mine[0].get("scaler"),
            "final_loss_scale": mine[0].get("loss_scale"),
        }
    # Each precision against fp32, per implementation, paired by repeat.
    ratios: dict[str, dict[str, Any]] = {}
    for impl in args.impls:
        ref = samples.get(_key(impl, REFERENCE), [])
        for precision in args.precisions:
            mine = samples.get(_key(impl, precision), [])
            if precision != REFERENCE and mine and ref:
                ratios[_key(impl, precision)] = {
                    "x_fp32": _paired_median(mine, ref, _ratio("step_s")),
                    "x_fp32_cpu": _paired_median(mine, ref, _ratio("cpu_step_s")),
                }
    # The Trainer against its plain loop, precision by precision.
    own: list[dict[str, Any]] = []
    for plain, plugin in BASELINES.items():
        t32, p32 = samples.get(_key(plugin, REFERENCE), []), samples.get(_key(plain, REFERENCE), [])
        for precision in args.precisions:
            t, p = samples.get(_key(plugin, precision), []), samples.get(_key(plain, precision), [])
            if not t or not p:
                continue
            row: dict[str, Any] = {
                "plugin": plugin,
                "baseline": plain,
                "precision": precision,
                "trainer_ms": cases[_key(plugin, precision)]["step_ms"],
                "plain_ms": cases[_key(plain, precision)]["step_ms"],
                "x_plain": _paired_median(t, p, _ratio("step_s")),
                "x_plain_cpu": _paired_median(t, p, _ratio("cpu_step_s")),
                "trainer_x_fp32": ratios.get(_key(plugin, precision), {}).get("x_fp32"),
                "plain_x_fp32": ratios.get(_key(plain, precision), {}).get("x_fp32"),
                "trainer_x_fp32_cpu": ratios.get(_key(plugin, precision), {}).get("x_fp32_cpu"),
                "plain_x_fp32_cpu": ratios.get(_key(plain, precision), {}).get("x_fp32_cpu"),
                "same_weights": _same(t[0].get("checksum"), p[0].get("checksum")),
            }
            if precision != REFERENCE and t32 and p32:
                for field, name in (("step_s", "own_ms"), ("cpu_step_s", "own_cpu_ms")):
                    gap = {s["repeat"]: s[field] - q[field] for s, q in _by_repeat(t32, p32)}
                    values = [
                        (s[field] - q[field] - gap[s["repeat"]]) * 1e3
                        for s, q in _by_repeat(t, p)
                        if s["repeat"] in gap
                    ]
                    row[name] = common.median(values) if values else None
                    row[f"{name}_samples"] = values
            own.append(row)
    return {"cases": cases, "ratios": ratios, "own_cost": own}


def _same(a: Optional[float], b: Optional[float]) -> Optional[bool]:
    if a is None or b is None:
        return None
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _summarize_micro(micro: list[dict[str, list[float]]]) -> Optional[dict[str, Any]]:
    if not micro:
        return None
    pooled = {name: [v for run in micro for v in run[name]] for name in micro[0]}
    medians = {name: common.median(values) for name, values in pooled.items()}
    # The fastest round: what the code costs when nothing else on the machine gets in the way.
    fastest = {name: min(values) for name, values in pooled.items()}
    return {
        "ns_per_call": medians,
        "min_ns_per_call": fastest,
        "spread_pct": {name: common.spread_pct(values) for name, values in pooled.items()},
        "forward_context_minus_autocast_ns": medians["forward_context"] - medians["autocast"],
        "scaler_plugin_minus_scaler_ns": medians["scaler_plugin"] - medians["scaler"],
        "forward_context_minus_autocast_min_ns": fastest["forward_context"] - fastest["autocast"],
        "scaler_plugin_minus_scaler_min_ns": fastest["scaler_plugin"] - fastest["scaler"],
    }


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _render_steps(
    summary: dict[str, Any], failures: dict[str, dict[str, str]], args: argparse.Namespace
) -> list[str]:
    cases, ratios = summary["cases"], summary["ratios"]
    out = [
        f"### Step time by plugin and precision (rank 0, median ms over {args.repeats} repeat(s); steps "
        f"{args.model['warmup']}..{args.model['steps'] - 1} timed; batch {args.model['batch']}, MLP "
        f"{'-'.join(map(str, WIDTHS))}, SGD)",
        "",
    ]
    headers = ["impl", "ranks"]
    for precision in args.precisions:
        headers.append(f"{precision} ms")
        if precision != REFERENCE:
            short = precision.split("-")[0]
            headers += [f"{short}/32", f"{short}/32 cpu"]
    headers += ["spread", "16-mixed scaler"]
    rows, notes = [], []
    for impl in args.impls:
        row = [impl, str(JOB_WORLD[_job_of(impl)])]
        spreads = []
        for precision in args.precisions:
            key = _key(impl, precision)
            case = cases.get(key)
            if key in failures:
                notes.append(
                    f"{key}: "
                    + "; ".join(f"{where}: {_short_error(e)}" for where, e in failures[key].items())
                )
                row.append(f"FAILED [{len(notes)}]")
            else:
                row.append(_ms(case["step_ms"]) if case else "-")
            if case:
                spreads.append(case["spread_pct"])
            if precision != REFERENCE:
                row += [_x(ratios.get(key, {}).get("x_fp32")), _x(ratios.get(key, {}).get("x_fp32_cpu"))]
        row.append(f"{max(spreads):.0f}%" if spreads else "-")
        case16 = cases.get(_key(impl, "16-mixed"))
        row.append((case16 or {}).get("scaler") or "-")
        rows.append(row)
    out.append(_markdown(headers, rows))
    out += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    out.append(
        "x/32: the step time over the same implementation's 32-true step of the same repeat (median); "
        "cpu: the same with rank 0's CPU time per step; spread: (max - min) / median over repeats, worst "
        "precision of the row."
    )
    return out


def _render_own(summary: dict[str, Any]) -> list[str]:
    own = summary["own_cost"]
    if not own:
        return []
    headers = [
        "Trainer vs plain loop",
        "precision",
        "Trainer ms",
        "plain ms",
        "Trainer/plain",
        "(cpu)",
        "Trainer x32",
        "plain x32",
        "own ms",
        "own ms (cpu)",
        "same weights",
    ]
    rows = []
    for r in own:
        ref = r["precision"] == REFERENCE
        rows.append(
            [
                f"{r['plugin']} vs {r['baseline']}",
                r["precision"],
                _ms(r["trainer_ms"]),
                _ms(r["plain_ms"]),
                _x(r["x_plain"]),
                _x(r["x_plain_cpu"]),
                "1.00x" if ref else _x(r["trainer_x_fp32"]),
                "1.00x" if ref else _x(r["plain_x_fp32"]),
                "-" if r.get("own_ms") is None else f"{r['own_ms']:+.3f}",
                "-" if r.get("own_cpu_ms") is None else f"{r['own_cpu_ms']:+.3f}",
                {True: "yes", False: "NO", None: "-"}[r["same_weights"]],
            ]
        )
    return [
        "",
        "### Own cost of the precision plugin: the Trainer against the plain loop, precision by precision",
        "",
        _markdown(headers, rows),
        "own ms: (Trainer - plain) in that precision minus (Trainer - plain) in 32-true, paired by repeat, "
        "median; zero within noise means the precision plugin adds nothing beyond autocast (and the scaler).",
    ]


def _render_micro(micro: Optional[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    if micro is None:
        return []
    ns, fastest, spread = micro["ns_per_call"], micro["min_ns_per_call"], micro["spread_pct"]
    labels = {
        "empty": "empty loop",
        "autocast": 'plain: `with torch.autocast("cpu", dtype=torch.bfloat16)`',
        "forward_context": "Trainer: `if needs_context: with precision.forward_context()` (bf16-mixed)",
        "autocast_reused": "for reference: one `torch.autocast` built once, entered every step",
        "scaler": "plain: `scaler.step(opt); scaler.update()` (16-mixed, one Linear(16, 16))",
        "scaler_plugin": "Trainer: `MixedPrecision('16-mixed').optimizer_step(opt, closure)`",
    }
    out = [
        "",
        f"### What the precision plugin does per step, on its own (ns per call over {MICRO_ROUNDS} "
        "interleaved rounds per repeat: median, fastest round)",
        "",
        _markdown(
            ["per step", "median ns", "fastest ns", "spread"],
            [
                [label, f"{ns[name]:.0f}", f"{fastest[name]:.0f}", f"{spread[name]:.0f}%"]
                for name, label in labels.items()
            ],
        ),
        f"the plugin's own part (median; fastest): {micro['forward_context_minus_autocast_ns']:+.0f}; "
        f"{micro['forward_context_minus_autocast_min_ns']:+.0f} ns per step around the forward (bf16-mixed), "
        f"{micro['scaler_plugin_minus_scaler_ns']:+.0f}; {micro['scaler_plugin_minus_scaler_min_ns']:+.0f} ns "
        "per update (16-mixed)",
    ]
    mixed = [c["step_ms"] for key, c in summary["cases"].items() if not key.endswith(REFERENCE)]
    if mixed:
        share = micro["forward_context_minus_autocast_ns"] / (min(mixed) * 1e6) * 100
        out[-1] += f"; {share:+.4f}% of the fastest mixed-precision step above"
    return out


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat, 14 steps, 32-true and bf16-mixed"
    )
    parser.add_argument("--repeats", type=int, default=None, help=f"default {DEFAULTS['repeats']}")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"steps per run (default {DEFAULTS['steps']})"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help=f"untimed first steps (default {DEFAULTS['warmup']})"
    )
    parser.add_argument("--batch", type=int, default=None, help=f"default {DEFAULTS['batch']}")
    parser.add_argument(
        "--plugins", default=None, help="comma-separated subset of (default all): " + ", ".join(IMPLS)
    )
    parser.add_argument(
        "--precisions",
        default=None,
        help="comma-separated subset of (default all; --quick: 32-true,bf16-mixed): " + ", ".join(PRECISIONS),
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help=f"seconds a run may take before it counts as hung (default {DEFAULTS['run_timeout']:.0f})",
    )
    parser.add_argument(
        "--no-micro", dest="micro", action="store_false", help="skip the per-call timing of the plugin's work"
    )
    parser.add_argument("--show-output", action="store_true", help="let the ranks print")
    parser.add_argument(
        "--out", default=None, help="JSON output (default bench_results/precision[_quick].json)"
    )
    args = parser.parse_args(argv)
    preset = {**DEFAULTS, **(QUICK if args.quick else {})}
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.impls = common.parse_cases(parser, args.plugins, IMPLS)
    args.precisions = common.parse_cases(parser, args.precisions, PRECISIONS)
    if REFERENCE not in args.precisions:
        args.precisions.insert(0, REFERENCE)  # every ratio is against it
    if args.steps - args.warmup < 3:
        parser.error("--steps must exceed --warmup by at least 3")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if args.out is None:
        args.out = str(common.RESULTS_DIR / ("precision_quick.json" if args.quick else "precision.json"))
    args.micro_calls = MICRO_CALLS // 4 if args.quick else MICRO_CALLS
    args.model = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch}
    return args


def main(argv: Sequence[str]) -> int:
    if "--worker" in argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", required=True)
        parser.add_argument("--result-dir", required=True)
        worker, _ = parser.parse_known_args(argv)
        spec = json.loads(worker.worker)
        common.serve_rank_worker(worker.result_dir, lambda: _run_job(spec))
        return 0

    args = _parse_args(argv)
    started = time.time()
    runs, failures, starts = _measure(args)
    samples: dict[str, list[dict[str, Any]]] = {}
    micro_runs = []
    for run in runs:
        if run["impl"] == MICRO:
            micro_runs.append(run["result"]["ns_per_call"])
            continue
        sample = {"repeat": run["repeat"], **run["result"], "other_ranks": run["other_ranks"]}
        samples.setdefault(_key(run["impl"], run["precision"]), []).append(sample)
    summary = _summarize(samples, args)
    micro = _summarize_micro(micro_runs)
    lines = _render_steps(summary, failures, args) + _render_own(summary) + _render_micro(micro, summary)
    payload: dict[str, Any] = {
        "benchmark": "precision",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "config": {
            **args.model,
            "repeats": args.repeats,
            "widths": WIDTHS,
            "lr": LR,
            "impls": args.impls,
            "precisions": args.precisions,
            "jobs": {job: JOB_WORLD[job] for job in JOBS},
            "pipeline": {"split": PIPELINE_SPLIT, "schedule": "1F1B", "microbatches": MICROBATCHES},
            "model_parallel": {"data_parallel_size": 1, "tensor_parallel_size": 2, "plan": TP_PLAN},
            "run_timeout_s": args.run_timeout,
            "quick": args.quick,
        },
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "trainer-core", "fairscale"]),
        "summary": summary,
        "micro": micro,
        "failures": failures,
        "job_starts": starts,
        "samples": samples,
        "micro_samples": micro_runs,
    }
    if hasattr(os, "getloadavg"):
        payload["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        lines += [
            "",
            f"load average (1 min) at start {payload['machine'].get('loadavg', ['?'])[0]}, at end "
            f"{payload['loadavg_end'][0]}, on {os.cpu_count()} cores",
        ]
    print("\n".join(lines))
    payload["wall_s"] = round(time.time() - started, 1)
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
