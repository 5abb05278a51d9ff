"""A job script for tests/plugins/test_model_parallel.py, run the way users run ``ModelParallelPlugin``.

``--suite`` picks what the processes of one launch train, one ``fit`` after the other in the same
process group (so that a launch pays the start of its interpreters once):

* ``reference``: one process, no plugin: the runs every layout is compared with (``main``, and
  ``in_backward`` with ``Trainer(optimizer_in_backward=True)``).
* ``tp2``: 2 processes, ``[tp=2]``: ``tp`` (the main configuration), ``sp`` (sequence parallel and
  loss parallel), ``in_backward`` and ``bf16`` (FSDP's mixed-precision policy).
* ``dp2tp2``: 4 processes, ``[dp=2, tp=2]``: ``dp2tp2`` (the main configuration, writing a sharded
  checkpoint at step ``SAVE_SHARDED_AT``), ``resume_sharded`` (resumes from it with
  ``save_distributed_checkpoint=False`` and writes a full file at ``SAVE_FULL_AT``) and
  ``resume_full`` (resumes from that file).
* ``dp2tp2_extra``: 4 processes, ``[dp=2, tp=2]``: ``sp``, ``in_backward`` and ``bf16``.
* ``bad_plan`` / ``no_tp``: 2 processes whose ``configure_model`` names a missing submodule in its
  plan, or applies no tensor parallelism at all: every rank writes the error it got to
  ``<suite>.error<rank>.txt`` and re-raises. ``errors``: both in one process group, the first
  caught after it is written, the second ending the processes.
* ``gpu`` / ``gpu_reference``: the main configuration on two CUDA devices (nccl), or on one.

The main configuration trains ``TinyTransformer`` (two pre-norm attention + MLP blocks) with AdamW,
a per-step learning-rate schedule, gradient clipping by norm and ``accumulate_grad_batches=2`` on a
shuffled ``DataLoader`` of ``N_SAMPLES`` samples, ``GLOBAL_BATCH`` per batch across the
data-parallel ranks. The one-process reference reads the same order: its sampler is a
``DistributedSampler`` with one replica and the plugin's seed, whose permutation the data-parallel
ranks split.

Each run writes ``<run>.rank<r>.json`` (per batch: the loss and sample count logged with
``sync_dist=True``, the sample indices the rank read, the learning rate; per optimizer step: the
total gradient norm before and after clipping; per epoch: the summed sample count; the dtypes of
the stored parameters) and rank 0 writes ``<run>.weights.pt``, the full parameters gathered after
training.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback

DIM, HEADS, HIDDEN, N_LAYERS, VOCAB, FEATURES, SEQ = 16, 4, 32, 2, 24, 8, 6
N_SAMPLES = 64
GLOBAL_BATCH = 8
ACCUMULATE = 2
MAX_STEPS = 6  # 8 batches, 4 optimizer steps per epoch: the last two steps are in the second epoch
CLIP = 0.05  # below the gradient norms of every step (the test checks), so clipping always acts
LR = 0.01
SEED = 0
SAVE_SHARDED_AT = 2
SAVE_FULL_AT = 5


# ---------------------------------------------------------------------- the model
class Attention(nn.Module):
    """Causal multi-head attention written out, so that tensor parallelism splits its heads.

    The key projection has no bias: its gradient is exactly zero (a per-query constant added to
    every score, which softmax ignores), so Adam would turn float noise in it into steps of size lr
    that differ between layouts.
    """

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # ``-1`` heads: under tensor parallelism each rank holds HEADS / tp of them.
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tensor_parallel_plan() -> dict[str, Any]:
    """Column-wise q, k, v, w1 and row-wise o, w2: one all-reduce per sub-block."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(),
    }


