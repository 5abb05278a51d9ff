"""The resharding matrix of tests/checkpoint/test_reshard_matrix.py: checkpoints written under one layout, resumed under another.

Run as a user runs a script: with ``--world 2`` or ``--world 4`` the Trainer starts it again as
the other ranks, and every rank then runs the same list of *actions*, in order, in this one
process group (a group of four ranks trains ``dp2tp2`` and then ``pp2tp2``; of two, ``ddp2``,
``fsdp2``, ``tp2`` and ``pp2``):

* ``write LAYOUT FORMAT``: the uninterrupted run, ``MAX_STEPS`` optimizer steps, with a
  ``ModelCheckpoint`` every ``SAVE_EVERY`` steps in ``FORMAT`` (``"full"``: one file; ``"sharded"``:
  a folder every rank writes its shards into). The checkpoint at ``SAVE_EVERY`` is what the readers
  resume from; the one at ``MAX_STEPS`` holds the final weights.
* ``read LAYOUT FORMAT SOURCE CKPT``: with fresh seeds, a run under ``LAYOUT`` resumed from the
  checkpoint ``CKPT`` to ``MAX_STEPS``, ending with its own checkpoint in ``FORMAT``.

Each run records, from global rank 0, the loss of every optimizer step (the mean over the whole
global batch, on every layout) and the learning rate after it, in ``record.json`` beside its
checkpoints. Every layout sees the same global batch of ``GLOBAL_BATCH`` samples at each step:
the data is not shuffled, and a data-parallel rank's sampler takes every ``dp``-th sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint

MAX_STEPS = 6
SAVE_EVERY = 3
N_SAMPLES = 40  # five steps an epoch: the resume lands mid-epoch and the run crosses an epoch end
GLOBAL_BATCH = 8
N_MICROBATCHES = 2
SEQ, D_IN, WIDTH, N_CLASSES = 5, 8, 16, 3
N_BLOCKS = 4
CLIP = 0.5
WRITER_SEED = 7
READER_SEED = 1234

#: layout -> (processes, data-parallel size)
LAYOUTS: dict[str, tuple[int, int]] = {
    "single": (1, 1),
    "ddp2": (2, 2),
    "fsdp2": (2, 2),
    "tp2": (2, 1),
    "dp2tp2": (4, 2),
    "pp2": (2, 1),
    "pp2tp2": (4, 1),
}
FORMATS = ("full", "sharded")
#: Layouts whose checkpoint is always one file, whatever the format asks.
FILE_WRITERS = ("single", "ddp2")


class Block(nn.Module):
    """Pre-norm MLP with a residual connection; ``w1`` column-wise and ``w2`` row-wise under tensor parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.w1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.w2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class ReshardNet(LightningModule):
    """A small transformer-like chain that trains under every layout of the matrix.

    ``forward`` runs ``inp``, the ``layers`` and ``out`` as a chain, so pipeline stages are the
    module with the other stages' layers replaced (``pipeline_manual_split``); ``configure_model``
    applies the tensor-parallel plan when the mesh has a tensor-parallel dimension of more than one rank.
    """

    pipeline_manual_split = True

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, WIDTH)
        self.layers = nn.ModuleList([Block() for _ in range(N_BLOCKS)])
        self.out = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, N_CLASSES), target.reshape(-1))

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        tp_mesh = mesh["tensor_parallel"]
        if tp_mesh.size() == 1:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.layers:
            parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        # The mean over the data-parallel ranks: the loss of the whole global batch, as one process sees it.
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, SEQ, D_IN, generator=g)
    y = torch.randint(0, N_CLASSES, (N_SAMPLES, SEQ), generator=g)
    return TensorDataset(x, y)


def plugin(layout: str, fmt: str) -> Any:
    """The plugin of ``layout`` writing checkpoints in ``fmt`` (``None``: one process, no plugin)."""
    from trainer_core.plugins import FSDPPlugin, ModelParallelPlugin, PipelineModelParallelPlugin

    sharded = fmt == "sharded"
    pipeline = {"split_points": ["layers.2"], "n_microbatches": N_MICROBATCHES}
    if layout == "single":
        return None
    if layout == "ddp2":
        return "ddp"
    if layout == "fsdp2":
        return FSDPPlugin(state_dict_type=fmt)
    if layout == "tp2":
        return ModelParallelPlugin(
            data_parallel_size=1, tensor_parallel_size=2, save_distributed_checkpoint=sharded
        )
    if layout == "dp2tp2":
        return ModelParallelPlugin(
            data_parallel_size=2, tensor_parallel_size=2, save_distributed_checkpoint=sharded
        )
    if layout == "pp2":
        return PipelineModelParallelPlugin(
            pipeline_parallel_size=2,
            tensor_parallel_size=1,
            data_parallel_size=1,
            save_distributed_checkpoint=sharded,
            **pipeline,
        )
    if layout == "pp2tp2":
        return PipelineModelParallelPlugin(
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            data_parallel_size=1,
            save_distributed_checkpoint=sharded,
            **pipeline,
        )
    raise ValueError(f"unknown layout {layout!r}")


