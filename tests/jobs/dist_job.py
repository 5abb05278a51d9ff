"""A data-parallel job script for tests/test_distributed*.py, run the way users run ``plugins="ddp"``.

Every rank writes what the tests compare into ``--out`` (a folder): ``rank<r>.json`` (losses,
ranks, environment, sampler, process ids, callback metrics), ``rank<r>.pt`` (final weights), and,
on request, which ranks called ``CheckpointIO.save_checkpoint`` and the state right after a restore.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint
from trainer_core.loggers import CSVLogger
from trainer_core.plugins.io import TorchCheckpointIO

LR = 0.01


class Meter(nn.Module):
    """Records running statistics in *extra state*, as TransformerEngine layers keep FP8 metadata.

    ``payload="tensor"`` returns a tensor from ``get_extra_state``; ``payload="bytes"`` an
    ``io.BytesIO`` holding a torch-saved dict, TransformerEngine's own choice.
    """

    def __init__(self, payload: str) -> None:
        super().__init__()
        self.payload = payload
        self.amax = torch.zeros(4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.amax = torch.maximum(self.amax, x.detach().abs().amax(dim=0)[:4])
        return x

    def get_extra_state(self) -> Any:
        if self.payload == "tensor":
            return torch.cat([self.amax, torch.tensor([float(self.calls)])])
        buffer = io.BytesIO()
        torch.save({"amax": self.amax.clone(), "calls": self.calls}, buffer)
        return buffer

    def set_extra_state(self, state: Any) -> None:
        if isinstance(state, torch.Tensor):
            self.amax, self.calls = state[:4].clone(), int(state[4].item())
            return
        state.seek(0)
        loaded = torch.load(state, weights_only=True)
        self.amax, self.calls = loaded["amax"], loaded["calls"]

    def snapshot(self) -> dict[str, Any]:
        return {"amax": self.amax.tolist(), "calls": self.calls}


class Net(LightningModule):
    def __init__(
        self,
        optimizer: str = "adam",
        dropout: float = 0.0,
        fail_on_rank: int = -1,
        log_rank_metric: bool = False,
        extra_state: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.meter = Meter(extra_state) if extra_state else None
        self.optimizer_kind = optimizer
        self.fail_on_rank = fail_on_rank
        self.log_rank_metric = log_rank_metric
        layers: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(16, 1))
        self.net = nn.Sequential(*layers)
        self.losses: list[float] = []
        # A fingerprint of this rank's gradient after each backward: shows whether DDP synchronised it.
        self.grad_sums: list[Optional[float]] = []

    def configure_model(self) -> None:
        if os.environ.get("DIST_JOB_SHARD_IN_CONFIGURE_MODEL"):
            # The module shards itself (Lightning's configure_model idiom); the plugin then only wraps the root.
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net[0], mesh=self.trainer.strategy.device_mesh)

    def on_after_backward(self) -> None:
        grad = self.net[0].weight.grad
        self.grad_sums.append(None if grad is None else grad.sum().item())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.fail_on_rank and batch_idx == 2:
            raise RuntimeError(f"deliberate failure in training_step on rank {self.global_rank}")
        x, y = batch
        if self.meter is not None:
            x = self.meter(x)
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.log_rank_metric:
            # Rank-dependent: rank 0 logs 10 + batch_idx, rank 1 logs 20 + batch_idx.
            value = torch.tensor(10.0 * (self.global_rank + 1) + batch_idx)
            self.log("rank_metric", value, sync_dist=True, on_step=False, on_epoch=True, prog_bar=True)
            self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_kind == "oss":
            from fairscale.optim import OSS

            return OSS(self.parameters(), optim=torch.optim.Adam, lr=LR)
        if self.optimizer_kind == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
        if self.optimizer_kind == "sgd":
            # No momentum: an optimizer whose state holds no tensors at all.
            return torch.optim.SGD(self.parameters(), lr=LR)
        return torch.optim.Adam(self.parameters(), lr=LR)


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RecordingIO(TorchCheckpointIO):
    """Writes as usual, and records in a file of its own rank that this rank called ``save_checkpoint``."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        rank = _rank()
        with open(os.path.join(self.folder, f"io_calls.rank{rank}.txt"), "a") as f:
            f.write(f"{rank} {os.fspath(path)}\n")
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


