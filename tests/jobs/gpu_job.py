"""The job script of the GPU suite (tests/gpu/): one run on CUDA devices, or on the CPU for its dry run.

``--accelerator cuda`` is what the suite is for (nccl between ranks, CUDA autocast, pinned staging
buffers, the CUDA generator); ``--accelerator cpu`` runs the same code on gloo so that the suite's
logic can be checked on a machine without a GPU (``GPU_SUITE_DEVICE=cpu``).

``--scenario`` picks what runs:

* ``train`` (default): ``Net`` (``Linear -> Tanh [-> Dropout] -> Linear``) under ``--plugin`` at
  ``--precision``, with what the options add: an inf written into one rank's gradient after one
  backward (``--inject-inf-step/--inject-inf-rank``), a checkpoint after a given batch
  (``--save-at``), a resume (``--resume``), background checkpoints (``--async-every``).
* ``pipeline``: ``PipeNet`` of tests/jobs/pipeline_job.py under ``PipelinePlugin`` (``--split``), or
  under the single-device plugin (``--plugin single_device``).
* ``model_parallel``: the main configuration of tests/jobs/model_parallel_job.py at ``[tp=devices]``,
  or one process without a plugin (``--plugin single_device``).

Every rank of ``train`` writes ``<run>.rank<r>.json`` (backend, devices, dtypes, per batch: loss,
loss scale, global step) and ``<run>.rank<r>.pt`` (the full weights after every batch, flattened, and
the final full weights); the other scenarios write what their own job scripts write.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint
from trainer_core.plugins.io import TorchCheckpointIO

LR = 0.01
N_SAMPLES = 64
FEATURES = 8


class Net(LightningModule):
    """A small regression; ``inject_inf_at`` (1-based batch count) writes an inf into one gradient of one rank.

    The targets are a tenth of a normal draw, so gradients scaled by fp16's initial loss scale (2**16)
    stay finite: the injected inf is the only overflow of the run.
    """

    def __init__(self, dropout: float = 0.0, inject_inf_at: int = 0, inject_inf_rank: int = 0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(FEATURES, 16), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(16, 1))
        self.net = nn.Sequential(*layers)
        self.inject_inf_at = inject_inf_at
        self.inject_inf_rank = inject_inf_rank
        self.batches_seen = 0  # set from the restored global step at the start of training
        self.output_dtypes: set[str] = set()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.output_dtypes.add(str(out.dtype).removeprefix("torch."))
        loss = nn.functional.mse_loss(out.float(), y)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.batches_seen + 1 != self.inject_inf_at or self.global_rank != self.inject_inf_rank:
            return
        with torch.no_grad():
            for param in self.parameters():
                grad = param.grad
                if grad is None:
                    continue  # ShardedDataParallel frees the gradients another rank owns
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                if local.numel():
                    local.view(-1)[0] = float("inf")
                    return
        raise RuntimeError(f"rank {self.global_rank} holds no gradient to write the inf into")

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=LR)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(N_SAMPLES, FEATURES, generator=g), 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    )


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters on the CPU; FSDP's DTensors are gathered (a collective: every rank calls it)."""
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().float().cpu().clone()
    return out


def _flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([w.reshape(-1) for w in weights.values()])


def _scaler(trainer: Trainer) -> Optional[Any]:
    return getattr(trainer.strategy.precision, "scaler", None)


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


class Record(Callback):
    """Per batch: the full weights, the loss scale, the global step; at the end, what each rank ran on."""

    def __init__(self, out: Path, run: str, save_at: int) -> None:
        self.out = out
        self.run = run
        self.save_at = save_at
        self.trace: list[torch.Tensor] = []
        self.scales: list[Optional[float]] = []
        self.global_steps: list[int] = []
        self.start: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        pl_module.batches_seen = trainer.global_step
        scaler = _scaler(trainer)
        self.start = {
            "global_step": trainer.global_step,
            "scaler": _plain(scaler.state_dict()) if scaler is not None and scaler.is_enabled() else None,
            "scaler_class": type(scaler).__name__ if scaler is not None else None,
        }

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pl_module.batches_seen += 1
        self.trace.append(_flat(full_weights(pl_module)))
        scaler = _scaler(trainer)
        self.scales.append(float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None)
        self.global_steps.append(trainer.global_step)
        if pl_module.batches_seen == self.save_at:
            trainer.save_checkpoint(self.out / f"{self.run}.batch{self.save_at}.ckpt")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # What the checkpoint must hold: the weights at the moment of the save (single device only).
        if trainer.world_size == 1:
            torch.save(
                full_weights(pl_module), self.out / f"{self.run}.expected.step{trainer.global_step}.pt"
            )

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        rank = trainer.global_rank
        final = full_weights(pl_module)
        params = list(pl_module.parameters())
        record = {
            "world_size": trainer.world_size,
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
            "root_device": str(trainer.strategy.root_device),
            "param_devices": sorted({str(p.device) for p in params}),
            "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
            "output_dtypes": sorted(pl_module.output_dtypes),
            "losses": pl_module.losses,
            "scales": self.scales,
            "global_steps": self.global_steps,
            "start": self.start,
            "cuda_initialized": torch.cuda.is_available() and torch.cuda.is_initialized(),
        }
        (self.out / f"{self.run}.rank{rank}.json").write_text(json.dumps(record))
        torch.save(
            {"trace": torch.stack(self.trace) if self.trace else torch.empty(0), "final": final},
            self.out / f"{self.run}.rank{rank}.pt",
        )


