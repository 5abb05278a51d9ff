"""Checkpoint save and load: plain ``torch.save`` + fsync vs trainer-core vs PyTorch Lightning.

The model is a stack of 24 square ``Linear`` layers (float32, ``--params-millions`` parameters in
all, 100 M by default) that has taken one real Adam step, so ``exp_avg`` and ``exp_avg_sq`` are
populated and the checkpoint holds three copies of the weights (about 1.2 GB at 100 M).

Three ways to save, each in a fresh process per repeat (so that one method's memory never hides
another's), interleaved and rotated across repeats so that noise on a shared machine hits them alike:

* ``plain``        ``torch.save({"state_dict": ..., "optimizer": ...}, f)``, ``f.flush()``,
                   ``os.fsync``: the floor a checkpointing library is measured against.
* ``trainer-core`` ``trainer.save_checkpoint(path)`` after ``fit`` for one step (temp file, fsync,
                   rename, fsync of the folder).
* ``lightning``    the same with PyTorch Lightning's ``Trainer`` and the same module source. Lightning
                   does not fsync; the fsync it leaves to the kernel is timed separately afterwards
                   (``fsync_after_s`` in the JSON) so that its dirty pages do not land in the next
                   sample, and is *not* part of its save time.

Per save: seconds, MB/s (file size / seconds) and the peak RSS the save adds: the kernel's peak
counter is reset (``/proc/self/clear_refs`` <- ``5``) just before the save, and ``VmHWM`` after it
minus ``VmRSS`` before it is what the save needed on top of the model and optimizer. Per load (of the
file just written, so from the page cache: this compares the code paths, not the disk): plain
``torch.load(weights_only=True)``, trainer-core ``TorchCheckpointIO().load_checkpoint``, Lightning's
``TorchCheckpointIO().load_checkpoint``, with the same peak-RSS reading. Every file goes to a fresh
folder under ``--dir`` and is deleted after the sample.

Targets (issue 3): trainer-core save throughput >= 0.9x plain, and the peak RSS a trainer-core save
adds <= 5% of the checkpoint size. The table shows medians; ``bench_results/checkpoint.json`` holds
every sample.

    python benchmarks/checkpoint.py                 # 100 M parameters, 3 repeats (about 4 minutes)
    python benchmarks/checkpoint.py --quick         # smoke: 10 M parameters, 1 repeat
    python benchmarks/checkpoint.py --profile       # + cProfile and tracemalloc of one trainer-core save
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

# ----------------------------------------------------------------------------- what is measured

IMPLS = ("plain", "trainer-core", "lightning")
BASELINE = "plain"
TARGET_IMPL = "trainer-core"
TARGET_THROUGHPUT_RATIO = 0.9  # save MB/s of trainer-core / plain
TARGET_RSS_FRACTION = 0.05  # peak RSS added by a save / checkpoint size

NUM_LAYERS = 24
WIDTH_MULTIPLE = 64
BATCH_SIZE = 8
DEFAULT_PARAMS_MILLIONS = 100.0
DEFAULT_REPEATS = 3
QUICK_PARAMS_MILLIONS = 10.0
DEFAULT_DIR = Path(tempfile.gettempdir()) / "trainer-core-checkpoint-bench"
RESULT_PATH = common.RESULTS_DIR / "checkpoint.json"
PROFILE_DIR = common.RESULTS_DIR / "profile"
MB = 1e6


def layer_width(params_millions: float) -> int:
    """Width of the square layers that puts about ``params_millions`` M parameters in NUM_LAYERS of them."""
    width = math.sqrt(params_millions * 1e6 / NUM_LAYERS)
    return max(WIDTH_MULTIPLE, round(width / WIDTH_MULTIPLE) * WIDTH_MULTIPLE)


def build_net(width: int) -> Any:
    import torch

    layers: list[Any] = []
    for i in range(NUM_LAYERS):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*layers)


def build_loader(width: int) -> Any:
    """One batch: ``max_steps=1`` takes exactly one optimizer step on it."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.randn(BATCH_SIZE, width), torch.randn(BATCH_SIZE, width))
    return DataLoader(dataset, batch_size=BATCH_SIZE)


def build_module_class(base: type) -> type:
    """The one LightningModule both trainers run; ``base`` is the framework's ``LightningModule``."""
    import torch
    import torch.nn.functional as F

    class CheckpointModule(base):  # type: ignore[misc, valid-type]
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return CheckpointModule


# ----------------------------------------------------------------------------- memory readings


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; this benchmark needs Linux")


