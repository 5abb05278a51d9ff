"""Private memory per rank while a run resumes from one full checkpoint file: ours vs reading it whole.

A stack of square ``Linear`` layers, trained one Adam step (so the checkpoint holds the weights and
two optimizer moments: three times the parameters), is saved to one file of about ``S`` (200 MB; 400 MB
with ``--full``; 63 MB with ``--quick``) and resumed at 2 and 4 ranks (gloo, CPU) under

* ``fsdp_full``    ``FSDPPlugin(state_dict_type="full")``: parameters and optimizer state sharded;
* ``zero``         DDP with torch's ``ZeroRedundancyOptimizer``: optimizer state sharded;
* ``ddp_sharded``  DDP with fairscale's ``OSS``: optimizer state sharded;
* ``ddp``          plain DDP: nothing sharded (every rank keeps the whole state), for Lightning's line.

Each rank samples its ``RssAnon`` (private anonymous memory; the file pages a rank maps from the page
cache are shared and not counted, unlike RSS) every half millisecond while the checkpoint is read and
loaded (``tests/jobs/load_memory_job.py``); the figure is the peak it added, as a fraction of the
file's size. Side by side, in the same run, interleaved:

* ``ours``         ``TorchCheckpointIO()``: the file is mapped (``torch.load(mmap=True)``) and each rank
                   copies out only its own share (its shards, its optimizer partition);
* ``whole``        ``TorchCheckpointIO(mmap=False)``: the same code, the file read whole into each rank;
* ``before``       ``whole`` plus the load path as it was before: every rank of ZeRO/OSS deep-copied
                   the whole optimizer state, FSDP sliced its shards from each rank's full tensors;
* ``lightning``    PyTorch Lightning's ``DDPStrategy`` resuming the same module from its own checkpoint
                   (``trainer.fit(ckpt_path=...)``, which reads the file whole with ``torch.load``).
                   Lightning has no ZeRO/OSS strategy without DeepSpeed/CUDA, and its FSDP strategies
                   need CUDA for a full-file resume, so its line stands beside ``ddp``.

Target (issue 17): each rank adds about its own share of the state plus a bounded buffer. For an
Adam checkpoint at N ranks the share is 2/(3N) of the file for ZeRO/OSS (plus the weights a rank
keeps to give back if the optimizer states are refused: 1/3), 1/N for FSDP; every rank of ``ddp``
keeps the whole optimizer state (2/3).

    python benchmarks/load_memory.py            # 200 MB, 2 and 4 ranks, 3 trials
    python benchmarks/load_memory.py --full     # 400 MB
    python benchmarks/load_memory.py --quick    # 63 MB, 1 trial, without ``before`` (about 3 minutes on 2 idle cores)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

JOB = common.REPO_ROOT / "tests" / "jobs" / "load_memory_job.py"
PLUGINS = ("fsdp_full", "zero", "ddp_sharded", "ddp")
MODES = ("ours", "whole", "before", "lightning")
# (width, layers) of the model: file size about 12 x width^2 x layers bytes.
SIZES = {"quick": (1024, 5), "default": (2048, 4), "full": (2048, 8)}


def run_job(mode: str, devices: int, width: int, layers: int, show_output: bool) -> list[dict[str, Any]]:
    """One job of ``devices`` ranks: every plugin under ``mode`` (or Lightning's DDP); each rank's result."""
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        cmd = [sys.executable, str(JOB), "--out", tmp, "--devices", str(devices)]
        cmd += ["--width", str(width), "--layers", str(layers)]
        cmd += ["--lightning"] if mode == "lightning" else ["--mode", mode, "--plugins", ",".join(PLUGINS)]
        # Large allocations always get their own mapping, returned when freed: growth is what was taken.
        env = {**common.worker_env(), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT"):
            env.pop(name, None)
        sink = None if show_output else subprocess.DEVNULL
        proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=sink, stderr=sink, timeout=1800, check=False)
        if proc.returncode != 0:
            raise common.WorkerError(f"{mode} at {devices} ranks exited with {proc.returncode}")
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="63 MB, one trial")
    parser.add_argument("--full", action="store_true", help="400 MB")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--show-output", action="store_true")
    args = parser.parse_args()
    width, layers = SIZES["quick" if args.quick else "full" if args.full else "default"]
    trials = args.trials or (1 if args.quick else 3)
    modes = tuple(
        m for m in MODES if not (args.quick and m == "before")
    )  # --quick: the three the issue names
    ranks = [int(r) for r in args.ranks.split(",")]

    samples: dict[tuple[str, str, int], list[float]] = {}
    file_bytes: dict[str, int] = {}
    for trial in range(trials):
        for devices in ranks:
            for mode in common.rotated(modes, trial):
                common.log(f"trial {trial + 1}/{trials}: {mode} at {devices} ranks")
                for result in run_job(mode, devices, width, layers, args.show_output):
                    plugin = result["plugin"]
                    file_bytes[plugin] = result["file_bytes"]
                    key = ("ddp" if mode == "lightning" else plugin, mode, devices)
                    samples.setdefault(key, []).append(result["added_bytes"] / result["file_bytes"])

    rows, summary = [], []
    for plugin in PLUGINS:
        for devices in ranks:
            line: dict[str, Any] = {"plugin": plugin, "ranks": devices}
            cells = [plugin, devices]
            for mode in modes:
                values = samples.get((plugin, mode, devices))
                line[mode] = common.median(values) if values else None
                line[f"{mode}_max"] = max(values) if values else None
                cells.append("-" if not values else f"{common.median(values):.2f}")
            ours, whole = line["ours"], line["whole"]
            cells.append(f"{whole / ours:.1f}x" if ours and whole else "-")
            summary.append(line)
            rows.append(cells)
    size_mb = max(file_bytes.values()) / 1e6
    print(
        f"Peak private memory (RssAnon) a rank adds while loading a {size_mb:.0f} MB checkpoint, x file size"
    )
    print("(median over ranks and trials; lightning: PyTorch Lightning DDPStrategy, beside ddp)")
    print(common.format_table(["plugin", "ranks", *modes, "whole/ours"], rows))
    path = common.write_json(
        common.RESULTS_DIR / "load_memory.json",
        {
            "file_bytes": file_bytes,
            "trials": trials,
            "summary": summary,
            "samples": {f"{p}/{m}/{n}": v for (p, m, n), v in samples.items()},
            "machine": common.machine_info(),
        },
    )
    common.log(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
