"""A job script for tests/plugins/test_fsdp_gather.py: one rank of a gloo group, started with RANK/WORLD_SIZE.

It shards small models with FSDP2 (``fully_shard`` on a 1-D mesh of all ranks, and on a 2-D HSDP
mesh), steps Adam or SGD with momentum once, and compares, on every rank, the full state dicts of
``gather_full_state_dict`` (at several bucket sizes) with torch's own
``get_model_state_dict`` / ``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``:
same keys in the same order, the same containers, tensors of the same dtype and shape and
``torch.equal``. Every ``dist.gather`` the buckets make is recorded (its size on each rank). Then,
in the same process group, ``FSDPPlugin(state_dict_type="full")`` trains a small module two steps
and saves it twice at the end, with the buckets and with torch's path
(``GATHER_BUCKET_BYTES = None``); rank 0 compares the two files. Each rank writes
``rank<r>.json``: per case, the differences found (none expected), the number of tensors, and the
collectives.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer_core import LightningModule, Trainer
from trainer_core.plugins import fsdp_gather
from trainer_core.plugins.fsdp import FSDPPlugin

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
SHARDED = StateDictOptions(full_state_dict=False)


class Uneven(nn.Module):
    """First dimensions that 2 and 3 ranks do not divide (5, 7, 1, 3), fp32 and bf16 parameters, a frozen
    layer, and int64, bool and float buffers that FSDP leaves unsharded."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.low = nn.Linear(7, 5).to(torch.bfloat16)
        self.frozen = nn.Linear(5, 3)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(3)  # running stats and an int64 num_batches_tracked
        self.out = nn.Linear(3, 1)  # weight (1, 3), bias (1,): one row, so some ranks hold none
        self.big = nn.Parameter(torch.randn(37, 4, 3))  # several rows per rank, three dimensions
        self.register_buffer("counts", torch.arange(5))
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.low(h.to(torch.bfloat16))).float()
        h = self.norm(self.frozen(h))
        return self.out(h) + self.big.sum()


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    for sub in (model.inp, model.low, model.frozen, model.out):
        fully_shard(sub, mesh=mesh)  # one dtype per FSDP group: bf16 apart
    fully_shard(model, mesh=mesh)
    return model


def _stepped(mesh: Any, optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _shard(Uneven(), mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-2)
    else:
        opt = torch.optim.SGD(
            [{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.05}], lr=0.1, momentum=0.9
        )
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def differences(got: Any, expected: Any, path: str = "") -> list[str]:
    """Where two states differ: keys or their order, container types, dtype, shape or values."""
    if type(got) is not type(expected):
        return [f"{path}: {type(got).__name__} != {type(expected).__name__}"]
    if isinstance(expected, dict):
        if list(got) != list(expected):
            return [f"{path}: keys {list(got)} != {list(expected)}"]
        return [d for k in expected for d in differences(got[k], expected[k], f"{path}.{k}")]
    if isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            return [f"{path}: length {len(got)} != {len(expected)}"]
        return [d for i, (g, e) in enumerate(zip(got, expected)) for d in differences(g, e, f"{path}[{i}]")]
    if isinstance(expected, torch.Tensor):
        if got.dtype != expected.dtype or got.shape != expected.shape or got.device != expected.device:
            return [
                f"{path}: {got.dtype}{tuple(got.shape)} on {got.device} != {expected.dtype}{tuple(expected.shape)}"
            ]
        return [] if torch.equal(got, expected) else [f"{path}: values differ"]
    return [] if got == expected else [f"{path}: {got!r} != {expected!r}"]


def _count_tensors(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(_count_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_count_tensors(v) for v in state)
    return 0


class GatherLog:
    """Records the bytes every ``dist.gather`` sends from this rank (the buckets' collectives)."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self._original = dist.gather

    def __enter__(self) -> GatherLog:
        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.sent.append(tensor.numel() * tensor.element_size())
            return self._original(tensor, *args, **kwargs)

        dist.gather = recorded
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.gather = self._original


def _compare(name: str, get: Callable[[StateDictOptions], dict], buckets: dict[str, int]) -> list[dict]:
    expected = get(FULL)
    results = []
    for label, size in buckets.items():
        with GatherLog() as log:
            got = fsdp_gather.gather_full_state_dict(get(SHARDED), bucket_bytes=size)
        results.append(
            {
                "case": f"{name}/{label}",
                "bucket_bytes": size,
                "differences": differences(got, expected),
                "tensors": _count_tensors(got),
                "sent": log.sent,
                "can_gather": fsdp_gather.can_gather(get(SHARDED)),
            }
        )
    return results


def _compare_model_and_optimizer(
    name: str, model: nn.Module, opt: torch.optim.Optimizer, buckets: dict[str, int]
) -> list[dict]:
    return _compare(f"{name}-model", lambda o: get_model_state_dict(model, options=o), buckets) + _compare(
        f"{name}-optimizer", lambda o: get_optimizer_state_dict(model, opt, options=o), buckets
    )


class Stack(LightningModule):
    """Three Linear layers of uneven sizes under ``FSDPPlugin(auto_wrap_policy={nn.Linear})``, with Adam."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1))
        self.out = out
        self.saves: dict[str, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        bucket = fsdp_gather.GATHER_BUCKET_BYTES
        for name, size in (("bucketed", bucket), ("torch", None)):
            fsdp_gather.GATHER_BUCKET_BYTES = size
            try:
                with GatherLog() as log:
                    self.trainer.save_checkpoint(self.out / f"{name}.ckpt")
            finally:
                fsdp_gather.GATHER_BUCKET_BYTES = bucket
            self.saves[name] = log.sent


def _plugin_saves(out: Path, world: int) -> dict:
    """Save a trained module's checkpoint with the buckets and with torch's path; compare on rank 0."""
    torch.manual_seed(0)
    module = Stack(out)
    data = torch.utils.data.TensorDataset(torch.randn(8 * world, 6))
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        plugins=[FSDPPlugin(state_dict_type="full", auto_wrap_policy={nn.Linear})],
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    dist.barrier()
    found: list[str] = []
    if dist.get_rank() == 0:
        bucketed = torch.load(out / "bucketed.ckpt", weights_only=True)
        plain = torch.load(out / "torch.ckpt", weights_only=True)
        found = differences(bucketed, plain)
    return {
        "case": "plugin-checkpoint",
        "differences": found,
        "sent": module.saves["bucketed"],
        **module.saves,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    largest = 37 * 4 * 3 * 4  # ``big``, float32: the largest tensor
    buckets = {"below-one-tensor": 64, "one-tensor": largest, "large": 128 * 2**20}
    results: list[dict] = []
    for optimizer in ("adam", "sgd"):
        results += _compare_model_and_optimizer(optimizer, *_stepped(mesh, optimizer), buckets)
    if world % 2 == 0:
        # HSDP: (replicate, shard) 2-D mesh; every DTensor goes through torch's own gather.
        hybrid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        results += _compare_model_and_optimizer("hsdp", *_stepped(hybrid, "adam"), {"large": 2**20})
    results.append(_plugin_saves(Path(args.out), world))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
