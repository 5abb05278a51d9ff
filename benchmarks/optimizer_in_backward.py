"""Peak memory and step time of ``Trainer(optimizer_in_backward=True)`` against normal stepping.

The model is ``--layers`` x ``Linear(--width, --width)`` (8 x 2048 by default: 33.6 M float32
parameters, 134 MB of gradients) trained with AdamW for ``--steps`` steps on one process. Each
case is a fresh worker process per repeat (interleaved, rotated across repeats) that reports:

* ``peak``: the process's peak resident memory (``ru_maxrss``) over the whole run;
* ``training adds``: that peak minus the resident memory after building the model, before ``fit``;
* ``step``: the median wall time of a training step after the first (which allocates AdamW's state).

Normal stepping holds every gradient at once between ``loss.backward()`` and ``optimizer.step()``
(and on the first step, AdamW's freshly allocated moments too); stepping in backward consumes and
frees each gradient as soon as it is ready, so its peak should lack nearly all gradient bytes.
**Target (issue 6, part 5): the in-backward peak saves >= 80% of the model's gradient bytes.**

Workers run with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB: glibc otherwise raises its mmap
threshold after the first large free, after which freed tensors stay in the heap and the resident
set no longer says what the tensors occupy; a fixed threshold returns every freed tensor to the OS.

    python benchmarks/optimizer_in_backward.py            # 5 repeats (about 1 minute)
    python benchmarks/optimizer_in_backward.py --quick    # 1 repeat, fewer steps
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

CASES = ("normal", "in_backward")
TARGET_SAVED_FRACTION = 0.8
MB = 1e6


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer_core import LightningModule, Trainer
    from trainer_core.callbacks import Callback

    torch.set_num_threads(1)
    width, layers, steps, batch = spec["width"], spec["layers"], spec["steps"], spec["batch"]

    class Stack(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.layers(x).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.starts.append(time.perf_counter())

    torch.manual_seed(0)
    model = Stack()
    data = DataLoader(TensorDataset(torch.randn(batch * steps, width)), batch_size=batch)
    timer = StepTimes()
    trainer = Trainer(
        max_steps=steps,
        optimizer_in_backward=spec["case"] == "in_backward",
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = _rss_bytes()
    trainer.fit(model, data)
    step_times = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    return {
        "rss_before_fit": before,
        "peak_rss": _peak_rss_bytes(),
        "step_s": common.median(step_times[1:]),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    spec = {"width": args.width, "layers": args.layers, "steps": args.steps, "batch": args.batch}
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for repeat in range(args.repeats):
        for case in common.rotated(CASES, repeat):
            common.log(f"repeat {repeat + 1}/{args.repeats}: {case}")
            runs[case].append(common.run_worker(__file__, {**spec, "case": case}))
    summary: dict[str, Any] = {}
    for case, results in runs.items():
        summary[case] = {
            "peak_mb": common.median(r["peak_rss"] for r in results) / MB,
            "adds_mb": common.median(r["peak_rss"] - r["rss_before_fit"] for r in results) / MB,
            "step_ms": common.median(r["step_s"] for r in results) * 1e3,
            "peak_spread_pct": common.spread_pct(r["peak_rss"] for r in results),
        }
    gradient_mb = runs["normal"][0]["gradient_bytes"] / MB
    saved_mb = summary["normal"]["peak_mb"] - summary["in_backward"]["peak_mb"]
    return {
        "spec": spec,
        "repeats": args.repeats,
        "gradient_mb": gradient_mb,
        "saved_mb": saved_mb,
        "saved_fraction_of_gradients": saved_mb / gradient_mb,
        "step_ratio": summary["in_backward"]["step_ms"] / summary["normal"]["step_ms"],
        "cases": summary,
        "runs": runs,
    }


def render(result: dict[str, Any]) -> str:
    cases = result["cases"]
    rows = [
        [
            case.replace("_", " "),
            f"{cases[case]['peak_mb']:.0f}",
            f"{cases[case]['adds_mb']:.0f}",
            f"{cases[case]['step_ms']:.1f}",
            f"{cases[case]['step_ms'] / cases['normal']['step_ms']:.2f}x",
        ]
        for case in CASES
    ]
    table = common.format_table(
        ["stepping", "peak RSS MB", "training adds MB", "step ms", "step x normal"], rows
    )
    spec = result["spec"]
    fraction = result["saved_fraction_of_gradients"]
    verdict = "met" if fraction >= TARGET_SAVED_FRACTION else "NOT met"
    return (
        f"{spec['layers']} x Linear({spec['width']}, {spec['width']}), AdamW, batch {spec['batch']}, "
        f"{spec['steps']} steps; medians of {result['repeats']} repeats\n\n{table}\n\n"
        f"gradient bytes of the model: {result['gradient_mb']:.0f} MB; in-backward peak saves "
        f"{result['saved_mb']:.0f} MB = {100 * fraction:.0f}% of them "
        f"(target >= {100 * TARGET_SAVED_FRACTION:.0f}%: {verdict})"
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one repeat, 4 steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=str(common.RESULTS_DIR / "optimizer_in_backward.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 4
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    result = measure(args)
    print(render(result))
    payload = {
        **result,
        "machine": common.machine_info(),
        "versions": common.package_versions(["torch", "trainer-core"]),
    }
    common.log(f"wrote {common.write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        common.serve_worker(sys.argv[1:], worker)
    else:
        sys.exit(main(sys.argv[1:]))
