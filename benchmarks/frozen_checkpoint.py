"""Trainable-only checkpoints: a frozen base with 1% trainable parameters, plain save vs FrozenBlobCheckpointIO.

The model is LoRA-like: ``--layers`` frozen square ``Linear`` layers (float32, ``--params-millions``
parameters in all, 25 M by default: a 100 MB base) and, beside each, a trainable low-rank adapter
sized so that 1% of the parameters train. It has taken one real Adam step, so each checkpoint holds the
adapter's Adam state too. Two ways to save, each in a fresh process per repeat, interleaved and rotated:

* ``plain``   ``Trainer()``: ``TorchCheckpointIO``, every checkpoint holds the frozen base.
* ``frozen``  ``Trainer(plugins=[FrozenBlobCheckpointIO()])``: the base is written once into
              ``blobs/``, each checkpoint references it.

Each worker writes ``--saves`` checkpoints with ``trainer.save_checkpoint`` into a fresh folder and
reports: the bytes each save added to the folder (its file, plus the blobs it wrote), the total for
all of them, the time of each save (the first apart: it hashes the base and writes the blobs) and the
time to load the last one back with ``TorchCheckpointIO().load_checkpoint`` (for ``frozen``: reading
and checking every blob's size and sha256, from the page cache). The table shows medians.

Target (issue 17): report the size of a checkpoint after the first against a plain save. With 1%
trainable parameters and Adam (3 copies of the adapter), about 3% of a plain checkpoint is the floor.

    python benchmarks/frozen_checkpoint.py            # 25 M parameters (100 MB), 5 saves, 3 repeats
    python benchmarks/frozen_checkpoint.py --quick    # smoke: 10 M parameters, 3 saves, 1 repeat
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

IMPLS = ("plain", "frozen")
BASELINE = "plain"
TRAINABLE_FRACTION = 0.01
NUM_LAYERS = 24
DEFAULT_PARAMS_MILLIONS = 25.0
QUICK_PARAMS_MILLIONS = 10.0
DEFAULT_SAVES = 5
QUICK_SAVES = 3
DEFAULT_REPEATS = 3
DEFAULT_DIR = Path(tempfile.gettempdir()) / "trainer-core-frozen-checkpoint-bench"
RESULT_PATH = common.RESULTS_DIR / "frozen_checkpoint.json"
MB = 1e6


def shape_for(params_millions: float, layers: int) -> tuple[int, int]:
    """``(width, rank)``: ``layers`` frozen width x width layers, adapters of ``rank`` making 1% of the parameters."""
    width = max(64, int((params_millions * 1e6 / layers) ** 0.5))
    rank = max(1, round(TRAINABLE_FRACTION * width / 2))
    return width, rank


# ----------------------------------------------------------------------------- worker


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer_core import LightningModule, Trainer, seed_everything
    from trainer_core.plugins.io.frozen_io import FrozenBlobCheckpointIO
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    torch.set_num_threads(1)
    width, rank, layers = spec["width"], spec["rank"], spec["layers"]

    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(width, width, bias=False).requires_grad_(False)
            self.down = nn.Linear(width, rank, bias=False)
            self.up = nn.Linear(rank, width, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.base(x) + self.up(self.down(x)))

    class LoRA(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Adapted() for _ in range(layers)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.blocks(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    seed_everything(0)
    model = LoRA()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    folder = Path(spec["dir"]) / f"{spec['impl']}-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    plugins = [FrozenBlobCheckpointIO()] if spec["impl"] == "frozen" else None
    trainer = Trainer(
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        plugins=plugins,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, width)), batch_size=8))
    try:
        save_s, added = [], []
        before = 0
        for index in range(spec["saves"]):
            start = time.perf_counter()
            trainer.save_checkpoint(folder / f"step={index}.ckpt")
            save_s.append(time.perf_counter() - start)
            now = _folder_bytes(folder)
            added.append(now - before)
            before = now
        last = folder / f"step={spec['saves'] - 1}.ckpt"
        start = time.perf_counter()
        loaded = TorchCheckpointIO().load_checkpoint(str(last))
        load_s = time.perf_counter() - start
        for name, tensor in model.state_dict().items():  # the frozen base came back bit for bit
            assert torch.equal(loaded["state_dict"][name], tensor), name
        return {
            "params": params,
            "trainable": trainable,
            "save_s": save_s,
            "bytes_added": added,
            "file_bytes": last.stat().st_size,
            "total_bytes": before,
            "load_s": load_s,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- parent


def _summarize(samples: list[dict], impls: list[str]) -> list[dict]:
    rows = []
    for impl in impls:
        mine = [s for s in samples if s["impl"] == impl]
        if not mine:
            continue
        rows.append(
            {
                "impl": impl,
                "first_save_mb": common.median(s["bytes_added"][0] for s in mine) / MB,
                "later_save_mb": common.median(b for s in mine for b in s["bytes_added"][1:]) / MB,
                "total_mb": common.median(s["total_bytes"] for s in mine) / MB,
                "first_save_s": common.median(s["save_s"][0] for s in mine),
                "later_save_s": common.median(t for s in mine for t in s["save_s"][1:]),
                "load_s": common.median(s["load_s"] for s in mine),
            }
        )
    base = next((r for r in rows if r["impl"] == BASELINE), None)
    if base is not None:
        for row in rows:
            for key in ("later_save_mb", "total_mb", "later_save_s", "first_save_s", "load_s"):
                row[f"{key}_ratio"] = row[key] / base[key]
    return rows


def _render(rows: list[dict], params: int, trainable: int, saves: int, repeats: int) -> str:
    def ratio(row: dict, key: str) -> str:
        return f"{row[key + '_ratio']:.3f}x" if key + "_ratio" in row else "-"

    headers = ["impl", "1st save MB", "each later MB", "vs plain", f"total {saves} MB", "vs plain",
               "1st save s", "later save s", "vs plain", "load s", "vs plain"]  # fmt: skip
    table = [
        [
            r["impl"],
            f"{r['first_save_mb']:.1f}",
            f"{r['later_save_mb']:.2f}",
            ratio(r, "later_save_mb"),
            f"{r['total_mb']:.1f}",
            ratio(r, "total_mb"),
            f"{r['first_save_s']:.3f}",
            f"{r['later_save_s']:.3f}",
            ratio(r, "later_save_s"),
            f"{r['load_s']:.3f}",
            ratio(r, "load_s"),
        ]
        for r in rows
    ]
    return "\n".join(
        [
            f"Trainable-only checkpoints: {params / 1e6:.1f} M float32 parameters, {trainable / 1e6:.2f} M "
            f"({100 * trainable / params:.2f}%) trainable, Adam; {saves} saves per run, median of {repeats} run(s)",
            common.format_table(headers, table),
            "(MB a save adds to the folder: its file plus the blobs it wrote. Loads read the last checkpoint "
            "from the page cache; frozen checks every blob's size and sha256.)",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=None, help="model size (default 25)")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    parser.add_argument("--saves", type=int, default=None, help="checkpoints per run (default 5)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per method (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 M parameters, 3 saves, 1 repeat")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="local folder for the checkpoint files")
    parser.add_argument("--out", type=Path, default=RESULT_PATH)
    parser.add_argument("--show-output", action="store_true", help="let workers print (debugging)")
    args = parser.parse_args(argv)
    if args.params_millions is None:
        args.params_millions = QUICK_PARAMS_MILLIONS if args.quick else DEFAULT_PARAMS_MILLIONS
    if args.saves is None:
        args.saves = QUICK_SAVES if args.quick else DEFAULT_SAVES
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    width, rank = shape_for(args.params_millions, args.layers)
    args.dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    samples: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    impls = list(IMPLS)
    for repeat in range(args.repeats):
        for impl in common.rotated(impls, repeat):
            if impl in failures:
                continue
            spec = {"impl": impl, "width": width, "rank": rank, "layers": args.layers, "saves": args.saves,
                    "dir": str(args.dir)}  # fmt: skip
            try:
                result = common.run_worker(__file__, spec, show_output=args.show_output, timeout=600)
            except common.WorkerError as err:
                failures[impl] = str(err)
                common.log(f"{impl} failed; dropping it from this run:\n{err}")
                continue
            samples.append({**spec, "repeat": repeat, **result})
            common.log(
                f"[{repeat + 1}/{args.repeats}] {impl:<7} saves "
                + " ".join(
                    f"{t:.3f}s/{b / MB:.1f}MB" for t, b in zip(result["save_s"], result["bytes_added"])
                )
                + f"  load {result['load_s']:.3f}s"
            )
    rows = _summarize(samples, impls)
    params = samples[0]["params"] if samples else 0
    trainable = samples[0]["trainable"] if samples else 0
    print(_render(rows, params, trainable, args.saves, args.repeats))
    common.write_json(
        args.out,
        {
            "benchmark": "frozen_checkpoint",
            "config": {
                "params_millions": args.params_millions,
                "params": params,
                "trainable": trainable,
                "layers": args.layers,
                "width": width,
                "rank": rank,
                "saves": args.saves,
                "repeats": args.repeats,
                "dir": str(args.dir),
            },
            "machine": common.machine_info(),
            "versions": common.package_versions(["torch", "trainer-core"]),
            "summary": rows,
            "samples": samples,
            "failures": failures,
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
