"""Peak memory per rank while ``trainer.save_checkpoint`` consolidates a sharded optimizer's state.

Two ranks (``Trainer(devices=2)``, gloo on 127.0.0.1) train a model of ``--layers`` x
Linear(``--width``, ``--width``) with Adam for two steps, then every rank calls
``trainer.save_checkpoint`` from ``on_train_end``. With the defaults (4 x 3072) the parameters are
144 MiB and Adam's full state (``exp_avg`` + ``exp_avg_sq``) 288 MiB, half of it on each rank when
sharded. Cases:

* ``ddp_sharded``  the plugin wraps Adam in fairscale ``OSS``.
* ``zero``         the plugin wraps Adam in torch ``ZeroRedundancyOptimizer``.
* ``ddp+oss``      plain ``"ddp"``; the user returns ``OSS(..., optim=Adam)`` from ``configure_optimizers``.
* ``ddp+zero``     plain ``"ddp"``; the user returns ``ZeroRedundancyOptimizer(..., Adam)``.
* ``ddp``          plain ``"ddp"`` with plain Adam (not sharded): what writing the file costs alone.

Each rank resets its peak-RSS counter (``/proc/self/clear_refs`` <- ``5``) right before the save,
after a ``gc.collect()`` and a barrier, and reads ``VmHWM`` after it: ``peak extra`` is that peak
minus the RSS before the save. The save is also cut into phases (by wrapping, on the instances only,
the optimizer's ``consolidate_state_dict`` and ``state_dict`` and the checkpoint IO's
``save_checkpoint``), the peak counter being read and reset at every boundary, so the table shows
which phase holds the peak. Each case runs ``--repeats`` times (interleaved); medians are shown.

Targets (issue 4, part 5): rank 0 adds at most about one full copy of the optimizer state
(<= 1.10x), the other ranks about nothing (<= 0.05x). JSON: ``bench_results/consolidate.json``.

Second figure (``--figure offline``, issue 17): peak memory of ``python -m trainer_core.checkpoint
consolidate`` against the checkpoint's size. A sharded folder (``torch.distributed.checkpoint``,
one process) of tensors of ``--tensor-mib`` each is made at every size, then consolidated in a
fresh process per case, side by side:

* ``whole->torch``        the folder read whole (``DistributedCheckpointIO.load_checkpoint``), then
  ``TorchCheckpointIO.save_checkpoint``: what ``consolidate`` did before it streamed.
* ``stream->torch``       ``consolidate SHARDED_DIR OUT``: one tensor at a time into the zip.
* ``whole->safetensors``  the folder read whole, then ``safetensors.torch.save_file`` of the state_dict
  (the library's writer, which takes a whole file's tensors at once).
* ``stream->safetensors`` ``consolidate SHARDED_DIR --to safetensors OUT_DIR``.

Peak = ``VmHWM`` minus ``VmRSS`` right before the call (``clear_refs`` reset; nothing is memory-
mapped in these cases, so RSS is private memory). Target: at most the largest tensor plus a fixed
32 MiB, whatever the size. Sizes: 40, 80 MiB of 10 MiB tensors (``--quick``); 100, 400 MiB
(default) and 100, 400, 800 MiB (``--full``) of 25 MiB tensors.

    python benchmarks/consolidate.py             # 3 repeats, all cases (about 5 minutes on 2 cores)
    python benchmarks/consolidate.py --quick     # smoke: 1 repeat, 4 x 1024, offline 40/80 MiB
    python benchmarks/consolidate.py --figure offline --full   # only the CLI figure, up to 800 MiB
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

CASES = ("ddp_sharded", "zero", "ddp+oss", "ddp+zero", "ddp")
PLUGIN_OF_CASE = {
    "ddp_sharded": "ddp_sharded",
    "zero": "zero",
    "ddp+oss": "ddp",
    "ddp+zero": "ddp",
    "ddp": "ddp",
}
WORLD_SIZE = 2
DEFAULT_WIDTH, DEFAULT_LAYERS = 3072, 4
DEFAULT_REPEATS = 3
STEPS = 2
BATCH_SIZE = 4
TARGET_RANK0 = 1.10  # extra peak RSS, as a multiple of the full optimizer state
TARGET_OTHERS = 0.05
JOB_TIMEOUT_S = 600.0
MIB = 2**20

# ----------------------------------------------------------------------------- worker side


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Set this process's peak RSS (VmHWM) back to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PhaseMeter:
    """Peak RSS above a baseline, per phase: ``mark(name)`` ends the phase running since the last mark."""

    def __init__(self) -> None:
        self.base_kib = _status_kib("VmRSS")
        self.phases: list[dict[str, Any]] = []
        self._since = time.perf_counter()
        _reset_peak_rss()

    def mark(self, name: str) -> None:
        peak, rss, now = _status_kib("VmHWM"), _status_kib("VmRSS"), time.perf_counter()
        self.phases.append(
            {
                "phase": name,
                "peak_extra_mib": (peak - self.base_kib) / 1024,
                "rss_extra_mib": (rss - self.base_kib) / 1024,
                "s": now - self._since,
            }
        )
        _reset_peak_rss()
        self._since = time.perf_counter()

    @property
    def peak_extra_mib(self) -> float:
        return max(p["peak_extra_mib"] for p in self.phases)


def _wrap(obj: Any, name: str, meter: PhaseMeter, before: str, after: str) -> None:
    """Mark the meter around ``obj.name(...)`` (an instance attribute; the class stays untouched)."""
    original: Callable[..., Any] = getattr(obj, name)

    @functools.wraps(original)  # keeps the signature: the plugin asks whether it takes `to`
    def measured(*args: Any, **kwargs: Any) -> Any:
        meter.mark(before)
        result = original(*args, **kwargs)
        meter.mark(after)
        return result

    setattr(obj, name, measured)


def _state_bytes(state: dict) -> int:
    total = 0
    for per_param in state.values():
        for value in per_param.values():
            if hasattr(value, "nbytes"):
                total += value.nbytes
    return total


def _local_state(optimizer: Any) -> dict:
    inner = getattr(optimizer, "optim", optimizer)  # OSS and ZeRO keep their shard's optimizer in .optim
    return inner.state


def run_rank(case: str, width: int, layers: int) -> dict[str, Any]:
    """Worker entry: one rank of one case; the save happens in ``on_train_end``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import trainer_core

    torch.set_num_threads(1)
    measured: dict[str, Any] = {}

    class Model(trainer_core.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if case == "ddp+oss":
                from fairscale.optim import OSS

                return OSS(self.parameters(), optim=torch.optim.Adam, lr=1e-3)
            if case == "ddp+zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def on_train_end(self) -> None:
            measured.update(_measure_save(self.trainer, Path(folder) / "last.ckpt"))

    n = BATCH_SIZE * STEPS * WORLD_SIZE
    loader = DataLoader(TensorDataset(torch.randn(n, width), torch.randn(n, width)), batch_size=BATCH_SIZE)
    # Rank 1 is this script run again, in the same working directory: the folder must be one both find.
    folder = os.path.join(os.getcwd(), "ckpt")
    os.makedirs(folder, exist_ok=True)
    trainer = trainer_core.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        plugins=PLUGIN_OF_CASE[case],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
    )
    trainer.fit(Model(), train_dataloaders=loader)
    if not measured:
        raise RuntimeError("on_train_end never ran: the checkpoint was not saved")
    if dist.is_initialized():
        dist.barrier()  # rank 0 must not exit (and end the job) before rank 1 has measured
    return measured