class PinRecordingIO(TorchCheckpointIO):
    """The IO under ``AsyncCheckpointIO``: notes whether the staged tensors it is handed are pinned.

    It waits a little before writing, so training changes the parameters while the write is pending:
    a staging copy that shared memory with the model would put later weights into the file.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        tensors = {k: v for k, v in checkpoint["state_dict"].items() if isinstance(v, torch.Tensor)}
        note = {
            "pinned": {k: bool(v.is_pinned()) for k, v in tensors.items()},
            "devices": sorted({str(v.device) for v in tensors.values()}),
        }
        time.sleep(0.2)
        super().save_checkpoint(checkpoint, path, storage_options)
        Path(f"{os.fspath(path)}.staged.json").write_text(json.dumps(note))


def train(args: argparse.Namespace, out: Path) -> None:
    seed_everything(0 if args.resume is None else 1234, verbose=False)
    model = Net(args.dropout, args.inject_inf_step, args.inject_inf_rank)
    callbacks: list[Callback] = [Record(out, args.run, args.save_at)]
    plugins: list[Any] = [args.plugin]
    if args.async_every:
        from trainer_core.plugins.io.async_io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO(PinRecordingIO()))
        callbacks.append(
            ModelCheckpoint(dirpath=str(out / "ckpts"), every_n_train_steps=args.async_every, save_top_k=-1)
        )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        plugins=plugins,
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=bool(args.async_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=str(out / "root"),
    )
    trainer.fit(model, DataLoader(data(), batch_size=args.batch_size), ckpt_path=args.resume)


def pipeline(args: argparse.Namespace, out: Path) -> None:
    from pipeline_job import PipeNet
    from pipeline_job import Record as PipeRecord
    from pipeline_job import data as pipe_data

    class DeviceRecord(PipeRecord):
        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            super().on_train_end(trainer, pl_module)
            path = self.out / f"rank{trainer.global_rank}.json"
            record = json.loads(path.read_text())
            record["param_devices"] = sorted(
                {str(p.device) for p in pl_module.parameters() if p.device.type != "meta"}
            )
            record["backend"] = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
            path.write_text(json.dumps(record))

    seed_everything(0, verbose=False)
    model = PipeNet()
    if args.plugin == "single_device":
        plugin: Any = "single_device"
        devices = 1
    else:
        from trainer_core.plugins.pipeline import PipelinePlugin

        plugin = PipelinePlugin(split_points=[p for p in args.split.split(",") if p], n_microbatches=4)
        devices = args.devices
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=devices,
        plugins=[plugin],
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[DeviceRecord(out, [])],
        default_root_dir=str(out / "root"),
    )
    trainer.fit(model, DataLoader(pipe_data(), batch_size=8), DataLoader(pipe_data(16, seed=1), batch_size=8))


def model_parallel(args: argparse.Namespace, out: Path) -> None:
    from model_parallel_job import fit
    from model_parallel_job import model_parallel as mp_plugin

    if args.plugin == "single_device":
        fit(out, args.run, 1, None, accelerator=args.accelerator)
    else:
        # At one process the plugin keeps the loader's own sampler: the reference's explicit
        # DistributedSampler (``data_parallel=0``) gives both runs one order.
        fit(
            out,
            args.run,
            args.devices,
            mp_plugin(1, args.devices),
            data_parallel=1 if args.devices > 1 else 0,
            accelerator=args.accelerator,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", default="train", choices=["train", "pipeline", "model_parallel"])
    parser.add_argument("--run", default="run", help="prefix of the files this run writes")
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--plugin", default="single_device")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument(
        "--inject-inf-step", type=int, default=0, help="1-based batch whose gradient gets an inf"
    )
    parser.add_argument("--inject-inf-rank", type=int, default=0)
    parser.add_argument("--save-at", type=int, default=0, help="save <run>.batch<N>.ckpt after batch N")
    parser.add_argument("--resume", default=None)
    parser.add_argument(
        "--async-every", type=int, default=0, help="AsyncCheckpointIO, a checkpoint every N steps"
    )
    parser.add_argument("--split", default="", help="pipeline split points, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Full fp32 matmuls on CUDA too (no TF32, torch's default, made explicit): runs are compared to 1e-5.
    torch.set_float32_matmul_precision("highest")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    {"train": train, "pipeline": pipeline, "model_parallel": model_parallel}[args.scenario](args, out)


if __name__ == "__main__":
    main()
