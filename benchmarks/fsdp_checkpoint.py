"""FSDP checkpoint saves at 2 ranks (full: streamed, gathered whole, torch's; vs sharded vs one process), and async saves.

The model is ``--layers`` x ``Linear(--width, --width)`` (ReLU between; 16 x 2048 by default: 67 M
float32 parameters, 268 MB) that has taken one Adam step, so the checkpoint holds the weights and
both Adam moments (about 805 MB). Under FSDP every ``Linear`` is its own ``fully_shard`` unit.
Six cases, each a fresh job per repeat, interleaved and rotated across repeats:

* ``single``        one process, the default plugin, ``trainer.save_checkpoint`` (sync, torch.save + fsync).
* ``fsdp-full``     2 ranks (gloo), ``FSDPPlugin(state_dict_type="full")``: model and optimizer state
                    are gathered to rank 0 in buckets (``plugins/fsdp_gather.py``, one ``dist.gather``
                    per bucket of ``GATHER_BUCKET_BYTES``, or ``--bucket-mb``) while rank 0 writes them
                    into one file, record by record (``StreamedGather``, issue 32).
* ``fsdp-full-whole`` the same with ``fsdp_gather.STREAM_FULL_SAVES = False``: the whole state is gathered
                    first, then rank 0 writes it (``torch.save``): the path before issue 32.
* ``fsdp-full-torch`` the same with ``fsdp_gather.GATHER_BUCKET_BYTES = None``: torch's full state
                    dict (``get_*_state_dict(full_state_dict=True, cpu_offload=True)``), which gathers
                    one tensor at a time to every rank (the path before issue 17).
* ``fsdp-sharded``  2 ranks, ``FSDPPlugin(state_dict_type="sharded")``: every rank writes its own
                    shards into one folder (``DistributedCheckpointIO``, torch.distributed.checkpoint).
* ``async``         one process, ``Trainer(plugins=[AsyncCheckpointIO()])``.

Each job trains one step, then (in ``on_train_end``) saves ``--saves`` times to fresh paths,
removing each checkpoint afterwards (not timed). Before every save the ranks meet at a barrier; a
save's time is the wall time of ``trainer.save_checkpoint`` on each rank, and the max over ranks
counts. The first save of a process is shown apart (it faults in every buffer it allocates: the
async IO's pooled staging buffers, the full gather's output); the others are "steady", the case
of a run that checkpoints every N steps. Every save is also cut into phases per rank by wrapping
the plugin's ``save_checkpoint`` on the instance: ``state`` (``dump_checkpoint``: state dicts,
FSDP's gathers), ``write`` (the plugin's ``save_checkpoint``) and ``barrier`` (waiting for the
other rank). Around every save each rank resets its resident-memory high-water mark
(``/proc/self/clear_refs``) and reads it back (``VmHWM``) after: "peak MB" is rank 0's highest
resident memory during the save above what it held just before it (once the memory earlier saves
freed was handed back with ``malloc_trim``), next to the checkpoint's size. For ``async`` the job also times ``--steps`` training steps with no save in flight
and right after each save (while the background write runs), and when the write ended.

Targets (issue 5, part 8): sharded save at 2 ranks <= 0.6x the full save's time (the full save of
that day, torch's per-tensor gather: ``fsdp-full-torch``); the time an
async save blocks training <= 0.2x the sync save's time (steady saves, medians). Issue 17: the full
save (bucketed gather) at most 1.3x the sharded save; issue 32 meets it by streaming
(``fsdp-full`` against ``fsdp-full-whole``), with rank 0's peak bounded by about a bucket. The ``state`` phase of the two full cases is
the gather (torch's against the buckets); their ``write`` phase is the same ``torch.save`` of the
same dict by rank 0, which the sharded case splits between two writers; streamed, the gather moves
from ``state`` into ``write``, where it overlaps the writing.

On the sandbox this was written on, ``fsync`` of a freshly written file costs little (the disk
behind it is fast or virtual) and a save is bounded by copying bytes into the page cache, a
memory-bandwidth cost; on a real disk or network filesystem the write takes longer and both
sharding (two writers) and async (off the training thread) gain more than measured here.

    python benchmarks/fsdp_checkpoint.py             # 4 repeats x 4 saves (about 4 minutes on 2 cores)
    python benchmarks/fsdp_checkpoint.py --quick     # smoke: 4 x 512, 1 repeat
    python benchmarks/fsdp_checkpoint.py --profile   # + cProfile of one save per rank, 2-rank cases
    python benchmarks/fsdp_checkpoint.py --cases fsdp-full,fsdp-sharded --bucket-mb 64   # another bucket
    python benchmarks/fsdp_checkpoint.py --cases fsdp-full,fsdp-full-whole,fsdp-sharded   # issue 32's figures
"""

