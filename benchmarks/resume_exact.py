"""Resume at 3 and 4 ranks: how far a resumed run lands from the run that went on, before and after.

Two measurements, side by side in one run:

* **exactness** — ``tests/jobs/resume_matrix_job.py`` (the resume matrix's job: a seeded MLP, AdamW,
  14 optimizer steps, gradient accumulation 2) per plugin at 3 and 4 ranks over gloo, resuming from a
  checkpoint written at an optimizer step (``every_n_train_steps``) and from one written between two
  steps of accumulation (``after_validation``). ``max |dw|``: the largest difference of any final
  weight, on any rank, between a resumed run and the uninterrupted one (0 is bit for bit); ``steps``:
  how many resumed steps logged another loss than the uninterrupted run. *before* runs the job with
  ``--as-before`` (DDP's resumed wrapper reduces its first iteration in its own first buckets; FSDP
  saves no gradients of the unfinished cycle), *after* as the code is.
* **per-step cost** — a resumed DDP fit at 3 ranks, timed from its first step to its last: the
  resumed wrapper in the saved buckets (``pinned``, as the code is), in DDP's own first buckets
  (``unpinned``, as before), and ``find_unused_parameters=True`` (DDP never rebuilds its buckets, so a
  resume is exact that way too, at a cost on every step). Modes are interleaved and rotated across
  repeats; medians, and ratios paired per repeat against ``unpinned``.

    python benchmarks/resume_exact.py            # every plugin at 3 and 4 ranks, 3 timing repeats
    python benchmarks/resume_exact.py --quick    # ddp and fsdp_full at 3 ranks, 1 short repeat

Every sample goes to ``bench_results/resume_exact.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

JOB = common.REPO_ROOT / "tests" / "jobs" / "resume_matrix_job.py"
RESULT_PATH = common.RESULTS_DIR / "resume_exact.json"
PLUGINS = ("ddp", "zero", "ddp_sharded", "fsdp_full", "fsdp_sharded")
WORLD_SIZES = (3, 4)
# Accumulation 2: "after_validation" (validation at batch 3) is written between two optimizer steps.
SCENARIO = "map:0:step:2"
WRITERS = ("every_n_train_steps", "after_validation")
TIMING_MODES = ("unpinned", "pinned", "find_unused")
TIMING_RANKS = 3
WARM_STEPS = 10
JOB_TIMEOUT_S = 900


# ----------------------------------------------------------------------------- exactness


def _exactness(plugin: str, devices: int, before: bool) -> dict[str, Any]:
    """Run the matrix job once; the largest final-weight difference and the count of steps that differ."""
    with tempfile.TemporaryDirectory(prefix="resume-exact-") as tmp:
        cmd = [sys.executable, str(JOB), "--out", tmp, "--plugin", plugin, "--devices", str(devices)]
        cmd += ["--scenarios", SCENARIO, "--resume-only", ",".join(WRITERS)]
        if before:
            cmd.append("--as-before")
        env = {**common.worker_env(), "PYTHONPATH": str(JOB.parent)}
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        if proc.returncode != 0:
            raise common.WorkerError(f"{plugin} at {devices} ranks failed:\n{proc.stderr[-3000:]}")
        folder = next(p for p in Path(tmp).iterdir() if p.is_dir())
        return _differences(folder, devices)


def _differences(folder: Path, devices: int) -> dict[str, Any]:
    import torch

    worst, steps = 0.0, 0
    for rank in range(devices):
        reference = json.loads((folder / f"reference.rank{rank}.json").read_text())["steps"]
        ref_weights = torch.load(folder / f"reference.rank{rank}.pt", weights_only=True)
        for writer in WRITERS:
            resumed = json.loads((folder / f"{writer}.rank{rank}.json").read_text())["steps"]
            steps += sum(resumed[step] != reference[step] for step in resumed)
            weights = torch.load(folder / f"{writer}.rank{rank}.pt", weights_only=True)
            for name, tensor in ref_weights.items():
                if tensor.numel():  # an FSDP shard may be empty on some ranks
                    worst = max(worst, (tensor - weights[name]).abs().max().item())
    return {"max_abs_weight_diff": worst, "differing_steps": steps}


# ----------------------------------------------------------------------------- per-step cost


def _time_worker(spec: dict[str, Any]) -> None:
    """One rank of a timed resume (rank 0 writes the result; the plugin starts the other ranks)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer_core import LightningModule, Trainer, seed_everything
    from trainer_core.callbacks import Callback
    from trainer_core.plugins import DDPPlugin, ddp

    torch.set_num_threads(1)
    mode, steps = spec["mode"], spec["steps"]
    ddp._PIN_BUCKETS = mode != "unpinned"

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter())

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16 * TIMING_RANKS * 64, 64, generator=g), torch.randn(16 * TIMING_RANKS * 64, 1)
    )
    kwargs = {"find_unused_parameters": True} if mode == "find_unused" else {}
    common_args: dict[str, Any] = {
        "devices": TIMING_RANKS,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": spec["dir"],
    }
    seed_everything(0, verbose=False)
    trainer = Trainer(plugins=DDPPlugin(**kwargs), max_steps=WARM_STEPS, **common_args)
    trainer.fit(Net(), DataLoader(data, batch_size=16, shuffle=True))
    path = os.path.join(spec["dir"], "warm.ckpt")
    trainer.save_checkpoint(path)
    clock = StepClock()
    resumed = Trainer(
        plugins=DDPPlugin(**kwargs), max_steps=WARM_STEPS + steps, callbacks=[clock], **common_args
    )
    resumed.fit(Net(), DataLoader(data, batch_size=16, shuffle=True), ckpt_path=path)
    if resumed.global_rank == 0:
        seconds = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)
        Path(spec["result"]).write_text(json.dumps({"us_per_step": seconds * 1e6}))