class Record(Callback):
    """At ``on_train_start``: this rank's identity, and (rank 0) the state right after any restore."""

    def __init__(self, out: str, dump_restored: bool) -> None:
        self.out = out
        self.dump_restored = dump_restored
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        plugin = trainer.strategy
        loader = trainer.train_dataloader
        self.seen = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "plugin": plugin.name,
            "environment": type(getattr(plugin, "cluster_environment", None)).__name__,
            "sampler": type(loader.sampler).__name__ if loader is not None else None,
            "train_batches": trainer.num_training_batches,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "children": _child_pids(),
            "global_step": trainer.global_step,
            "meter_at_start": pl_module.meter.snapshot() if pl_module.meter is not None else None,
            "fsdp_units": sorted(
                name or "<root>"
                for name, m in pl_module.named_modules()
                if type(m).__name__.startswith("FSDP")
            ),
        }
        with open(os.path.join(self.out, f"pid.rank{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))
        if self.dump_restored:
            # Consolidation (or FSDP's gathering) is a collective: every rank calls it, rank 0 holds the result.
            states = [_full(plugin.named_optimizer_state(opt)) for opt in plugin.optimizers]
            full_weights = _full(plugin.lightning_module_state_dict())
            if trainer.is_global_zero:
                weights = {
                    k: v.detach().clone() for k, v in full_weights.items() if isinstance(v, torch.Tensor)
                }
                torch.save(
                    {"weights": weights, "optimizer_states": states, "global_step": trainer.global_step},
                    os.path.join(self.out, "restored.pt"),
                )

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        # Written inside every rank (also the ranks ddp_spawn starts), before the plugin tears down.
        rank = trainer.global_rank
        result = {
            **self.seen,
            "losses": pl_module.losses,
            "grad_sums": pl_module.grad_sums,
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "final_global_step": trainer.global_step,
        }
        weights = pl_module.state_dict()
        if any(hasattr(v, "full_tensor") for v in weights.values()):
            # FSDP: every rank takes part in gathering the full parameters, then keeps a copy.
            weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in weights.items()}
        torch.save(
            {k: v.detach().clone() for k, v in weights.items() if isinstance(v, torch.Tensor)},
            os.path.join(self.out, f"rank{rank}.pt"),
        )
        with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def _resume_many(args: argparse.Namespace, out: Path) -> None:
    """One process group, several restores: what each loading plugin sees right after each restore."""
    for index, path in enumerate(args.resume_many.split(",")):
        folder = out / f"many{index}"
        folder.mkdir(parents=True, exist_ok=True)
        seed_everything(0, verbose=False)
        trainer = Trainer(
            plugins=[_plugin(args.plugin)],
            devices=args.devices,
            max_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Record(str(folder), True)],
        )
        trainer.fit(Net(), DataLoader(data(), batch_size=args.batch_size), ckpt_path=path)


def _full(obj: Any) -> Any:
    """DTensor shards (sharded FSDP state) gathered to whole tensors; every rank must call this."""
    if hasattr(obj, "full_tensor"):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full(v) for v in obj]
    return obj


def _plugin(name: str) -> Any:
    """A registered name, or one of the FSDP variants the tests use."""
    from trainer_core.plugins import FSDPPlugin

    if name == "fsdp_sharded":
        return FSDPPlugin(state_dict_type="sharded")
    if name == "hsdp":
        return FSDPPlugin(state_dict_type="sharded", hybrid_shard=(2, 2))
    if name == "fsdp_bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return FSDPPlugin(
            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
    if name == "fsdp_offload":
        return FSDPPlugin(cpu_offload=True, reshard_after_forward=False)
    if name == "fsdp_wrap":
        return FSDPPlugin(auto_wrap_policy={nn.Linear})
    return name


def _child_pids() -> list[int]:
    """Processes whose parent is this one, read from /proc (Linux)."""
    me = os.getpid()
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            children.append(int(entry))
    return children


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val (by norm)")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--optimizer", default="adam", choices=["adam", "oss", "zero", "sgd"])
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--fail-on-rank", type=int, default=-1)
    parser.add_argument("--ckpt-every-steps", type=int, default=0)
    parser.add_argument("--ckpt-every-epoch", action="store_true")
    parser.add_argument("--record-io", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--dump-restored", action="store_true")
    parser.add_argument("--log-rank-metric", action="store_true")
    parser.add_argument("--logger", action="store_true")
    parser.add_argument("--progress-bar", action="store_true")
    parser.add_argument("--stderr-per-rank", action="store_true")
    parser.add_argument("--extra-state", choices=["tensor", "bytes"], default=None)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint folder URL (default OUT/ckpts)")
    parser.add_argument(
        "--resume-many",
        default=None,
        help="comma-separated checkpoints: restore each in turn, record, train 1 step",
    )
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.stderr_per_rank:
        # Our own launch ("ddp") gives the children LOCAL_RANK; what each process prints lands in its own file.
        local = int(os.environ.get("LOCAL_RANK", 0))
        fd = os.open(out / f"stderr.local{local}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        print(f"stderr of local rank {local}", file=sys.stderr, flush=True)

    if args.resume_many:
        _resume_many(args, out)
        return
    seed_everything(0, verbose=False)
    model = Net(args.optimizer, args.dropout, args.fail_on_rank, args.log_rank_metric, args.extra_state)
    record = Record(str(out), args.dump_restored)
    callbacks: list[Callback] = [record]
    if args.ckpt_every_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir or str(out / "ckpts"),
                every_n_train_steps=args.ckpt_every_steps,
                save_top_k=-1,
            )
        )
    elif args.ckpt_every_epoch:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir or str(out / "ckpts"), every_n_epochs=1, save_top_k=-1)
        )
    plugins: list[Any] = [_plugin(args.plugin)]
    if args.record_io:
        plugins.append(RecordingIO(str(out)))
    trainer = Trainer(
        plugins=plugins,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        # CSV explicitly: with tensorboard installed, logger=True would pick TensorBoardLogger.
        logger=CSVLogger(str(out / "root")) if args.logger else False,
        enable_checkpointing=bool(args.ckpt_every_steps or args.ckpt_every_epoch or args.logger),
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        callbacks=callbacks,
        default_root_dir=str(out / "root"),
    )
    loader = DataLoader(data(), batch_size=args.batch_size, shuffle=args.shuffle)
    trainer.fit(model, loader, ckpt_path=args.resume)
    if trainer.is_global_zero:
        # The process the user started: under ddp_spawn it holds rank 0's results once fit returns.
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
            out / "caller.pt",
        )
        with open(out / "caller.json", "w") as f:
            json.dump({"callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}, f)


if __name__ == "__main__":
    main()