def _measure_save(trainer: Any, path: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    optimizer = trainer.optimizers[0]
    sharded = callable(getattr(optimizer, "consolidate_state_dict", None))
    local_bytes = _state_bytes(_local_state(optimizer))
    total = torch.tensor([local_bytes], dtype=torch.int64)
    if sharded:
        dist.all_reduce(total)
    full_bytes = int(total.item())
    param_bytes = sum(p.nbytes for p in trainer.lightning_module.parameters())

    gc.collect()
    dist.barrier()
    meter = PhaseMeter()
    rss_before_mib = meter.base_kib / 1024
    if sharded:
        _wrap(optimizer, "consolidate_state_dict", meter, "dump: module state, hooks", "consolidate")
    _wrap(optimizer, "state_dict", meter, "dump: before state_dict", "state_dict")
    _wrap(trainer.strategy.checkpoint_io, "save_checkpoint", meter, "dump: names, rng, hooks", "write file")
    start = time.perf_counter()
    trainer.save_checkpoint(path)
    save_s = time.perf_counter() - start
    meter.mark("after write: barrier, free")
    gc.collect()
    return {
        "sharded": sharded,
        "optimizer": type(optimizer).__name__,
        "param_mib": param_bytes / MIB,
        "full_state_mib": full_bytes / MIB,
        "local_state_mib": local_bytes / MIB,
        "rss_before_mib": rss_before_mib,
        "peak_extra_mib": meter.peak_extra_mib,
        "rss_after_extra_mib": _status_kib("VmRSS") / 1024 - rss_before_mib,
        "save_s": save_s,
        "file_mib": path.stat().st_size / MIB if path.exists() else None,
        "phases": meter.phases,
    }


def _worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=CASES, required=True)
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args(argv)
    common.serve_rank_worker(args.result_dir, lambda: run_rank(args.worker, args.width, args.layers))
    return 0