def sequence_parallel_plans() -> tuple[dict[str, Any], dict[str, Any]]:
    """Per block and for the root: LayerNorms on sequence shards, logits sharded over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    block = {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    root = {
        "layers.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    return block, root


class TinyTransformer(LightningModule):
    """An input projection, two transformer blocks, a final LayerNorm and a vocabulary head.

    ``plan`` says what ``configure_model`` applies on the tensor-parallel mesh: ``"tp"`` (the plain
    plan), ``"sp"`` (sequence parallel + loss parallel: the loss is computed, and ``backward`` run,
    inside ``loss_parallel()``, as Lightning's tensor-parallel example does), ``"missing"`` (a plan
    entry naming no submodule) or ``"none"`` (nothing). ``shard_blocks``: ``configure_model`` also
    calls ``fully_shard`` on each block itself (the plugin then shards only the root).
    """

    def __init__(self, plan: str = "tp", shard_blocks: bool = False, scheduler: bool = True) -> None:
        super().__init__()
        self.plan = plan
        self.shard_blocks = shard_blocks
        self.scheduler = scheduler
        self.embed = nn.Linear(FEATURES, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(N_LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or self.plan == "none" or mesh["tensor_parallel"].size() == 1:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = mesh["tensor_parallel"]
        if self.plan == "sp":
            block_plan, root_plan = sequence_parallel_plans()
        else:
            block_plan, root_plan = tensor_parallel_plan(), {}
        if self.plan == "missing":
            block_plan["attn.qkv"] = block_plan.pop("attn.q")
        for layer in self.layers:
            parallelize_module(layer, tp_mesh, block_plan)
        if root_plan:
            parallelize_module(self, tp_mesh, root_plan)
        if self.shard_blocks:
            from torch.distributed.fsdp import fully_shard

            for layer in self.layers:
                fully_shard(layer, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        logits = self(x)
        if self.plan == "sp":
            from torch.distributed.tensor.parallel import loss_parallel

            # The logits are a DTensor sharded over the vocabulary: the loss is too, replicated.
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            value = loss.full_tensor()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            value = loss
        self.log("train_loss", value.detach().float(), sync_dist=True)
        self.log("samples", float(len(x)), reduce_fx="sum", sync_dist=True)
        self.log(
            "epoch_samples", float(len(x)), reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True
        )
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.plan != "sp":
            return super().backward(loss, *args, **kwargs)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(loss, *args, **kwargs)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ---------------------------------------------------------------------- data
class IndexedData(Dataset):
    """Random token features and targets; each sample also returns its index, to record who read what."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N_SAMPLES, SEQ, FEATURES, generator=g)
        self.y = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def train_loader(data_parallel: int) -> DataLoader:
    """What a user writes (a shuffled loader, the per-rank batch); one process gets the plugin's order."""
    if data_parallel == 0:
        # One process, no plugin to swap the sampler: the permutation that the ranks of a
        # model-parallel run split (``DistributedSampler`` with the seed of ``seed_everything``).
        sampler = DistributedSampler(IndexedData(), num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(IndexedData(), batch_size=GLOBAL_BATCH, sampler=sampler)
    return DataLoader(IndexedData(), batch_size=GLOBAL_BATCH // data_parallel, shuffle=True)


# ---------------------------------------------------------------------- recording
class Recorder(Callback):
    """What each rank saw and logged, per batch, per optimizer step and per epoch; the final weights."""

    def __init__(self, out: Path, run: str, save_at: Optional[int] = None) -> None:
        self.out = out
        self.run = run
        self.save_at = save_at
        self.batches: dict[str, dict[str, Any]] = {}
        self.grad_norms: dict[int, float] = {}
        self.clipped_norms: dict[int, float] = {}
        self.epoch_samples: dict[int, float] = {}
        self.start_step = 0
        self._step_before = 0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = trainer.callback_metrics
        self.batches[f"{trainer.current_epoch}:{batch_idx}"] = {
            "loss": float(metrics["train_loss"]),
            "samples": float(metrics["samples"]),
            "indices": batch[2].tolist(),
            "global_step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        stepped = trainer.global_step != self._step_before
        if stepped and trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.out / f"{self.run}.step{self.save_at}.ckpt")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        value = trainer.callback_metrics.get("epoch_samples")
        if value is not None:
            self.epoch_samples[trainer.current_epoch] = float(value)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        from torch.distributed.tensor import DTensor

        full: dict[str, torch.Tensor] = {}
        dtypes: dict[str, str] = {}
        tensor_parallel = []
        for name, param in pl_module.named_parameters():
            dtypes[name] = str(param.dtype).removeprefix("torch.")
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                if "tensor_parallel" in names and param.device_mesh.size(names.index("tensor_parallel")) > 1:
                    tensor_parallel.append(name)
                full[name] = param.full_tensor().detach().cpu().clone()  # a collective: every rank
            else:
                full[name] = param.detach().cpu().clone()
        rank = trainer.global_rank
        record = {
            "world_size": trainer.world_size,
            "start_step": self.start_step,
            "batches": self.batches,
            "grad_norms": self.grad_norms,
            "clipped_norms": self.clipped_norms,
            "epoch_samples": self.epoch_samples,
            "dtypes": dtypes,
            "tensor_parallel_params": tensor_parallel,
        }
        (self.out / f"{self.run}.rank{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save(full, self.out / f"{self.run}.weights.pt")


class NormRecorder(Recorder):
    """Also the total gradient norm per optimizer step, before and after clipping (not for stepping in backward).

    After the step the gradients are still there (they are zeroed when the next cycle starts), clipped.
    """

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grad_norms[trainer.global_step + 1] = _grad_norm(pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._step_before:
            self.clipped_norms[trainer.global_step] = _grad_norm(pl_module)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _grad_norm(module: nn.Module) -> float:
    """The norm of all of ``module``'s gradients together, over every shard (a collective)."""
    from trainer_core.plugins.parallel import total_grad_norm

    return float(total_grad_norm([p.grad for p in module.parameters() if p.grad is not None]))


# ---------------------------------------------------------------------- runs
def fit(
    out: Path,
    run: str,
    devices: int,
    plugin: Any,
    model: Optional[dict[str, Any]] = None,
    data_parallel: int = 0,
    save_at: Optional[int] = None,
    ckpt_path: Optional[str] = None,
    accelerator: str = "cpu",
    **trainer_kwargs: Any,
) -> None:
    """One ``fit`` of ``MAX_STEPS`` steps, recorded: the main configuration unless ``trainer_kwargs`` change it.

    ``model`` holds ``TinyTransformer``'s arguments: the module is built after seeding, so that every run
    starts from the same weights.
    """
    # A resumed run starts from other seeds: what it needs must come from the checkpoint.
    seed_everything(SEED if ckpt_path is None else 1234, verbose=False)
    os.environ["PL_GLOBAL_SEED"] = str(SEED)  # the sampler's seed is the run's, not the resume's
    module = TinyTransformer(**(model or {}))
    kwargs: dict[str, Any] = {
        "gradient_clip_val": CLIP,
        "accumulate_grad_batches": ACCUMULATE,
    }
    kwargs.update(trainer_kwargs)
    recorder = Recorder if kwargs.get("optimizer_in_backward") else NormRecorder
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        plugins=plugin,
        max_steps=MAX_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder(out, run, save_at)],
        default_root_dir=str(out / "root"),
        **kwargs,
    )
    trainer.fit(module, train_loader(data_parallel), ckpt_path=ckpt_path)


def model_parallel(dp: int, tp: int, **kwargs: Any) -> Any:
    from trainer_core.plugins import ModelParallelPlugin

    return ModelParallelPlugin(data_parallel_size=dp, tensor_parallel_size=tp, **kwargs)


def run_suite(suite: str, out: Path) -> None:
    no_clip = {"gradient_clip_val": None, "accumulate_grad_batches": 1}
    if suite == "reference":
        fit(out, "main", 1, None)
        fit(out, "in_backward", 1, None, optimizer_in_backward=True, **no_clip)
    elif suite == "tp2":
        fit(out, "tp", 2, model_parallel(1, 2), data_parallel=1)
        fit(out, "sp", 2, model_parallel(1, 2), {"plan": "sp"}, data_parallel=1)
        fit(
            out,
            "in_backward",
            2,
            model_parallel(1, 2),
            data_parallel=1,
            optimizer_in_backward=True,
            **no_clip,
        )
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fit(out, "bf16", 2, model_parallel(1, 2, mixed_precision=policy), data_parallel=1)
    elif suite == "dp2tp2":
        sharded = out / f"dp2tp2.step{SAVE_SHARDED_AT}.ckpt"
        full = out / f"resume_sharded.step{SAVE_FULL_AT}.ckpt"
        fit(out, "dp2tp2", 4, model_parallel(2, 2), {"shard_blocks": True}, 2, save_at=SAVE_SHARDED_AT)
        fit(
            out,
            "resume_sharded",
            4,
            model_parallel(2, 2, save_distributed_checkpoint=False),
            {"shard_blocks": True},
            2,
            save_at=SAVE_FULL_AT,
            ckpt_path=str(sharded),
        )
        fit(
            out,
            "resume_full",
            4,
            model_parallel(2, 2, save_distributed_checkpoint=False),
            {"shard_blocks": True},
            2,
            ckpt_path=str(full),
        )
    elif suite == "dp2tp2_extra":
        fit(out, "sp", 4, model_parallel(2, 2), {"plan": "sp"}, 2)
        fit(
            out,
            "in_backward",
            4,
            model_parallel(2, 2),
            data_parallel=2,
            optimizer_in_backward=True,
            **no_clip,
        )
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fit(out, "bf16", 4, model_parallel(2, 2, mixed_precision=policy), data_parallel=2)
    elif suite in ("bad_plan", "no_tp", "errors"):
        # ``errors``: both, in one process group; the first is caught, the second ends the process.
        for bad in ("bad_plan", "no_tp") if suite == "errors" else (suite,):
            model = {"plan": "missing" if bad == "bad_plan" else "none"}
            try:
                fit(out, bad, 2, model_parallel(1, 2), model, data_parallel=1)
            except Exception as err:
                rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
                (out / f"{bad}.error{rank}.txt").write_text(f"{type(err).__name__}: {err}")
                if bad == "no_tp" or suite != "errors":
                    raise
    elif suite == "gpu":
        fit(out, "gpu", 2, model_parallel(1, 2), data_parallel=1, accelerator="cuda")
    elif suite == "gpu_reference":
        fit(out, "gpu_reference", 1, None, accelerator="cuda")
    else:
        raise SystemExit(f"unknown suite {suite!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--suite", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_suite(args.suite, out)


if __name__ == "__main__":
    main()