def _time_mode(mode: str, steps: int) -> float:
    with tempfile.TemporaryDirectory(prefix="resume-exact-time-") as tmp:
        spec = {"mode": mode, "steps": steps, "dir": tmp, "result": os.path.join(tmp, "result.json")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--time-worker", json.dumps(spec)]
        proc = subprocess.run(
            cmd, cwd=tmp, env=common.worker_env(), capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0 or not os.path.exists(spec["result"]):
            raise common.WorkerError(f"timing {mode} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(spec["result"]).read_text())["us_per_step"]


# ----------------------------------------------------------------------------- parent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="ddp and fsdp_full at 3 ranks; one short timing repeat"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--time-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_worker is not None:
        _time_worker(json.loads(args.time_worker))
        return
    plugins = ("ddp", "fsdp_full") if args.quick else PLUGINS
    sizes = (3,) if args.quick else WORLD_SIZES
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (40 if args.quick else 200)

    exact_rows, exact_samples = [], []
    for devices in sizes:
        for plugin in plugins:
            common.log(f"exactness: {plugin} at {devices} ranks")
            before, after = _exactness(plugin, devices, True), _exactness(plugin, devices, False)
            exact_samples.append({"plugin": plugin, "devices": devices, "before": before, "after": after})
            exact_rows.append(
                [
                    devices,
                    plugin,
                    f"{before['max_abs_weight_diff']:.3g}",
                    before["differing_steps"],
                    f"{after['max_abs_weight_diff']:.3g}",
                    after["differing_steps"],
                ]
            )

    timings: dict[str, list[float]] = {mode: [] for mode in TIMING_MODES}
    for repeat in range(repeats):
        for mode in common.rotated(TIMING_MODES, repeat):
            common.log(f"per-step cost: {mode}, repeat {repeat + 1}/{repeats}")
            timings[mode].append(_time_mode(mode, steps))
    base = timings["unpinned"]
    time_rows = [
        [
            mode,
            f"{common.median(values):.0f}",
            f"{common.spread_pct(values):.0f}%",
            f"{common.median(v / b for v, b in zip(values, base)):.3f}x",
        ]
        for mode, values in timings.items()
    ]

    print(f"\nResume exactness ({SCENARIO}, writers {', '.join(WRITERS)}): before = --as-before, after = now")
    headers = ["ranks", "plugin", "before max |dw|", "before steps", "after max |dw|", "after steps"]
    print(common.format_table(headers, exact_rows))
    print(
        f"\nResumed DDP at {TIMING_RANKS} ranks, {steps} steps, medians of {repeats} (ratio paired vs unpinned)"
    )
    print(common.format_table(["mode", "us/step", "spread", "vs unpinned"], time_rows))
    path = common.write_json(
        RESULT_PATH,
        {
            "exactness": exact_samples,
            "us_per_step": timings,
            "steps": steps,
            "machine": common.machine_info(),
        },
    )
    print(f"\nevery sample: {path}")


if __name__ == "__main__":
    main()
