"""The pipeline bubble: step time of GPipe, 1F1B and interleaved 1F1B at pp 2, against the ideal.

The model is ``--layers`` blocks of ``Linear(--width, --width) + Tanh`` trained with SGD on an MSE
loss, batch ``--batch`` split into 4 or 8 micro-batches. Each pipelined case is a 2-rank job
(``Trainer(devices=2, plugins=PipelinePlugin(...))`` over gloo on 127.0.0.1, one thread per rank):
GPipe and 1F1B with 2 stages (one per rank), interleaved 1F1B with 4 stages (two per rank).

* ``ideal``    one process running the same micro-batches of the whole model one after another
               (forward, backward, one optimizer step), divided by the pipeline degree: a pipeline
               with no bubble and free communication.
* ``step``     the median wall time between the starts of consecutive training steps of rank 0.
* ``x ideal``  step / ideal: the bubble plus communication and the Trainer's own work.
* ``theory``   1 + the schedule's bubble fraction: ``(p - 1) / m`` for GPipe and 1F1B,
               ``(p - 1) / (v m)`` with ``v`` stages per rank for interleaved 1F1B.

Cases are interleaved and rotated across repeats; the table shows medians over repeats, the JSON
(``bench_results/pipeline.json``) every sample. On a CPU the point-to-point sends of gloo cost more
than on a GPU interconnect, so ``x ideal`` sits above ``theory``; the order of the schedules and the
effect of more micro-batches are what carry over.

    python benchmarks/pipeline.py            # 3 repeats, 40 steps (about 4 minutes on 2 cores)
    python benchmarks/pipeline.py --quick    # 1 repeat, 12 steps
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
MICROBATCHES = (4, 8)
PP = 2
WARMUP_STEPS = 3
JOB_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------- the job
def _build(layers: int, width: int) -> Any:
    import torch
    from torch import nn

    from trainer_core import LightningModule

    class Blocks(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(output, target)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    return Blocks()


def _data(spec: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    n = spec["batch"] * spec["steps"]
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, spec["width"], generator=g), torch.randn(n, spec["width"], generator=g)
    )


def _median_step(starts: list[float]) -> float:
    gaps = [b - a for a, b in zip(starts[WARMUP_STEPS:], starts[WARMUP_STEPS + 1 :])]
    return common.median(gaps)


def _run_single(spec: dict[str, Any]) -> dict[str, Any]:
    """The whole model in one process, the same micro-batches one after another (the ideal's base)."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    model = _build(spec["layers"], spec["width"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    n = spec["microbatches"]
    starts = []
    for x, y in DataLoader(_data(spec), batch_size=spec["batch"]):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(n), y.chunk(n)):
            (model.loss_fn(model(xs), ys) / n).backward()
        optimizer.step()
    return {"step_s": _median_step(starts)}


def _run_pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from trainer_core import Trainer
    from trainer_core.callbacks import Callback
    from trainer_core.plugins import PipelinePlugin

    torch.set_num_threads(1)
    layers = spec["layers"]
    stages = 2 * PP if spec["schedule"] == "Interleaved1F1B" else PP
    split = [f"layers.{layers * i // stages}" for i in range(1, stages)]
    starts: list[float] = []

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            starts.append(time.perf_counter())

    trainer = Trainer(
        devices=PP,
        plugins=PipelinePlugin(
            split_points=split, schedule=spec["schedule"], n_microbatches=spec["microbatches"]
        ),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
    )
    trainer.fit(_build(layers, spec["width"]), DataLoader(_data(spec), batch_size=spec["batch"]))
    return {"step_s": _median_step(starts), "steps": len(starts)}


# ----------------------------------------------------------------------------- the parent
def _theory(schedule: str, microbatches: int) -> float:
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    return 1.0 + (PP - 1) / (per_rank * microbatches)


def main(argv: Sequence[str]) -> None:
    if "--worker" in argv and "--result-dir" in argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", required=True)
        parser.add_argument("--result-dir", required=True)
        args, _ = parser.parse_known_args(argv)
        import json

        spec = json.loads(args.worker)
        common.serve_rank_worker(args.result_dir, lambda: _run_pipeline(spec))
        return
    if "--worker" in argv:
        common.serve_worker(argv, _run_single)
        return

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 repeat, 12 steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--show-output", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 12
    base = {"layers": args.layers, "width": args.width, "batch": args.batch, "steps": args.steps}
    cases = [(s, m) for m in MICROBATCHES for s in SCHEDULES]
    import json

    samples: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for m in MICROBATCHES:
            key = f"single/{m}"
            common.log(f"repeat {repeat + 1}/{args.repeats}: one process, {m} micro-batches")
            result = common.run_worker(__file__, {**base, "microbatches": m}, timeout=JOB_TIMEOUT_S)
            samples.setdefault(key, []).append(result["step_s"])
        for schedule, m in common.rotated(cases, repeat):
            common.log(f"repeat {repeat + 1}/{args.repeats}: {schedule}, {m} micro-batches")
            spec = {**base, "schedule": schedule, "microbatches": m}
            job = common.run_rank_job(
                [__file__, "--worker", json.dumps(spec)],
                PP,
                timeout=JOB_TIMEOUT_S,
                show_output=args.show_output,
            )
            samples.setdefault(f"{schedule}/{m}", []).append(job["ranks"][0]["step_s"])

    rows = []
    for schedule, m in cases:
        ideal = common.median(samples[f"single/{m}"]) / PP
        step = common.median(samples[f"{schedule}/{m}"])
        rows.append(
            [
                schedule,
                m,
                f"{step * 1e3:.2f}",
                f"{ideal * 1e3:.2f}",
                f"{step / ideal:.2f}x",
                f"{_theory(schedule, m):.2f}x",
                f"{common.spread_pct(samples[f'{schedule}/{m}']):.0f}%",
            ]
        )
    print(
        f"pipeline bubble: pp {PP}, {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, "
        f"{args.steps} steps, medians of {args.repeats} repeat(s)"
    )
    print(
        common.format_table(
            ["schedule", "micro-batches", "step ms", "ideal ms", "x ideal", "theory", "spread"], rows
        )
    )
    path = common.write_json(
        common.RESULTS_DIR / "pipeline.json",
        {
            "config": {**base, "pp": PP, "repeats": args.repeats},
            "samples_s": samples,
            "machine": common.machine_info(),
            "packages": common.package_versions(["torch"]),
        },
    )
    common.log(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
