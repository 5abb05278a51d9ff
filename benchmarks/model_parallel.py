"""Tensor parallelism: step time under the Trainer against a hand-written loop, and sharded checkpoints.

The model is a small transformer: ``--depth`` pre-norm blocks (causal attention with ``--heads``
heads and an MLP of 4 x ``--width``, residuals, layer norms) and a linear head over 16 classes,
trained with AdamW on a cross-entropy loss over every position. Each block gets the usual
column-/row-wise plan (``q``, ``k``, ``v``, ``w1`` column-wise; ``o``, ``w2`` row-wise). Every job
runs over gloo on 127.0.0.1, one thread per rank; the parent starts rank 0 and rank 0 starts the
others (the Trainer's launcher, or the plain loop's ``subprocess.Popen``).

**Step time at [tp=2]** (2 processes), two implementations, interleaved and rotated across repeats:

* ``plain``    the loop a user writes by hand: ``init_process_group``, the same 3-D
               ``init_device_mesh`` (pipeline 1 x data 1 x tensor 2), ``parallelize_module`` of every
               block with the plan, then ``fully_shard`` of the root over the size-1 data-parallel mesh
               with the plugin's options (``reshard_after_forward=True``, default mixed-precision and
               offload policies), AdamW, the same batches in the same order.
* ``trainer``  ``Trainer(devices=2, plugins=ModelParallelPlugin(data_parallel_size=1,
               tensor_parallel_size=2))`` with the same plan in the module's ``configure_model``;
               progress bar, logger, checkpointing, model summary and sanity steps off.

Each rank notes the start of every training step; ``us/step`` is (start of the last step - start
of step ``--warmup``) / the steps between them on rank 0, so start-up and the first steps are left
out; ``median gap us`` is the median time between the starts of two steps (deaf to a few steps
slowed by other work on the machine); ``cpu us/step`` is rank 0's process CPU time (every thread)
over the same window, which leaves out the time spent waiting for the other rank or for a core, so
it shows each side's own work even on a busy machine. Ratios are paired (trainer / plain of the
same repeat, median over repeats); the target (at most 1.05x) applies to ``us/step``. The losses of
the two implementations are compared step by step: they do the same arithmetic, so they agree.
Most of a step is DTensor's dispatch in Python (tens of ms on this CPU however small the model),
the same on both sides; ``--profile`` writes a cProfile of the timed steps of each side.

**Sharded checkpoints at 4 processes**, the same model larger (``--ckpt-width``, ``--ckpt-depth``),
two plugins, interleaved and rotated across repeats:

* ``fsdp``            ``FSDPPlugin(state_dict_type="sharded")``: the root sharded over 4 ranks.
* ``model_parallel``  ``ModelParallelPlugin(data_parallel_size=2, tensor_parallel_size=2,
                      save_distributed_checkpoint=True)``: [dp=2, tp=2], the root sharded over dp.

Each job trains 2 steps, then, in ``on_train_end``, saves ``--saves`` times with
``trainer.save_checkpoint`` (a DCP folder, every rank its shards) and loads the last of them
``--loads`` times with ``restore_checkpoint`` (what ``trainer.fit(ckpt_path=...)`` runs: read the
shards into the run's own, then load model, optimizer and loop state). Before every load each rank
adds 1 to its parameters and Adam state; after it, a SHA-256 of the rank's shards (parameters and
optimizer state) must equal the digest taken before the first save, so a load that did nothing
fails the job. The ranks meet at a barrier before every save and load; a save's or load's time is
the max over ranks. The first save and the first load of a job are shown apart (first use of the
buffers and of DCP's planners); ``save ms``/``load ms`` are the medians of the others over all
repeats, and ``read ms`` the part of a load spent in the plugin's ``load_checkpoint`` (DCP reading
into the run's shards; the rest is the checks and ``set_model/optimizer_state_dict``). No target:
the table shows what tensor parallelism costs a checkpoint against FSDP alone at the same size.

    python benchmarks/model_parallel.py             # 5 + 3 repeats (about 4 minutes on 2 cores)
    python benchmarks/model_parallel.py --quick     # smoke: 1 repeat each, fewer steps and saves
    python benchmarks/model_parallel.py --parts step --repeats 7
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

PARTS = ("step", "checkpoint")
STEP_IMPLS = ("plain", "trainer")
CKPT_PLUGINS = ("fsdp", "model_parallel")
TP = 2
CKPT_WORLD, CKPT_DP, CKPT_TP = 4, 2, 2
CLASSES = 16
LR = 1e-3
TRAIN_STEPS_BEFORE_SAVE = 2
TARGET_STEP_RATIO = 1.05
JOB_TIMEOUT_S = 300.0
MESH_DIMS = ("pipeline_parallel", "data_parallel", "tensor_parallel")  # the plugin's mesh, pp x dp x tp
MB = 1e6
PROFILE_DIR = common.RESULTS_DIR / "profile"

DEFAULTS = {
    "width": 128,
    "depth": 2,
    "heads": 4,
    "seq": 32,
    "batch": 4,
    "steps": 50,
    "warmup": 10,
    "step_repeats": 5,
    "ckpt_width": 384,
    "ckpt_depth": 3,
    "saves": 3,
    "loads": 3,
    "ckpt_repeats": 3,
}
QUICK = {"steps": 30, "warmup": 5, "step_repeats": 1, "saves": 2, "loads": 2, "ckpt_repeats": 1}


# ----------------------------------------------------------------------------- the model


def _net_class(base: type) -> type:
    """The transformer on ``base`` (``nn.Module`` for the plain loop, ``LightningModule`` for the Trainer)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.head_dim = width // heads
            self.norm1 = nn.LayerNorm(width)
            self.q = nn.Linear(width, width)
            self.k = nn.Linear(width, width, bias=False)
            self.v = nn.Linear(width, width)
            self.o = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.w1 = nn.Linear(width, 4 * width)
            self.w2 = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            y = self.norm1(x)
            # -1 heads: under tensor parallelism each rank holds heads / tp of them.
            q = self.q(y).view(b, n, -1, self.head_dim).transpose(1, 2)
            k = self.k(y).view(b, n, -1, self.head_dim).transpose(1, 2)
            v = self.v(y).view(b, n, -1, self.head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
            x = x + self.o(a)
            return x + self.w2(F.gelu(self.w1(self.norm2(x))))

    class Net(base):  # type: ignore[misc, valid-type]
        def __init__(self, width: int, depth: int, heads: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Net


def _apply_tensor_parallel(net: Any, tp_mesh: Any) -> None:
    """The plan of every block: attention heads and the MLP's hidden units split over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in net.blocks:
        plan = {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "o": RowwiseParallel(),
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, CLASSES), target.reshape(-1))


def _dataset(spec: dict[str, Any], samples: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, spec["seq"], spec["width"], generator=g)
    y = torch.randint(0, CLASSES, (samples, spec["seq"]), generator=g)
    return TensorDataset(x, y)


def _lightning_module(
    spec: dict[str, Any], clock: Optional[StepClock], losses: list[Any], on_train_end: Any
) -> Any:
    """The Trainer's module: the same network, the plan in ``configure_model``, a clock in ``training_step``."""
    import torch

    from trainer_core import LightningModule

    Net = _net_class(LightningModule)

    class TensorParallelModule(Net):  # type: ignore[misc, valid-type]
        def configure_model(self) -> None:
            mesh = self.device_mesh
            # Plain FSDP's mesh is 1-D ("data_parallel",): the module then stays whole on each rank.
            if mesh is not None and MESH_DIMS[2] in (mesh.mesh_dim_names or ()):
                _apply_tensor_parallel(self, mesh[MESH_DIMS[2]])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if clock is not None:
                clock.tick()
            x, y = batch
            loss = _loss(self(x), y)
            losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

        def on_train_end(self) -> None:
            if on_train_end is not None:
                on_train_end(self.trainer)

    torch.manual_seed(0)
    return TensorParallelModule(spec["width"], spec["depth"], spec["heads"])


def _trainer(devices: int, plugin: Any, max_steps: int) -> Any:
    from trainer_core import Trainer

    return Trainer(
        accelerator="cpu",
        devices=devices,
        plugins=plugin,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(Path.cwd()),
    )


def _start_other_ranks(world: int) -> list[subprocess.Popen]:
    """What the Trainer's launcher does: this very command again, once per other rank."""
    children = []
    for rank in range(1, world):
        env = {**os.environ, "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        children.append(
            subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env=env)
        )
    return children


# ----------------------------------------------------------------------------- part 1: step time


def _profiler() -> Any:
    import cProfile

    return cProfile.Profile()


class StepClock:
    """Wall and process CPU time at the start of every step; with ``profile``, cProfile over the timed steps."""

    def __init__(self, warmup: int, profile: bool = False) -> None:
        self.warmup = warmup
        self.ticks: list[tuple[float, float]] = []
        self.profiler: Any = None
        if profile:
            self.profiler = _profiler()

    def tick(self) -> None:
        self.ticks.append((time.perf_counter(), time.process_time()))
        if self.profiler is not None and len(self.ticks) == self.warmup + 1:
            self.profiler.enable()

    def stop(self, name: str) -> None:
        """End the profile (after the last step) and write it; profiled runs time slower."""
        if self.profiler is not None:
            self.profiler.disable()
            txt = common.write_profile(
                self.profiler, PROFILE_DIR / f"model_parallel-{name}-rank{common.local_rank()}.prof"
            )
            common.log(f"profile: {txt}")


def _step_result(spec: dict[str, Any], clock: StepClock, losses: list[Any]) -> dict[str, Any]:
    """Wall and CPU time per step over the timed window (step ``warmup`` to the last step's start)."""
    ticks = clock.ticks
    warmup = spec["warmup"]
    if len(ticks) != spec["steps"]:
        raise RuntimeError(f"ran {len(ticks)} training steps, expected {spec['steps']}")
    timed = [wall for wall, _ in ticks[warmup:]]
    cpu = [c for _, c in ticks[warmup:]]
    gaps = [b - a for a, b in zip(timed, timed[1:])]
    return {
        "step_s": (timed[-1] - timed[0]) / (len(timed) - 1),
        "cpu_step_s": (cpu[-1] - cpu[0]) / (len(cpu) - 1),
        "median_gap_s": common.median(gaps),
        "losses": [float(v) for v in losses],
    }


def _run_plain_step(spec: dict[str, Any]) -> dict[str, Any]:
    """The hand-written loop: the same mesh, plan, sharding, optimizer and batches as the plugin's run."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.utils.data import DataLoader

    rank = common.local_rank()
    children = _start_other_ranks(TP) if rank == 0 else []
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=TP)
    mesh = init_device_mesh("cpu", (1, 1, TP), mesh_dim_names=MESH_DIMS)
    torch.manual_seed(0)
    net = _net_class(torch.nn.Module)(spec["width"], spec["depth"], spec["heads"])
    _apply_tensor_parallel(net, mesh[MESH_DIMS[2]])
    fully_shard(
        net,
        mesh=mesh[MESH_DIMS[1]],
        reshard_after_forward=True,
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
    )
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    # Both ranks of the tensor-parallel group read the same batches, in order (as the plugin's loader).
    loader = DataLoader(_dataset(spec, spec["batch"] * spec["steps"]), batch_size=spec["batch"])
    clock = StepClock(spec["warmup"], spec["profile"])
    losses: list[Any] = []
    for x, y in loader:
        clock.tick()
        optimizer.zero_grad()
        loss = _loss(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    clock.stop("plain")
    dist.barrier()
    dist.destroy_process_group()
    for child in children:
        child.wait(timeout=JOB_TIMEOUT_S)
    return _step_result(spec, clock, losses)


def _run_trainer_step(spec: dict[str, Any]) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from trainer_core.plugins import ModelParallelPlugin

    clock = StepClock(spec["warmup"], spec["profile"])
    losses: list[Any] = []
    module = _lightning_module(spec, clock, losses, None)
    loader = DataLoader(_dataset(spec, spec["batch"] * spec["steps"]), batch_size=spec["batch"])
    plugin = ModelParallelPlugin(data_parallel_size=1, tensor_parallel_size=TP)
    trainer = _trainer(TP, plugin, spec["steps"])
    trainer.fit(module, train_dataloaders=loader)
    if trainer.global_step != spec["steps"]:
        raise RuntimeError(f"fit took {trainer.global_step} optimizer steps, expected {spec['steps']}")
    clock.stop("trainer")
    return _step_result(spec, clock, losses)


# ----------------------------------------------------------------------------- part 2: checkpoints


def _local(tensor: Any) -> Any:
    """The rank's own part of a tensor (a DTensor's local shard, shared storage under no_grad)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_tensors(module: Any, optimizer: Any) -> list[tuple[str, Any]]:
    """Every tensor a checkpoint restores on this rank, in a fixed order: parameters, then their Adam state."""
    import torch

    out = []
    for name, param in module.named_parameters():
        out.append((name, _local(param)))
        state = optimizer.state.get(param, {})
        for key in sorted(state):
            if isinstance(state[key], torch.Tensor):
                out.append((f"{name}/{key}", _local(state[key])))
    return out