# ----------------------------------------------------------------------------- parent side


def _measure(args: argparse.Namespace) -> tuple[list[dict], dict[str, str]]:
    samples: list[dict] = []
    failures: dict[str, str] = {}
    for repeat in range(args.repeats):
        for case in common.rotated(args.cases, repeat):
            if case in failures:
                continue
            command = [str(Path(__file__).resolve()), "--worker", case, "--width", str(args.width)]
            command += ["--layers", str(args.layers)]
            try:
                job = common.run_rank_job(
                    command, WORLD_SIZE, timeout=JOB_TIMEOUT_S, show_output=args.show_output
                )
            except common.WorkerError as err:
                failures[case] = str(err)
                common.log(f"{case} failed; dropping it from this run:\n{err}")
                continue
            for rank, result in enumerate(job["ranks"]):
                result = {k: v for k, v in result.items() if k != "pid"}
                samples.append({"case": case, "repeat": repeat, "rank": rank, **result})
            r0, r1 = job["ranks"]
            common.log(
                f"[{repeat + 1}/{args.repeats}] {case:<12} full state {r0['full_state_mib']:6.1f} MiB  peak extra "
                f"{r0['peak_extra_mib']:6.1f} / {r1['peak_extra_mib']:6.1f} MiB (rank 0/1)  save {r0['save_s']:.2f} s"
            )
    return samples, failures


def _summarize(samples: list[dict], cases: list[str]) -> list[dict]:
    rows = []
    for case in cases:
        for rank in range(WORLD_SIZE):
            mine = [s for s in samples if s["case"] == case and s["rank"] == rank]
            if not mine:
                continue
            full = common.median(s["full_state_mib"] for s in mine)
            phase_names = [p["phase"] for p in mine[0]["phases"]]
            phases = {
                name: common.median(
                    next(p["peak_extra_mib"] for p in s["phases"] if p["phase"] == name) for s in mine
                )
                for name in phase_names
            }
            peak = common.median(s["peak_extra_mib"] for s in mine)
            limit = TARGET_RANK0 if rank == 0 else TARGET_OTHERS
            rows.append(
                {
                    "case": case,
                    "rank": rank,
                    "repeats": len(mine),
                    "optimizer": mine[0]["optimizer"],
                    "full_state_mib": full,
                    "local_state_mib": common.median(s["local_state_mib"] for s in mine),
                    "rss_before_mib": common.median(s["rss_before_mib"] for s in mine),
                    "peak_extra_mib": peak,
                    "peak_extra_x_full": peak / full if full else float("nan"),
                    "rss_after_extra_mib": common.median(s["rss_after_extra_mib"] for s in mine),
                    "save_s": common.median(s["save_s"] for s in mine),
                    "phase_peaks_mib": phases,
                    "peak_phase": max(phases, key=phases.get) if phases else None,
                    "target_x_full": limit,
                    "ok": peak / full <= limit if full else False,
                }
            )
    return rows