from __future__ import annotations

import argparse
import functools
import gc
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

CASES = ("single", "fsdp-full", "fsdp-full-whole", "fsdp-full-torch", "fsdp-sharded", "async")
WORLD_SIZE = {
    "single": 1,
    "fsdp-full": 2,
    "fsdp-full-whole": 2,
    "fsdp-full-torch": 2,
    "fsdp-sharded": 2,
    "async": 1,
}
DEFAULT_WIDTH, DEFAULT_LAYERS = 2048, 16
QUICK_WIDTH, QUICK_LAYERS = 512, 4
DEFAULT_REPEATS, DEFAULT_SAVES, DEFAULT_STEPS = 4, 4, 3
BATCH_SIZE = 8
TARGET_SHARDED_X_FULL = 0.6
TARGET_ASYNC_X_SYNC = 0.2
TARGET_FULL_X_SHARDED = 1.3
JOB_TIMEOUT_S = 600.0
PROFILE_DIR = common.RESULTS_DIR / "profile"
MB = 1e6

# ----------------------------------------------------------------------------- worker side


def _build_module(width: int, layers: int, on_train_end: Callable[[Any], None]) -> Any:
    import torch
    import torch.nn.functional as F

    import trainer_core

    class StackModule(trainer_core.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            blocks: list[torch.nn.Module] = []
            for i in range(layers):
                if i:
                    blocks.append(torch.nn.ReLU())
                blocks.append(torch.nn.Linear(width, width))
            self.net = torch.nn.Sequential(*blocks)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def on_train_end(self) -> None:
            on_train_end(self.trainer)

    return StackModule()


def _plugins(case: str) -> Optional[list[Any]]:
    import torch

    if case == "single":
        return None
    if case == "async":
        from trainer_core.plugins.io.async_io import AsyncCheckpointIO

        return [AsyncCheckpointIO()]
    from trainer_core.plugins.fsdp import FSDPPlugin

    state_dict_type = "sharded" if case == "fsdp-sharded" else "full"
    return [FSDPPlugin(state_dict_type=state_dict_type, auto_wrap_policy={torch.nn.Linear})]


def _set_gather(case: str, bucket_mb: Optional[float]) -> None:
    """``fsdp-full-torch``: torch's per-tensor gather; otherwise the buckets, of ``--bucket-mb`` if given;
    ``fsdp-full-whole``: gathered whole before the write."""
    from trainer_core.plugins import fsdp_gather

    fsdp_gather.STREAM_FULL_SAVES = case != "fsdp-full-whole"
    if case == "fsdp-full-torch":
        fsdp_gather.GATHER_BUCKET_BYTES = None
    elif bucket_mb is not None:
        fsdp_gather.GATHER_BUCKET_BYTES = int(bucket_mb * 2**20)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _resident_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in bytes; 0 off Linux."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Start ``VmHWM`` over from the resident size now (Linux 4.0+; nothing elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _size_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


class SavePhases:
    """Marks inside one ``trainer.save_checkpoint``: when the plugin's write began and ended."""

    def __init__(self, plugin: Any) -> None:
        self.write_start = self.write_end = 0.0
        original: Callable[..., Any] = plugin.save_checkpoint

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.write_start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.write_end = time.perf_counter()

        plugin.save_checkpoint = timed  # the instance only; the class stays untouched

    def split(self, start: float, end: float) -> dict[str, float]:
        return {
            "state_s": self.write_start - start,
            "write_s": self.write_end - self.write_start,
            "barrier_s": end - self.write_end,
        }


class WriteClock:
    """When the async IO's background write of the latest save ended (wraps the wrapped IO's save)."""

    def __init__(self, async_io: Any) -> None:
        self.end = 0.0
        inner = async_io.checkpoint_io
        original: Callable[..., Any] = inner.save_checkpoint

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self.end = time.perf_counter()

        inner.save_checkpoint = timed


def _train_steps(module: Any, optimizer: Any, batch: Any, steps: int) -> float:
    """Seconds for ``steps`` plain forward/backward/Adam steps: the training a save would hold up."""
    start = time.perf_counter()
    for _ in range(steps):
        module.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return time.perf_counter() - start


def _measure_saves(trainer: Any, case: str, saves: int, steps: int, profile_dir: Optional[str]) -> dict:
    import torch

    from trainer_core.checkpoint.stream import release_freed_memory

    plugin = trainer.plugin
    rank = plugin.global_rank
    folder = Path.cwd() / "ckpt"  # rank 1 runs in the same working directory as rank 0
    phases = SavePhases(plugin)
    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    async_io = plugin.checkpoint_io if case == "async" else None
    write_clock = WriteClock(async_io) if async_io is not None else None
    batch = (
        torch.randn(BATCH_SIZE, module.net[0].in_features),
        torch.randn(BATCH_SIZE, module.net[0].in_features),
    )
    baseline_steps_s = _train_steps(module, optimizer, batch, steps) if async_io is not None else None
    records = []
    for index in range(saves):
        path = folder / f"save-{index}.ckpt"
        profiler = None
        if profile_dir and index == saves - 1:
            import cProfile

            profiler = cProfile.Profile()
        gc.collect()
        release_freed_memory()  # what earlier saves freed goes back: the peak counts this save's memory
        before_rss = _resident_bytes("VmRSS")
        _barrier()
        _reset_peak()
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        end = time.perf_counter()
        peak = _resident_bytes("VmHWM") - before_rss
        if profiler is not None:
            profiler.disable()
            common.write_profile(profiler, Path(profile_dir) / f"fsdp_checkpoint-{case}-rank{rank}.prof")
        record = {"save": index, "save_s": end - start, "peak_bytes": peak, **phases.split(start, end)}
        if async_io is not None:
            record["steps_during_write_s"] = _train_steps(module, optimizer, batch, steps)
            async_io.wait()
            record["write_done_s"] = write_clock.end - start
        _barrier()
        if rank == 0:
            record["size_bytes"] = _size_bytes(path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        records.append(record)
    return {"saves": records, "baseline_steps_s": baseline_steps_s, "plugin": type(plugin).__name__}


def run_rank(
    case: str,
    width: int,
    layers: int,
    saves: int,
    steps: int,
    profile_dir: Optional[str],
    bucket_mb: Optional[float] = None,
) -> dict:
    """One rank of one job: fit for one step, then measure ``saves`` saves in ``on_train_end``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import trainer_core

    _set_gather(case, bucket_mb)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    measured: dict[str, Any] = {}

    world = WORLD_SIZE[case]
    n = BATCH_SIZE * world
    loader = DataLoader(TensorDataset(torch.randn(n, width), torch.randn(n, width)), batch_size=BATCH_SIZE)
    module = _build_module(
        width,
        layers,
        lambda trainer: measured.update(_measure_saves(trainer, case, saves, steps, profile_dir)),
    )
    params = sum(p.numel() for p in module.parameters())
    trainer = trainer_core.Trainer(
        accelerator="cpu",
        devices=world,
        plugins=_plugins(case),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(Path.cwd()),
    )
    trainer.fit(module, train_dataloaders=loader)
    if not measured:
        raise RuntimeError("on_train_end never ran: nothing was saved")
    if trainer.global_step != 1:
        raise RuntimeError(f"fit took {trainer.global_step} optimizer steps, expected 1")
    _barrier()  # rank 0 must not end the job before rank 1 has reported
    return {"params": params, **measured}


def _worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=CASES, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--saves", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--bucket-mb", type=float, default=None)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args(argv)
    common.serve_rank_worker(
        args.result_dir,
        lambda: run_rank(
            args.worker, args.width, args.layers, args.saves, args.steps, args.profile_dir, args.bucket_mb
        ),
    )
    return 0


# ----------------------------------------------------------------------------- parent side


def _run_job(case: str, args: argparse.Namespace, profile_dir: Optional[Path] = None) -> dict:
    command = [str(Path(__file__).resolve()), "--worker", case, "--width", str(args.width)]
    command += ["--layers", str(args.layers), "--saves", str(args.saves), "--steps", str(args.steps)]
    if profile_dir is not None:
        command += ["--profile-dir", str(profile_dir)]
    if args.bucket_mb is not None:
        command += ["--bucket-mb", str(args.bucket_mb)]
    return common.run_rank_job(command, WORLD_SIZE[case], timeout=JOB_TIMEOUT_S, show_output=args.show_output)


def _samples_of_job(case: str, repeat: int, job: dict) -> list[dict]:
    """One sample per save: the max over ranks, and every rank's phases."""
    ranks = job["ranks"]
    samples = []
    for index, rank0 in enumerate(ranks[0]["saves"]):
        per_rank = [r["saves"][index] for r in ranks]
        sample = {
            "case": case,
            "repeat": repeat,
            "save": index,
            "save_s": max(s["save_s"] for s in per_rank),
            "size_bytes": rank0["size_bytes"],
            "ranks": per_rank,
            "params": ranks[0]["params"],
        }
        if case == "async":
            sample["baseline_steps_s"] = ranks[0]["baseline_steps_s"]
        samples.append(sample)
    return samples


def _measure(args: argparse.Namespace) -> tuple[list[dict], dict[str, str]]:
    samples: list[dict] = []
    failures: dict[str, str] = {}
    for repeat in range(args.repeats):
        for case in common.rotated(args.cases, repeat):
            if case in failures:
                continue
            try:
                job = _run_job(case, args)
            except common.WorkerError as err:
                failures[case] = str(err)
                common.log(f"{case} failed; dropping it from this run:\n{err}")
                continue
            mine = _samples_of_job(case, repeat, job)
            samples += mine
            times = " ".join(f"{s['save_s']:.2f}" for s in mine)
            common.log(
                f"[{repeat + 1}/{args.repeats}] {case:<13} saves {times} s  (job {job['job_s']:.1f} s)"
            )
    return samples, failures


def _summarize(samples: list[dict], cases: list[str]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for case in cases:
        mine = [s for s in samples if s["case"] == case]
        if not mine:
            continue
        steady = [s for s in mine if s["save"] > 0] or mine
        first = [s for s in mine if s["save"] == 0]
        world = len(mine[0]["ranks"])
        row: dict[str, Any] = {
            "case": case,
            "ranks": world,
            "params": mine[0]["params"],
            "size_mb": common.median(s["size_bytes"] for s in mine) / MB,
            "first_save_s": common.median(s["save_s"] for s in first),
            "save_s": common.median(s["save_s"] for s in steady),
            "save_spread_pct": common.spread_pct(s["save_s"] for s in steady),
            "best_save_s": min((s["save_s"] for s in steady), default=float("nan")),
            "samples": len(steady),
            "phases": [
                {
                    key: common.median(s["ranks"][rank][key] for s in steady)
                    for key in ("save_s", "state_s", "write_s", "barrier_s", "peak_bytes")
                }
                for rank in range(world)
            ],
        }
        row["mb_per_s"] = row["size_mb"] / row["save_s"] if row["save_s"] else float("nan")
        if case == "async":
            row["write_done_s"] = common.median(s["ranks"][0]["write_done_s"] for s in steady)
            row["baseline_steps_s"] = common.median(s["baseline_steps_s"] for s in mine)
            row["steps_during_write_s"] = common.median(s["ranks"][0]["steps_during_write_s"] for s in steady)
            row["training_lost_s"] = common.median(
                s["save_s"] + s["ranks"][0]["steps_during_write_s"] - s["baseline_steps_s"] for s in steady
            )
        rows[case] = row
    return rows


def _ratio(rows: dict[str, dict], num: str, den: str, key: str = "save_s") -> Optional[float]:
    if num not in rows or den not in rows or not rows[den][key]:
        return None
    return rows[num][key] / rows[den][key]


def _targets(rows: dict[str, dict], failures: dict[str, str]) -> dict[str, Any]:
    # Issue 5's target was set against the full save of its day, torch's one-tensor-at-a-time gather
    # (``fsdp-full-torch``); the bucketed full save of issue 17 is meant to come close to the sharded one.
    sharded = _ratio(rows, "fsdp-sharded", "fsdp-full-torch")
    blocked = _ratio(rows, "async", "single")
    full = _ratio(rows, "fsdp-full", "fsdp-sharded")
    return {
        "whole_x_sharded": _ratio(rows, "fsdp-full-whole", "fsdp-sharded"),
        "streamed_x_whole": _ratio(rows, "fsdp-full", "fsdp-full-whole"),
        "full_x_sharded": full,
        "full_met": full is not None and full <= TARGET_FULL_X_SHARDED,
        "full_torch_x_sharded": _ratio(rows, "fsdp-full-torch", "fsdp-sharded"),
        "full_x_full_torch": _ratio(rows, "fsdp-full", "fsdp-full-torch"),
        "gather_x_torch_gather": _state_ratio(rows, "fsdp-full", "fsdp-full-torch"),
        "sharded_x_full": sharded,
        "sharded_met": sharded is not None and sharded <= TARGET_SHARDED_X_FULL,
        "async_x_sync": blocked,
        "async_met": blocked is not None and blocked <= TARGET_ASYNC_X_SYNC,
        "async_first_x_sync_first": _ratio(rows, "async", "single", "first_save_s"),
        "failures": sorted(failures),
    }


def _state_ratio(rows: dict[str, dict], num: str, den: str) -> Optional[float]:
    """Rank 0's ``state`` phase (``dump_checkpoint``, where the full cases gather) of ``num`` over ``den``."""
    if num not in rows or den not in rows or not rows[den]["phases"][0]["state_s"]:
        return None
    return rows[num]["phases"][0]["state_s"] / rows[den]["phases"][0]["state_s"]


def _fmt(value: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _verdict(ratio: Optional[float], met: bool) -> str:
    if ratio is None:
        return "NOT MEASURED (a case was not run or failed)"
    return "MET" if met else "MISSED"


def _render_async(sync: dict, async_: dict, targets: dict[str, Any], steps: int) -> str:
    headers = (
        "one process", "blocks s", "x sync", "first s", "x sync first", "write done s",
        f"{steps} steps idle s", "during write s", "lost s",
    )  # fmt: skip
    sync_row = ("sync (single)", sync["save_s"], "1.00x", sync["first_save_s"], "1.00x", sync["save_s"], "-", "-", sync["save_s"])  # fmt: skip
    async_row = (
        "async",
        async_["save_s"],
        _fmt(targets["async_x_sync"], ".2f", "x"),
        async_["first_save_s"],
        _fmt(targets["async_first_x_sync_first"], ".2f", "x"),
        async_["write_done_s"],
        async_["baseline_steps_s"],
        async_["steps_during_write_s"],
        async_["training_lost_s"],
    )
    table = [[f"{c:.2f}" if isinstance(c, float) else c for c in row] for row in (sync_row, async_row)]
    note = (
        "lost: training time the save costs = blocks + how much longer the steps ran while the background "
        "write competed with them for the 2 cores and the memory bandwidth"
    )
    return common.format_table(headers, table) + "\n" + note


def _render(rows: dict[str, dict], targets: dict[str, Any], args: argparse.Namespace) -> str:
    out = []
    first = next(iter(rows.values()), None)
    if first is not None:
        out.append(
            f"model: {args.layers} x Linear({args.width}, {args.width}), {first['params'] / 1e6:.1f} M float32 "
            f"params, Adam stepped once; {args.repeats} jobs x {args.saves} saves per case "
            f"(first save of each job apart, 'save s' = median of the others, max over ranks)"
        )
    table = []
    for case, row in rows.items():
        phases = " | ".join(
            f"{p['state_s']:.2f}/{p['write_s']:.2f}/{p['barrier_s']:.2f}" for p in row["phases"]
        )
        table.append(
            (
                case,
                row["ranks"],
                f"{row['size_mb']:.0f}",
                f"{row['first_save_s']:.2f}",
                f"{row['save_s']:.2f}",
                f"{row['best_save_s']:.2f}",
                f"{row['save_spread_pct']:.0f}%",
                f"{row['mb_per_s']:.0f}",
                f"{row['phases'][0]['peak_bytes'] / MB:.0f}",
                phases,
            )
        )
    headers = (
        "case",
        "ranks",
        "MB",
        "first s",
        "save s",
        "best s",
        "spread",
        "MB/s",
        "peak MB r0",
        "state/write/barrier s (rank 0 | 1)",
    )
    out.append(common.format_table(headers, table, align="<>>>>>>>><"))
    out.append(
        "peak MB r0: rank 0's highest resident memory during a save (median) above its resident memory "
        "just before; MB: the checkpoint's size; best s: the fastest steady save (on a virtual machine a save "
        "that lands on memory the host took back stalls for about a second, whatever the case)"
    )
    if "single" in rows and "fsdp-sharded" in rows:
        out.append(
            "one writer, one file (single/sharded): "
            f"median {_fmt(_ratio(rows, 'single', 'fsdp-sharded'), '.2f', 'x')}, "
            f"best {_fmt(_ratio(rows, 'single', 'fsdp-sharded', 'best_save_s'), '.2f', 'x')}; "
            "streamed full/sharded: "
            f"median {_fmt(_ratio(rows, 'fsdp-full', 'fsdp-sharded'), '.2f', 'x')}, "
            f"best {_fmt(_ratio(rows, 'fsdp-full', 'fsdp-sharded', 'best_save_s'), '.2f', 'x')}"
        )
    if "fsdp-full-whole" in rows:
        out.append(
            f"full saves (save s), issue 32: streamed/sharded {_fmt(targets['full_x_sharded'], '.2f', 'x')}  "
            f"gathered whole/sharded (before) {_fmt(targets['whole_x_sharded'], '.2f', 'x')}  "
            f"streamed/whole {_fmt(targets['streamed_x_whole'], '.2f', 'x')}"
        )
    if "fsdp-full" in rows or "fsdp-full-torch" in rows:
        out.append(
            f"full saves (save s): bucketed/sharded {_fmt(targets['full_x_sharded'], '.2f', 'x')}  "
            f"torch/sharded {_fmt(targets['full_torch_x_sharded'], '.2f', 'x')}  "
            f"bucketed/torch {_fmt(targets['full_x_full_torch'], '.2f', 'x')}; "
            f"gather (rank 0 state s) bucketed/torch {_fmt(targets['gather_x_torch_gather'], '.2f', 'x')}"
        )
    out.append(
        f"ratios (save s): sharded/full {_fmt(_ratio(rows, 'fsdp-sharded', 'fsdp-full'), '.2f', 'x')}  "
        f"full/single {_fmt(_ratio(rows, 'fsdp-full', 'single'), '.2f', 'x')}  "
        f"sharded/single {_fmt(_ratio(rows, 'fsdp-sharded', 'single'), '.2f', 'x')}"
    )
    if "async" in rows and "single" in rows:
        out.append("")
        out.append(_render_async(rows["single"], rows["async"], targets, args.steps))
    out.append("")
    out.append(
        f"target (issue 5): sharded save at 2 ranks <= {TARGET_SHARDED_X_FULL:.2f}x the full save with torch's "
        "per-tensor gather: "
        f"{_fmt(targets['sharded_x_full'], '.2f', 'x')} -> {_verdict(targets['sharded_x_full'], targets['sharded_met'])}"
    )
    out.append(
        f"target (issues 17, 32): full save at 2 ranks <= {TARGET_FULL_X_SHARDED:.2f}x the sharded save: "
        f"{_fmt(targets['full_x_sharded'], '.2f', 'x')} -> {_verdict(targets['full_x_sharded'], targets['full_met'])}"
    )
    out.append(
        f"target: async save blocks training <= {TARGET_ASYNC_X_SYNC:.2f}x the sync save: "
        f"{_fmt(targets['async_x_sync'], '.2f', 'x')} -> {_verdict(targets['async_x_sync'], targets['async_met'])}"
    )
    return "\n".join(out)


def _profile(args: argparse.Namespace) -> None:
    """One more job per 2-rank case, with cProfile around its last save on every rank."""
    for case in [c for c in args.cases if WORLD_SIZE[c] > 1]:
        _run_job(case, args, profile_dir=PROFILE_DIR)
        for rank in range(WORLD_SIZE[case]):
            common.log(f"profile: {PROFILE_DIR / f'fsdp_checkpoint-{case}-rank{rank}.txt'}")


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"jobs per case (default {DEFAULT_REPEATS})"
    )
    parser.add_argument(
        "--saves", type=int, default=DEFAULT_SAVES, help="saves per job (the first is shown apart)"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="training steps timed after an async save"
    )
    parser.add_argument("--width", type=int, default=None, help=f"Linear width (default {DEFAULT_WIDTH})")
    parser.add_argument("--layers", type=int, default=None, help=f"Linear layers (default {DEFAULT_LAYERS})")
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: 1 repeat, {QUICK_LAYERS} x {QUICK_WIDTH}"
    )
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES)
    )
    parser.add_argument(
        "--profile", action="store_true", help=f"cProfile one save per rank into {PROFILE_DIR}"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="bytes per gather of the fsdp-full case, in MiB (default: fsdp_gather.GATHER_BUCKET_BYTES)",
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    parser.add_argument("--show-output", action="store_true", help="let the ranks print")
    parser.add_argument("--out", default=str(common.RESULTS_DIR / "fsdp_checkpoint.json"), help="JSON output")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    if args.width is None:
        args.width = QUICK_WIDTH if args.quick else DEFAULT_WIDTH
    if args.layers is None:
        args.layers = QUICK_LAYERS if args.quick else DEFAULT_LAYERS
    if args.saves < 2:
        parser.error("--saves must be at least 2: the first save of a job is shown apart")
    args.cases = common.parse_cases(parser, args.cases, CASES)
    return args


def main(argv: Sequence[str]) -> int:
    if "--worker" in argv:
        return _worker_main(argv)
    args = _parse_args(argv)
    started = time.time()
    samples, failures = _measure(args)
    rows = _summarize(samples, args.cases)
    targets = _targets(rows, failures)
    print(_render(rows, targets, args))
    for case, error in failures.items():
        print(f"{case} failed: {error.strip().splitlines()[-1]}")
    if args.profile:
        _profile(args)
    payload = {
        "benchmark": "fsdp_checkpoint",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "config": {
            "width": args.width,
            "layers": args.layers,
            "repeats": args.repeats,
            "saves_per_job": args.saves,
            "steps_after_async_save": args.steps,
            "cases": args.cases,
            "batch_size": BATCH_SIZE,
            "bucket_mb": args.bucket_mb,
        },
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "trainer-core"]),
        "failures": failures,
        "summary": rows,
        "targets": {
            "sharded_max_x_full": TARGET_SHARDED_X_FULL,
            "async_max_x_sync": TARGET_ASYNC_X_SYNC,
            "full_max_x_sharded": TARGET_FULL_X_SHARDED,
            **targets,
        },
        "samples": samples,
    }
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path}")
    met = targets["sharded_met"] and targets["async_met"] and targets["full_met"] and not failures
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