def _reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS, so that the next VmHWM is the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(action: Callable[[], Any]) -> tuple[Any, float, int]:
    """Run ``action``; return (its result, seconds, bytes of peak RSS it added)."""
    gc.collect()
    rss_before = _status_kib("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - start
    added = max(0, _status_kib("VmHWM") - rss_before) * 1024
    return result, seconds, added


# ----------------------------------------------------------------------------- worker side


def _import_framework(impl: str) -> Any:
    if impl == "trainer-core":
        import trainer_core

        return trainer_core
    try:
        import lightning.pytorch as framework
    except ImportError:  # the `bench` extra installs the standalone pytorch-lightning package
        import pytorch_lightning as framework
    return framework


def _train_plain(width: int) -> tuple[Any, Any]:
    """The model and an Adam that has taken one step on it, by hand."""
    import torch
    import torch.nn.functional as F

    net = build_net(width)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    for x, y in build_loader(width):
        F.mse_loss(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer


def _train_framework(framework: Any, width: int, root: Path) -> tuple[Any, Any]:
    """A ``Trainer`` that has run ``fit`` for one optimizer step, and its optimizer."""
    module = build_module_class(framework.LightningModule)(build_net(width))
    trainer = framework.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    trainer.fit(module, train_dataloaders=build_loader(width))
    if trainer.global_step != 1:
        raise RuntimeError(f"fit took {trainer.global_step} optimizer steps, expected 1")
    return trainer, trainer.optimizers[0]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _saver(impl: str, trained: Any, optimizer: Any, path: Path) -> Callable[[], None]:
    import torch

    if impl == BASELINE:

        def save_plain() -> None:
            with open(path, "wb") as f:
                torch.save({"state_dict": trained.state_dict(), "optimizer": optimizer.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())

        return save_plain
    return lambda: trained.save_checkpoint(path)


def _loader(impl: str, path: Path) -> Callable[[], Any]:
    import torch

    if impl == BASELINE:
        return lambda: torch.load(path, map_location="cpu", weights_only=True)
    if impl == "trainer-core":
        from trainer_core.plugins.io.torch_io import TorchCheckpointIO

        return lambda: TorchCheckpointIO().load_checkpoint(path)
    try:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as LightningIO
    except ImportError:
        from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO as LightningIO
    return lambda: LightningIO().load_checkpoint(path)


def _check_loaded(loaded: dict[str, Any], net: Any, optimizer: Any, impl: str) -> None:
    """The file holds the weights and the populated Adam state (so the sizes compare like with like)."""
    import torch

    weights = loaded["state_dict"]
    prefix = "" if impl == BASELINE else "net."
    first = next(iter(net.state_dict().items()))
    if not torch.equal(weights[prefix + first[0]], first[1]):
        raise RuntimeError(f"{impl}: the loaded weight {first[0]} differs from the model's")
    states = loaded["optimizer"]["state"] if impl == BASELINE else loaded["optimizer_states"][0]["state"]
    n_params = len(list(net.parameters()))
    if len(states) != n_params or not all("exp_avg_sq" in s for s in states.values()):
        raise RuntimeError(
            f"{impl}: the checkpoint holds Adam state for {len(states)} of {n_params} parameters"
        )
    if len(optimizer.state) != n_params:
        raise RuntimeError(f"{impl}: Adam holds state for {len(optimizer.state)} of {n_params} parameters")


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Worker entry: train one step, save once, load once, in this fresh process."""
    import torch

    torch.set_num_threads(1)
    impl, width = spec["impl"], spec["width"]
    framework = None if impl == BASELINE else _import_framework(impl)
    folder = Path(tempfile.mkdtemp(prefix=f"{impl}-", dir=spec["dir"]))
    try:
        torch.manual_seed(0)
        if framework is None:
            net, optimizer = _train_plain(width)
            trained = net
        else:
            trained, optimizer = _train_framework(framework, width, folder)
            net = trained.lightning_module.net
        path = folder / "model.ckpt"

        save = _saver(impl, trained, optimizer, path)
        if spec.get("profile"):
            return _profile_save(save, path, impl)
        rss_before_save = _status_kib("VmRSS") * 1024
        _, save_s, save_rss = measure(save)
        fsync_after_s = 0.0
        if impl == "lightning":
            start = time.perf_counter()
            _fsync(path)
            fsync_after_s = time.perf_counter() - start
        size = path.stat().st_size

        loaded, load_s, load_rss = measure(_loader(impl, path))
        _check_loaded(loaded, net, optimizer, impl)
        del loaded
        return {
            "params": sum(p.numel() for p in net.parameters()),
            "file_bytes": size,
            "save_s": save_s,
            "save_rss_added_bytes": save_rss,
            "fsync_after_s": fsync_after_s,
            "load_s": load_s,
            "load_rss_added_bytes": load_rss,
            "rss_before_save_bytes": rss_before_save,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _profile_save(save: Callable[[], None], path: Path, impl: str) -> dict[str, Any]:
    """cProfile of one save, then tracemalloc's peak of a second one (Python allocations only)."""
    import cProfile
    import io
    import pstats
    import tracemalloc

    profiler = cProfile.Profile()
    profiler.enable()
    save()
    profiler.disable()
    path.unlink()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(15)

    tracemalloc.start(25)
    save()
    snapshot = tracemalloc.take_snapshot()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    text.write(f"\ntracemalloc peak during the save: {peak / MB:.1f} MB\n")
    for stat in snapshot.statistics("traceback")[:5]:
        text.write(f"{stat.size / MB:.1f} MB held at the end, allocated at:\n")
        text.write("\n".join(stat.traceback.format(limit=8)) + "\n")
    out = PROFILE_DIR / f"checkpoint-save-{impl}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())
    return {"profile": str(out), "tracemalloc_peak_bytes": peak}


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


def _measure(args: argparse.Namespace, impls: list[str], width: int) -> tuple[list[dict], dict[str, str]]:
    samples: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for repeat in range(args.repeats):
        for impl in common.rotated(impls, repeat):
            if impl in failures:
                continue
            spec = {"impl": impl, "width": width, "dir": str(args.dir)}
            try:
                result = common.run_worker(__file__, spec, show_output=args.show_output, timeout=600)
            except common.WorkerError as err:
                failures[impl] = str(err)
                common.log(f"{impl} failed; dropping it from this run:\n{err}")
                continue
            sample = {**spec, "repeat": repeat, **result}
            sample["save_mb_s"] = result["file_bytes"] / MB / result["save_s"]
            sample["load_mb_s"] = result["file_bytes"] / MB / result["load_s"]
            samples.append(sample)
            common.log(
                f"[{repeat + 1}/{args.repeats}] {impl:<12} save {result['save_s']:6.2f} s "
                f"({sample['save_mb_s']:6.0f} MB/s, +{result['save_rss_added_bytes'] / MB:6.0f} MB RSS)  "
                f"load {result['load_s']:6.2f} s (+{result['load_rss_added_bytes'] / MB:6.0f} MB RSS)"
            )
    return samples, failures


def _summarize(samples: list[dict], impls: list[str]) -> list[dict]:
    def med(impl: str, key: str) -> float:
        return common.median(s[key] for s in samples if s["impl"] == impl)

    rows = []
    for impl in impls:
        if not any(s["impl"] == impl for s in samples):
            continue
        size = med(impl, "file_bytes")
        row = {
            "impl": impl,
            "file_mb": size / MB,
            "save_s": med(impl, "save_s"),
            "save_mb_s": med(impl, "save_mb_s"),
            "save_spread_pct": common.spread_pct(s["save_s"] for s in samples if s["impl"] == impl),
            "save_rss_added_mb": med(impl, "save_rss_added_bytes") / MB,
            "save_rss_added_pct_of_file": 100 * med(impl, "save_rss_added_bytes") / size,
            "fsync_after_s": med(impl, "fsync_after_s"),
            "load_s": med(impl, "load_s"),
            "load_mb_s": med(impl, "load_mb_s"),
            "load_rss_added_mb": med(impl, "load_rss_added_bytes") / MB,
        }
        rows.append(row)
    base = next((r for r in rows if r["impl"] == BASELINE), None)
    if base is not None:
        for row in rows:
            row["save_throughput_ratio"] = row["save_mb_s"] / base["save_mb_s"]
            row["load_time_ratio"] = row["load_s"] / base["load_s"]
    return rows


def _targets(rows: list[dict]) -> dict[str, Any]:
    target = next((r for r in rows if r["impl"] == TARGET_IMPL), None)
    if target is None or "save_throughput_ratio" not in target:
        return {}
    throughput = target["save_throughput_ratio"]
    rss = target["save_rss_added_pct_of_file"] / 100
    return {
        "save_throughput_ratio": {
            "value": throughput,
            "target": f">= {TARGET_THROUGHPUT_RATIO}",
            "met": throughput >= TARGET_THROUGHPUT_RATIO,
        },
        "save_rss_added_fraction": {
            "value": rss,
            "target": f"<= {TARGET_RSS_FRACTION}",
            "met": rss <= TARGET_RSS_FRACTION,
        },
    }


def _render(rows: list[dict], targets: dict[str, Any], params: int, repeats: int) -> str:
    def ratio(row: dict, key: str) -> str:
        return f"{row[key]:.2f}x" if key in row else "-"

    headers = ["impl", "file MB", "save s", "spread", "save MB/s", "vs plain", "save +RSS MB", "+RSS % file",
               "load s", "load MB/s", "load time vs plain", "load +RSS MB"]  # fmt: skip
    table_rows = [
        [
            r["impl"],
            f"{r['file_mb']:.0f}",
            f"{r['save_s']:.2f}",
            f"{r['save_spread_pct']:.0f}%",
            f"{r['save_mb_s']:.0f}",
            ratio(r, "save_throughput_ratio"),
            f"{r['save_rss_added_mb']:.0f}",
            f"{r['save_rss_added_pct_of_file']:.1f}%",
            f"{r['load_s']:.2f}",
            f"{r['load_mb_s']:.0f}",
            ratio(r, "load_time_ratio"),
            f"{r['load_rss_added_mb']:.0f}",
        ]
        for r in rows
    ]
    lines = [
        f"Checkpoint save/load, {params / 1e6:.1f} M float32 parameters + Adam state, "
        f"median of {repeats} repeat(s), fresh process per sample",
        common.format_table(headers, table_rows),
    ]
    lightning = next((r for r in rows if r["impl"] == "lightning"), None)
    if lightning is not None:
        lines.append(
            f"(lightning does not fsync; an fsync right after its save took {lightning['fsync_after_s']:.2f} s more, "
            "not counted above. spread = (max - min) / median of the save times. Loads read the file just "
            "written, from the page cache.)"
        )
    for name, label in (
        ("save_throughput_ratio", "trainer-core save throughput / plain torch.save+fsync"),
        ("save_rss_added_fraction", "peak RSS added by a trainer-core save / checkpoint size"),
    ):
        if name in targets:
            t = targets[name]
            lines.append(
                f"target {label}: {t['value']:.3f} (want {t['target']}): {'MET' if t['met'] else 'MISSED'}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=None, help="model size (default 100)")
    parser.add_argument("--repeats", type=int, default=None, help="samples per method (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 M parameters, 1 repeat")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="local folder for the checkpoint files")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--out", type=Path, default=RESULT_PATH)
    parser.add_argument(
        "--profile", action="store_true", help=f"also profile one save per method into {PROFILE_DIR}"
    )
    parser.add_argument("--show-output", action="store_true", help="let workers print (debugging)")
    args = parser.parse_args(argv)
    if args.params_millions is None:
        args.params_millions = QUICK_PARAMS_MILLIONS if args.quick else DEFAULT_PARAMS_MILLIONS
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    width = layer_width(args.params_millions)
    args.dir.mkdir(parents=True, exist_ok=True)

    impls, skipped = _available_impls(args.impls)
    for impl, reason in skipped.items():
        common.log(f"skipping {impl}: {reason}")
    if BASELINE not in impls:
        common.log("the plain baseline is needed for the ratios; add it to --impls")
        return 2
    started = time.perf_counter()
    samples, failures = _measure(args, impls, width)
    rows = _summarize(samples, impls)
    targets = _targets(rows)
    params = samples[0]["params"] if samples else 0

    profiles = {}
    if args.profile:
        for impl in impls:
            if impl in failures:
                continue
            spec = {"impl": impl, "width": width, "dir": str(args.dir), "profile": True}
            profiles[impl] = common.run_worker(__file__, spec, show_output=args.show_output, timeout=600)
            common.log(f"profile of a {impl} save: {profiles[impl]['profile']}")

    print(_render(rows, targets, params, args.repeats))
    common.write_json(
        args.out,
        {
            "benchmark": "checkpoint",
            "config": {
                "params_millions": args.params_millions,
                "params": params,
                "layers": NUM_LAYERS,
                "width": width,
                "repeats": args.repeats,
                "dir": str(args.dir),
                "impls": impls,
            },
            "machine": common.machine_info(),
            "versions": common.package_versions(["torch", "trainer-core", "pytorch-lightning", "lightning"]),
            "summary": rows,
            "targets": targets,
            "samples": samples,
            "skipped": skipped,
            "failures": failures,
            "profiles": profiles,
            "wall_s": time.perf_counter() - started,
        },
    )
    common.log(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        common.serve_worker(sys.argv[1:], run_one)
    else:
        sys.exit(main())