def _print_table(rows: list[dict]) -> None:
    table = [
        (
            r["case"],
            r["rank"],
            r["optimizer"],
            f"{r['full_state_mib']:.0f}",
            f"{r['local_state_mib']:.0f}",
            f"{r['rss_before_mib']:.0f}",
            f"{r['peak_extra_mib']:.0f}",
            f"{r['peak_extra_x_full']:.2f}x",
            f"<= {r['target_x_full']:.2f}x {'ok' if r['ok'] else 'OVER'}",
            f"{r['rss_after_extra_mib']:.0f}",
            f"{r['save_s']:.2f}",
            f"{r['peak_phase']} ({r['phase_peaks_mib'][r['peak_phase']]:.0f})" if r["peak_phase"] else "-",
        )
        for r in rows
    ]
    headers = (
        "case", "rank", "optimizer", "full MiB", "local MiB", "RSS MiB", "peak+ MiB", "x full", "target",
        "kept MiB", "save s", "peak phase (MiB)",
    )  # fmt: skip
    print(common.format_table(headers, table, align="<><>>>>><>><"))
    print("peak+: peak RSS added during save_checkpoint; kept: RSS still added after it (gc.collect() done)")
    print()
    print("peak extra MiB per phase of the save (medians)")
    names: list[str] = []
    for r in rows:
        names += [n for n in r["phase_peaks_mib"] if n not in names]
    phase_table = [
        [r["case"], r["rank"]]
        + [f"{r['phase_peaks_mib'][n]:.0f}" if n in r["phase_peaks_mib"] else "-" for n in names]
        for r in rows
    ]
    print(common.format_table(["case", "rank", *names], phase_table))


# ----------------------------------------------------------------------------- offline consolidation (issue 17)
OFFLINE_CASES = ("whole->torch", "stream->torch", "whole->safetensors", "stream->safetensors")
OFFLINE_TENSOR_MIB = 25
OFFLINE_TARGET_FIXED_MIB = 32  # allowed on top of the largest tensor