def _digest(module: Any, optimizer: Any) -> str:
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in _state_tensors(module, optimizer):
            h.update(name.encode())
            h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _perturb(module: Any, optimizer: Any) -> None:
    import torch

    with torch.no_grad():
        for _, tensor in _state_tensors(module, optimizer):
            tensor.add_(1.0)


def _size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _measure_checkpoints(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``saves`` saves, then ``loads`` loads of the last one, each timed between barriers; digests checked."""
    import torch.distributed as dist

    from trainer_core.checkpoint.restore import restore_checkpoint

    module = trainer.lightning_module
    optimizer = trainer.plugin.optimizers[0]
    rank = dist.get_rank()
    saved = _digest(module, optimizer)
    root = Path.cwd()
    saves: list[float] = []
    loads: list[float] = []
    reads: list[float] = []
    plugin = trainer.plugin
    read_shards = plugin.load_checkpoint

    def timed_read(filepath: str) -> dict[str, Any]:
        start = time.perf_counter()
        checkpoint = read_shards(filepath)
        reads.append(time.perf_counter() - start)
        return checkpoint

    plugin.load_checkpoint = timed_read  # on the instance: the read phase of each load
    path = root
    for index in range(spec["saves"]):
        if index and rank == 0:
            shutil.rmtree(path)  # the previous save; only the last is loaded
        path = root / f"ckpt-{index}"
        dist.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        saves.append(time.perf_counter() - start)
    dist.barrier()
    size = _size_bytes(path) if rank == 0 else 0
    profiler = _profiler() if spec["profile"] else None
    for index in range(spec["loads"]):
        _perturb(module, optimizer)
        if _digest(module, optimizer) == saved:
            raise RuntimeError("adding 1 to every parameter and optimizer state left the digest unchanged")
        last = index == spec["loads"] - 1
        dist.barrier()
        if profiler is not None and last:
            profiler.enable()
        start = time.perf_counter()
        restore_checkpoint(trainer.checkpoint_parts(), str(path))
        loads.append(time.perf_counter() - start)
        if profiler is not None and last:
            profiler.disable()
            name = f"model_parallel-load-{spec['plugin']}-rank{rank}.prof"
            common.write_profile(profiler, PROFILE_DIR / name)
        loaded = _digest(module, optimizer)
        if loaded != saved:
            raise RuntimeError(
                f"rank {rank}: the loaded state differs from the saved one ({loaded} != {saved})"
            )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    return {"save_s": saves, "load_s": loads, "read_s": reads, "size_bytes": size, "digest": saved}


def _run_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    from trainer_core.plugins import FSDPPlugin, ModelParallelPlugin

    measured: dict[str, Any] = {}
    model_spec = {**spec, "width": spec["ckpt_width"], "depth": spec["ckpt_depth"]}
    module = _lightning_module(
        model_spec, None, [], lambda trainer: measured.update(_measure_checkpoints(trainer, spec))
    )
    params = sum(p.numel() for p in module.parameters())
    if spec["plugin"] == "fsdp":
        plugin = FSDPPlugin(state_dict_type="sharded")
    else:
        plugin = ModelParallelPlugin(
            data_parallel_size=CKPT_DP, tensor_parallel_size=CKPT_TP, save_distributed_checkpoint=True
        )
    samples = spec["batch"] * TRAIN_STEPS_BEFORE_SAVE * CKPT_WORLD
    loader = DataLoader(_dataset(model_spec, samples), batch_size=spec["batch"])
    trainer = _trainer(CKPT_WORLD, plugin, TRAIN_STEPS_BEFORE_SAVE)
    trainer.fit(module, train_dataloaders=loader)
    if not measured:
        raise RuntimeError("on_train_end never ran: nothing was saved")
    return {"params": params, **measured}


def _run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if spec["part"] == "checkpoint":
        return _run_checkpoint(spec)
    if spec["impl"] == "plain":
        return _run_plain_step(spec)
    return _run_trainer_step(spec)


# ----------------------------------------------------------------------------- parent side


def _job(spec: dict[str, Any], world: int, show_output: bool) -> list[dict[str, Any]]:
    command = [str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    return common.run_rank_job(command, world, timeout=JOB_TIMEOUT_S, show_output=show_output)["ranks"]


def _measure_steps(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    samples: dict[str, list[dict[str, Any]]] = {impl: [] for impl in STEP_IMPLS}
    for repeat in range(args.step_repeats):
        for impl in common.rotated(STEP_IMPLS, repeat):
            ranks = _job({**base, "part": "step", "impl": impl}, TP, args.show_output)
            sample = {"repeat": repeat, **ranks[0], "rank_step_s": [r["step_s"] for r in ranks]}
            samples[impl].append(sample)
            common.log(
                f"[{repeat + 1}/{args.step_repeats}] step {impl:<8} {sample['step_s'] * 1e6:8.0f} us/step"
            )
    return samples


def _measure_checkpoints_jobs(
    args: argparse.Namespace, base: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    samples: dict[str, list[dict[str, Any]]] = {plugin: [] for plugin in CKPT_PLUGINS}
    for repeat in range(args.ckpt_repeats):
        for plugin in common.rotated(CKPT_PLUGINS, repeat):
            ranks = _job({**base, "part": "checkpoint", "plugin": plugin}, CKPT_WORLD, args.show_output)
            sample = {
                "repeat": repeat,
                "params": ranks[0]["params"],
                "size_bytes": ranks[0]["size_bytes"],
                "save_s": [max(r["save_s"][i] for r in ranks) for i in range(args.saves)],
                "load_s": [max(r["load_s"][i] for r in ranks) for i in range(args.loads)],
                "read_s": [max(r["read_s"][i] for r in ranks) for i in range(args.loads)],
                "digests_checked": len(ranks),
            }
            samples[plugin].append(sample)
            common.log(
                f"[{repeat + 1}/{args.ckpt_repeats}] checkpoint {plugin:<14} saves "
                + " ".join(f"{s * 1e3:.0f}" for s in sample["save_s"])
                + " ms, loads "
                + " ".join(f"{s * 1e3:.0f}" for s in sample["load_s"])
                + " ms"
            )
    return samples


def _summarize_steps(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    plain, trainer = samples["plain"], samples["trainer"]
    paired = [t["step_s"] / p["step_s"] for p, t in zip(plain, trainer)]
    paired_gap = [t["median_gap_s"] / p["median_gap_s"] for p, t in zip(plain, trainer)]
    paired_cpu = [t["cpu_step_s"] / p["cpu_step_s"] for p, t in zip(plain, trainer)]
    rows = {
        impl: {
            "step_us": common.median(s["step_s"] for s in mine) * 1e6,
            "median_gap_us": common.median(s["median_gap_s"] for s in mine) * 1e6,
            "cpu_step_us": common.median(s["cpu_step_s"] for s in mine) * 1e6,
            "spread_pct": common.spread_pct(s["step_s"] for s in mine),
        }
        for impl, mine in samples.items()
    }
    ratio = common.median(paired)
    loss_diff = max(abs(a - b) for p, t in zip(plain, trainer) for a, b in zip(p["losses"], t["losses"]))
    return {
        "rows": rows,
        "trainer_x_plain": ratio,
        "trainer_x_plain_of_medians": rows["trainer"]["step_us"] / rows["plain"]["step_us"],
        "paired_ratios": paired,
        "trainer_x_plain_median_gap": common.median(paired_gap),
        "trainer_x_plain_cpu": common.median(paired_cpu),
        "max_loss_diff": loss_diff,
        "target_met": ratio <= TARGET_STEP_RATIO,
    }


def _summarize_checkpoints(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = {}
    for plugin, mine in samples.items():
        steady_saves = [s for sample in mine for s in sample["save_s"][1:]]
        steady_loads = [s for sample in mine for s in sample["load_s"][1:]]
        rows[plugin] = {
            "params": mine[0]["params"],
            "size_mb": common.median(s["size_bytes"] for s in mine) / MB,
            "first_save_ms": common.median(s["save_s"][0] for s in mine) * 1e3,
            "save_ms": common.median(steady_saves) * 1e3,
            "save_spread_pct": common.spread_pct(steady_saves),
            "first_load_ms": common.median(s["load_s"][0] for s in mine) * 1e3,
            "load_ms": common.median(steady_loads) * 1e3,
            "load_spread_pct": common.spread_pct(steady_loads),
            "read_ms": common.median(s for sample in mine for s in sample["read_s"][1:]) * 1e3,
        }
    mp, fsdp = rows["model_parallel"], rows["fsdp"]
    return {
        "rows": rows,
        "save_mp_x_fsdp": mp["save_ms"] / fsdp["save_ms"],
        "load_mp_x_fsdp": mp["load_ms"] / fsdp["load_ms"],
    }


def _render_steps(summary: dict[str, Any], args: argparse.Namespace) -> str:
    rows = summary["rows"]
    table = [
        (
            impl,
            f"{row['step_us']:.0f}",
            f"{row['median_gap_us']:.0f}",
            f"{row['spread_pct']:.0f}%",
            "1.00x" if impl == "plain" else f"{summary['trainer_x_plain']:.3f}x",
            "1.00x" if impl == "plain" else f"{summary['trainer_x_plain_median_gap']:.3f}x",
            f"{row['cpu_step_us']:.0f}",
            "1.00x" if impl == "plain" else f"{summary['trainer_x_plain_cpu']:.3f}x",
        )
        for impl, row in rows.items()
    ]
    verdict = "MET" if summary["target_met"] else "MISSED"
    return "\n".join(
        [
            f"[tp=2] step time, 2 processes: {args.depth} x block(width {args.width}, {args.heads} heads), seq "
            f"{args.seq}, batch {args.batch}, AdamW; steps {args.warmup}..{args.steps - 1} timed on rank 0, "
            f"medians of {args.step_repeats} repeat(s)",
            common.format_table(
                [
                    "impl",
                    "us/step",
                    "median gap us",
                    "spread",
                    "x plain",
                    "x plain (gap)",
                    "cpu us/step",
                    "x plain (cpu)",
                ],
                table,
            ),
            f"max |loss trainer - loss plain| over all steps: {summary['max_loss_diff']:.1e}",
            f"target: trainer <= {TARGET_STEP_RATIO:.2f}x plain: {summary['trainer_x_plain']:.3f}x -> {verdict}",
        ]
    )


def _render_checkpoints(summary: dict[str, Any], args: argparse.Namespace) -> str:
    rows = summary["rows"]
    first = next(iter(rows.values()))
    table = [
        (
            plugin,
            f"{row['size_mb']:.1f}",
            f"{row['first_save_ms']:.0f}",
            f"{row['save_ms']:.0f}",
            f"{row['save_spread_pct']:.0f}%",
            f"{row['first_load_ms']:.0f}",
            f"{row['load_ms']:.0f}",
            f"{row['load_spread_pct']:.0f}%",
            f"{row['read_ms']:.0f}",
        )
        for plugin, row in rows.items()
    ]
    headers = [
        "plugin (4 processes)",
        "MB",
        "first save ms",
        "save ms",
        "spread",
        "first load ms",
        "load ms",
        "spread",
        "of it read ms",
    ]
    return "\n".join(
        [
            f"sharded checkpoint: {args.ckpt_depth} x block(width {args.ckpt_width}), {first['params'] / 1e6:.1f} M "
            f"params + AdamW state; {args.ckpt_repeats} job(s) x {args.saves} saves and {args.loads} loads per "
            "plugin (max over ranks; loaded digests equal the saved ones on every rank)",
            common.format_table(headers, table),
            f"model_parallel [dp=2, tp=2] / fsdp [dp=4]: save {summary['save_mp_x_fsdp']:.2f}x, "
            f"load {summary['load_mp_x_fsdp']:.2f}x (read: the plugin's load_checkpoint, DCP into the run's shards; "
            "the rest: checks and set_model/optimizer_state_dict)",
        ]
    )


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat each, fewer steps and saves"
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS)
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats of both parts (overrides the defaults)"
    )
    for key, value in DEFAULTS.items():
        if key != "step_repeats" and key != "ckpt_repeats":
            parser.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {value}")
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"cProfile the timed steps of each step job and the last load of each checkpoint job into {PROFILE_DIR}",
    )
    parser.add_argument("--show-output", action="store_true", help="let the ranks print")
    parser.add_argument("--out", default=str(common.RESULTS_DIR / "model_parallel.json"), help="JSON output")
    args = parser.parse_args(argv)
    preset = {**DEFAULTS, **(QUICK if args.quick else {})}
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.repeats is not None:
        args.step_repeats = args.ckpt_repeats = args.repeats
    args.parts = common.parse_cases(parser, args.parts, PARTS)
    if args.steps - args.warmup < 2:
        parser.error("--steps must exceed --warmup by at least 2")
    if args.saves < 2 or args.loads < 2:
        parser.error("--saves and --loads must be at least 2: the first of a job is shown apart")
    if args.width % args.heads or args.ckpt_width % args.heads or args.heads % max(TP, CKPT_TP):
        parser.error(f"--heads must divide --width and --ckpt-width and be a multiple of {max(TP, CKPT_TP)}")
    return args


def main(argv: Sequence[str]) -> int:
    if "--worker" in argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", required=True)
        parser.add_argument("--result-dir", required=True)
        worker, _ = parser.parse_known_args(argv)
        spec = json.loads(worker.worker)
        common.serve_rank_worker(worker.result_dir, lambda: _run_rank(spec))
        return 0

    args = _parse_args(argv)
    started = time.time()
    base = {
        key: getattr(args, key)
        for key in ("width", "depth", "heads", "seq", "batch", "steps", "warmup", "ckpt_width", "ckpt_depth")
    }
    base.update(saves=args.saves, loads=args.loads, profile=args.profile)
    payload: dict[str, Any] = {
        "benchmark": "model_parallel",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "config": {
            **base,
            "step_repeats": args.step_repeats,
            "ckpt_repeats": args.ckpt_repeats,
            "quick": args.quick,
        },
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "trainer-core"]),
    }
    out = []
    if "step" in args.parts:
        samples = _measure_steps(args, base)
        summary = _summarize_steps(samples)
        payload["step"] = {"summary": summary, "target_max_x_plain": TARGET_STEP_RATIO, "samples": samples}
        out.append(_render_steps(summary, args))
    if "checkpoint" in args.parts:
        samples = _measure_checkpoints_jobs(args, base)
        summary = _summarize_checkpoints(samples)
        payload["checkpoint"] = {"summary": summary, "samples": samples}
        out.append(_render_checkpoints(summary, args))
    if hasattr(os, "getloadavg"):
        load = payload["machine"].get("loadavg", ["?"])[0]
        payload["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        out.append(
            f"load average (1 min) at start {load}, at end {payload['loadavg_end'][0]} on {os.cpu_count()} cores"
        )
    print("\n\n".join(out))
    payload["wall_s"] = round(time.time() - started, 1)
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