class Recorder(Callback):
    """Every optimizer step's global-batch loss and learning rate, written by global rank 0 at the end.

    Beside rank 0's learning rate, ``group_lrs`` holds, per step, the rate of every param group on
    every rank (a pipeline rank steps the optimizer of its own stage), gathered once at the end.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: dict[int, tuple[float, float]] = {}
        self.group_lrs: dict[int, list[float]] = {}
        self.start_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        groups = trainer.optimizers[0].param_groups
        self.steps[step] = (float(trainer.callback_metrics["train_loss"]), float(groups[0]["lr"]))
        self.group_lrs[step] = [float(group["lr"]) for group in groups]

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        every_rank = [self.group_lrs]
        if trainer.world_size > 1:
            every_rank = [{} for _ in range(trainer.world_size)]
            dist.all_gather_object(every_rank, self.group_lrs)
        if trainer.global_rank == 0:
            group_lrs = {step: [lr for rank in every_rank for lr in rank[step]] for step in self.steps}
            record = {"start_step": self.start_step, "steps": self.steps, "group_lrs": group_lrs}
            self.path.write_text(json.dumps(record))


def run(out: Path, layout: str, fmt: str, seed: int, ckpt_path: Optional[str] = None) -> None:
    """Train ``layout`` to ``MAX_STEPS`` (from ``ckpt_path`` if given), checkpointing every ``SAVE_EVERY`` steps into ``out``."""
    world, dp = LAYOUTS[layout]
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = ModelCheckpoint(
        dirpath=str(out), filename="{step}", every_n_train_steps=SAVE_EVERY, save_top_k=-1
    )
    kwargs: dict[str, Any] = {"devices": world}
    if plugin(layout, fmt) is not None:
        kwargs["plugins"] = plugin(layout, fmt)
    trainer = Trainer(
        max_steps=MAX_STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
        callbacks=[checkpoints, Recorder(out / "record.json")],
        **kwargs,
    )
    seed_everything(seed, verbose=False)
    model = ReshardNet()
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp, shuffle=False, drop_last=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="root folder of every run")
    parser.add_argument("--world", type=int, required=True, help="the processes of every layout run here")
    parser.add_argument(
        "--actions",
        required=True,
        help='a JSON file: a list of ["write", layout, format] and ["read", layout, format, source, ckpt]',
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The loss is taken out of place from the module's output, which FSDP2 warns may be a view.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    root = Path(args.out)
    for action in json.loads(Path(args.actions).read_text()):
        kind, layout, fmt = action[:3]
        assert LAYOUTS[layout][0] == args.world, (layout, args.world)
        folder = root / (
            write_folder(layout, fmt) if kind == "write" else read_folder(layout, fmt, action[3])
        )
        began = time.perf_counter()
        try:
            if kind == "write":
                run(folder, layout, fmt, WRITER_SEED)
            else:
                run(folder, layout, fmt, READER_SEED, ckpt_path=action[4])
        except Exception:
            # The traceback goes beside the cell's record, for the test to name the failed cell and its
            # cause. The launch ends here: a failed fit takes the other ranks down with it.
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"error.rank{os.environ.get('LOCAL_RANK', '0')}.txt").write_text(traceback.format_exc())
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":
            took = time.perf_counter() - began
            print(f"reshard_job: {' '.join(action[:4])}: {took:.1f} s", file=sys.stderr)


def write_folder(layout: str, fmt: str) -> str:
    return f"write/{layout}-{fmt}"


def read_folder(layout: str, fmt: str, source: str) -> str:
    return f"read/{layout}-{fmt}-from-{source}"


def checkpoint_name(step: int) -> str:
    """The name ``ModelCheckpoint(filename="{step}")`` gives the checkpoint at ``step``."""
    return f"step={step}.ckpt"


if __name__ == "__main__":
    main()