def _offline_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in a fresh process: make a folder (``make``) or consolidate it one way."""
    import torch

    torch.set_num_threads(1)
    folder = spec["folder"]
    if spec["case"] == "make":
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

        count = spec["size_mib"] // spec["tensor_mib"]
        numel = spec["tensor_mib"] * MIB // 4
        state = {f"layers.{i}.weight": torch.full((numel,), float(i)) for i in range(count)}
        checkpoint = {"format_version": 1, "epoch": 0, "global_step": 1, "state_dict": state}
        DistributedCheckpointIO().save_checkpoint(checkpoint, folder)
        return {"tensors": count}
    out = os.path.join(spec["out_dir"], spec["case"].replace("->", "_"))
    # Everything any case imports is imported before the meter starts: only the work is measured.
    import torch.distributed.checkpoint

    import trainer_core.checkpoint.safetensors
    import trainer_core.checkpoint.stream  # noqa: F401
    from trainer_core.checkpoint.cli import main as cli
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    save_file = None
    if spec["case"] == "whole->safetensors":
        from safetensors.torch import save_file
    gc.collect()
    meter = PhaseMeter()
    start = time.perf_counter()
    if spec["case"] == "whole->torch":
        TorchCheckpointIO().save_checkpoint(DistributedCheckpointIO().load_checkpoint(folder), out)
    elif spec["case"] == "whole->safetensors":
        os.makedirs(out)
        state_dict = DistributedCheckpointIO().load_checkpoint(folder)["state_dict"]
        save_file(state_dict, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        args = ["consolidate", folder, out] + (
            ["--to", "safetensors"] if "safetensors" in spec["case"] else []
        )
        if cli(args) != 0:
            raise RuntimeError(f"consolidate {args} failed")
    seconds = time.perf_counter() - start
    meter.mark("consolidate")
    return {"peak_extra_mib": meter.peak_extra_mib, "s": seconds}


def _offline_measure(args: argparse.Namespace) -> tuple[list[dict], dict[str, str]]:
    import shutil
    import tempfile

    samples: list[dict] = []
    failures: dict[str, str] = {}
    cases = list(OFFLINE_CASES)
    if common.probe_import("import safetensors") is not None:
        common.log("whole->safetensors: the safetensors library is not installed; measuring the others")
        cases.remove("whole->safetensors")
    script = Path(__file__).resolve()
    for size in args.offline_sizes:
        with tempfile.TemporaryDirectory(prefix="consolidate-offline-") as tmp:
            folder = os.path.join(tmp, "sharded")
            base = {"folder": folder, "size_mib": size, "tensor_mib": args.tensor_mib}
            common.run_worker(script, {**base, "case": "make"}, timeout=JOB_TIMEOUT_S)
            for repeat in range(args.repeats):
                for case in common.rotated(cases, repeat):
                    out_dir = os.path.join(tmp, f"out-{repeat}")
                    os.makedirs(out_dir, exist_ok=True)
                    try:
                        result = common.run_worker(
                            script, {**base, "case": case, "out_dir": out_dir}, timeout=JOB_TIMEOUT_S
                        )
                    except common.WorkerError as err:
                        failures[f"{case} {size} MiB"] = str(err)
                        common.log(f"{case} at {size} MiB failed:\n{err}")
                        continue
                    finally:
                        shutil.rmtree(out_dir, ignore_errors=True)
                    samples.append({"case": case, "size_mib": size, "repeat": repeat, **result})
                    common.log(
                        f"[{repeat + 1}/{args.repeats}] {size:4d} MiB {case:<20} peak extra "
                        f"{result['peak_extra_mib']:7.1f} MiB  {result['s']:.2f} s"
                    )
    return samples, failures


def _offline_summarize(samples: list[dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    limit = args.tensor_mib + OFFLINE_TARGET_FIXED_MIB
    for size in args.offline_sizes:
        row: dict[str, Any] = {"size_mib": size, "largest_tensor_mib": args.tensor_mib, "target_mib": limit}
        for case in OFFLINE_CASES:
            mine = [s for s in samples if s["case"] == case and s["size_mib"] == size]
            row[case] = (
                {
                    "peak_extra_mib": common.median(s["peak_extra_mib"] for s in mine),
                    "s": common.median(s["s"] for s in mine),
                    "repeats": len(mine),
                }
                if mine
                else None
            )
        streamed = [row[c]["peak_extra_mib"] for c in ("stream->torch", "stream->safetensors") if row[c]]
        row["ok"] = bool(streamed) and all(peak <= limit for peak in streamed)
        rows.append(row)
    return rows


def _offline_print(rows: list[dict]) -> None:
    def peak(row: dict, case: str) -> str:
        return f"{row[case]['peak_extra_mib']:.0f}" if row[case] else "-"

    def ratio(row: dict, whole: str, stream: str) -> str:
        if not (row[whole] and row[stream]) or row[stream]["peak_extra_mib"] <= 0:
            return "-"
        return f"{row[whole]['peak_extra_mib'] / row[stream]['peak_extra_mib']:.1f}x"

    table = [
        (
            f"{r['size_mib']}",
            f"{r['largest_tensor_mib']}",
            peak(r, "whole->torch"),
            peak(r, "stream->torch"),
            ratio(r, "whole->torch", "stream->torch"),
            peak(r, "whole->safetensors"),
            peak(r, "stream->safetensors"),
            ratio(r, "whole->safetensors", "stream->safetensors"),
            f"<= {r['target_mib']} {'ok' if r['ok'] else 'OVER'}",
            "/".join(f"{r[c]['s']:.1f}" if r[c] else "-" for c in OFFLINE_CASES),
        )
        for r in rows
    ]
    headers = (
        "ckpt MiB", "largest", "whole->torch", "stream->torch", "saved", "whole->st", "stream->st", "saved",
        "target (stream)", "s (w/s/w/s)",
    )  # fmt: skip
    print("consolidate: peak extra MiB (medians) against the checkpoint's size")
    print(common.format_table(headers, table))


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"jobs per case (default {DEFAULT_REPEATS})"
    )
    parser.add_argument("--width", type=int, default=None, help=f"Linear width (default {DEFAULT_WIDTH})")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="Linear layers")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, width 1024")
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES)
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    parser.add_argument("--show-output", action="store_true", help="let the ranks print")
    parser.add_argument(
        "--out", default=str(common.RESULTS_DIR / "consolidate.json"), help="where the JSON goes"
    )
    parser.add_argument(
        "--figure",
        choices=("all", "save", "offline"),
        default="all",
        help="save: trainer.save_checkpoint of sharded optimizers (2 ranks); offline: the consolidate CLI's "
        "peak memory against checkpoint size; all: both (default)",
    )
    parser.add_argument("--full", action="store_true", help="offline figure up to 800 MiB")
    parser.add_argument(
        "--tensor-mib", type=int, default=OFFLINE_TENSOR_MIB, help="offline figure: MiB per tensor"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.offline_sizes = [40, 80]
        if "--tensor-mib" not in argv:
            args.tensor_mib = 10
    else:
        args.offline_sizes = [100, 400, 800] if args.full else [100, 400]
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    if args.width is None:
        args.width = 1024 if args.quick else DEFAULT_WIDTH
    args.cases = common.parse_cases(parser, args.cases, CASES)
    return args


def main(argv: Sequence[str]) -> int:
    if "--worker" in argv and "--result" in argv:  # an offline-figure worker (common.run_worker)
        common.serve_worker(argv, _offline_worker)
        return 0
    if "--worker" in argv:
        return _worker_main(argv)
    args = _parse_args(argv)
    if args.figure == "offline":
        args.cases = []
    if common.probe_import("import fairscale") is not None:
        dropped = [c for c in args.cases if c in ("ddp_sharded", "ddp+oss")]
        common.log(f"skipping {', '.join(dropped)}: fairscale is not installed")
        args.cases = [c for c in args.cases if c not in dropped]
    started = time.time()
    samples, failures, rows, met = [], {}, [], True
    if args.cases:
        samples, failures = _measure(args)
        rows = _summarize(samples, args.cases)
        _print_table(rows)
        sharded_rows = [r for r in rows if r["case"] != "ddp"]
        met = bool(sharded_rows) and all(r["ok"] for r in sharded_rows) and not failures
        print(
            f"target: rank 0 <= {TARGET_RANK0:.2f}x the full optimizer state extra, other ranks <= "
            f"{TARGET_OTHERS:.2f}x (sharded cases) -> {'MET' if met else 'MISSED'}"
        )
    offline: dict[str, Any] = {}
    if args.figure in ("all", "offline"):
        offline_samples, offline_failures = _offline_measure(args)
        offline_rows = _offline_summarize(offline_samples, args)
        if args.cases:
            print()
        _offline_print(offline_rows)
        offline_met = all(r["ok"] for r in offline_rows) and not offline_failures
        print(
            f"target: consolidate (streaming) adds <= the largest tensor ({args.tensor_mib} MiB) + "
            f"{OFFLINE_TARGET_FIXED_MIB} MiB at every size -> {'MET' if offline_met else 'MISSED'}"
        )
        failures.update(offline_failures)
        met = met and offline_met
        offline = {
            "sizes_mib": args.offline_sizes,
            "tensor_mib": args.tensor_mib,
            "summary": offline_rows,
            "target": {"max_extra_mib": args.tensor_mib + OFFLINE_TARGET_FIXED_MIB, "met": offline_met},
            "samples": offline_samples,
        }
    for case, error in failures.items():
        print(f"{case} failed: {error.strip().splitlines()[-1]}")
    payload = {
        "benchmark": "consolidate",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "config": {
            "repeats": args.repeats,
            "width": args.width,
            "layers": args.layers,
            "steps": STEPS,
            "world_size": WORLD_SIZE,
            "cases": args.cases,
        },
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "fairscale", "safetensors", "trainer-core"]),
        "failures": failures,
        "summary": rows,
        "target": {"rank0_max_x_full": TARGET_RANK0, "others_max_x_full": TARGET_OTHERS, "met": met},
        "samples": samples,
        "offline": offline,
    }
    path = common.write_json(args.out, payload)
    common.log(f"wrote {path}")
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
