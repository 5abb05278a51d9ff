"""A job script for tests/plugins/test_fsdp_gather.py: one rank of a gloo group, started with RANK/WORLD_SIZE.

It shards small models with FSDP2 (``fully_shard`` on a 1-D mesh of all ranks, and on a 2-D HSDP
mesh), steps Adam or SGD with momentum once, and compares, on every rank, the full state dicts of
``gather_full_state_dict`` (at several bucket sizes) with torch's own
``get_model_state_dict`` / ``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``:
same keys in the same order, the same containers, tensors of the same dtype and shape and
``torch.equal``. Every ``dist.gather`` the buckets make is recorded (its size on each rank). Then,
in the same process group, ``FSDPPlugin(state_dict_type="full")`` trains a small module two steps
and saves it at the end: streamed (gathered while rank 0 writes), gathered whole first
(``STREAM_FULL_SAVES = False``), with torch's path (``GATHER_BUCKET_BYTES = None``), with a callback
that reads the dict in ``on_save_checkpoint``, to ``memory://``, and to a ``faulty://`` store whose
upload fails part-way over a previous file; rank 0 compares the files byte for byte. A wider module
(48 MiB of state) measures rank 0's peak resident memory during a streamed save and a whole one, and
two more fits resume from the streamed file and run straight on. Each rank writes ``rank<r>.json``:
per case, the differences found (none expected), the number of tensors, and the collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import fsspec
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
from trainer_core.callbacks import Callback
from trainer_core.errors import CheckpointError
from trainer_core.plugins import fsdp_gather
from trainer_core.plugins.fsdp import FSDPPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # faulty_fs

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
SHARDED = StateDictOptions(full_state_dict=False)
#: The memory case: 4 Linear(1024, 1024) (4 MiB weights each; 48 MiB with Adam's moments), 1 MiB buckets.
MEMORY_SIZES = (1024, 1024, 1024, 1024, 1024)
MEMORY_BUCKET_BYTES = 2**20
MEMORY_URL = "memory://fsdp-gather-job/streamed.ckpt"


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
    """Linear layers (``sizes``) under ``FSDPPlugin(auto_wrap_policy={nn.Linear})``, with Adam; ``save`` runs
    at the end of the fit, where the process group is up and the optimizer has stepped."""

    def __init__(self, sizes: tuple[int, ...], save: Callable[[Trainer], dict]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.net = nn.Sequential(*layers[:-1])
        self.save = save
        self.result: dict = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        self.result = self.save(self.trainer)


def _fit(
    out: Path,
    world: int,
    sizes: tuple[int, ...],
    save: Callable[[Trainer], dict],
    max_steps: int = 2,
    ckpt_path: Optional[Path] = None,
) -> dict:
    torch.manual_seed(0)
    module = Stack(sizes, save)
    data = torch.utils.data.TensorDataset(torch.randn(8 * world, sizes[0]))
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        plugins=[FSDPPlugin(state_dict_type="full", auto_wrap_policy={nn.Linear})],
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    dist.barrier()
    return module.result


@contextlib.contextmanager
def _setting(name: str, value: Any) -> Iterator[None]:
    """``fsdp_gather.<name> = value`` for the block."""
    before = getattr(fsdp_gather, name)
    setattr(fsdp_gather, name, value)
    try:
        yield
    finally:
        setattr(fsdp_gather, name, before)


class StreamLog:
    """Counts the streamed saves (``StreamedGather.finish`` runs once per streamed save, on every rank)."""

    def __init__(self) -> None:
        self.finished = 0
        self._original = fsdp_gather.StreamedGather.finish

    def __enter__(self) -> StreamLog:
        original = self._original

        def finish(gather: Any) -> None:
            self.finished += 1
            original(gather)

        fsdp_gather.StreamedGather.finish = finish
        return self

    def __exit__(self, *exc: Any) -> None:
        fsdp_gather.StreamedGather.finish = self._original


class HookReader(Callback):
    """Records, on rank 0, whether ``on_save_checkpoint`` saw real tensors and which values."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if trainer.global_rank == 0:
            state = checkpoint["state_dict"]
            self.seen = {
                "all_tensors": all(type(v) is torch.Tensor for v in state.values()),
                "sum": float(sum(v.double().sum() for v in state.values())),
            }


def _save(trainer: Trainer, path: Path, **settings: Any) -> dict:
    """``trainer.save_checkpoint(path)`` with ``fsdp_gather`` settings; its collectives and streamed saves."""
    with contextlib.ExitStack() as stack:
        for name, value in settings.items():
            stack.enter_context(_setting(name, value))
        log = stack.enter_context(GatherLog())
        streams = stack.enter_context(StreamLog())
        trainer.save_checkpoint(path)
    return {"sent": log.sent, "streamed": streams.finished}


def _async_save(trainer: Trainer, path: Path) -> dict:
    """A save through ``AsyncCheckpointIO``, which stages the whole dict: gathered first, never streamed."""
    from trainer_core.plugins.io.async_io import AsyncCheckpointIO

    plugin = trainer.strategy
    synchronous = plugin.checkpoint_io
    plugin.checkpoint_io = AsyncCheckpointIO(synchronous)
    try:
        result = _save(trainer, path)
        plugin.checkpoint_io.wait()
    finally:
        plugin.checkpoint_io.teardown()
        plugin.checkpoint_io = synchronous
    return result


def _failed_save(trainer: Trainer, out: Path) -> dict:
    """A streamed save to an object store whose upload fails part-way: the previous object stays."""
    import faulty_fs

    faulty_fs.register()
    target = out / "failed.ckpt"
    if trainer.global_rank == 0:
        target.write_bytes(b"the previous checkpoint")
    dist.barrier()
    error = ""
    with StreamLog() as streams:
        try:
            trainer.save_checkpoint(f"faulty://{target}", storage_options={"fail_write_after": 300})
        except CheckpointError as err:
            error = str(err)
            trainer.strategy.barrier()  # the one a successful save ends with
    return {
        "error": error,
        "streamed": streams.finished,
        "previous_intact": target.read_bytes() == b"the previous checkpoint",
        "left": sorted(p.name for p in out.iterdir() if p.name.startswith(".failed")),
    }


def _same_file_three_ways(out: Path) -> Callable[[Trainer], dict]:
    """Streamed, gathered whole then written, torch's gather; then a hook reading the dict, a failed save."""

    def save(trainer: Trainer) -> dict:
        saves = {
            "bucketed": _save(trainer, out / "bucketed.ckpt"),
            "whole": _save(trainer, out / "whole.ckpt", STREAM_FULL_SAVES=False),
            "torch": _save(trainer, out / "torch.ckpt", GATHER_BUCKET_BYTES=None),
        }
        reader = HookReader()
        trainer.callbacks.append(reader)
        try:
            saves["hooked"] = _save(trainer, out / "hooked.ckpt")
        finally:
            trainer.callbacks.remove(reader)
        saves["hooked"]["seen"] = reader.seen
        saves["memory-url"] = _save(trainer, MEMORY_URL)  # an object store's path: an upload, then a commit
        saves["async"] = _async_save(trainer, out / "async.ckpt")
        saves["failed"] = _failed_save(trainer, out)
        return saves

    return save


def _peak_growth(trainer: Trainer, path: Path, **settings: Any) -> int:
    """Bytes rank 0's resident memory rose above where it stood, at its highest during one save."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _status_kb("VmRSS")
    _save(trainer, path, **settings)
    return (_status_kb("VmHWM") - before) * 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory(out: Path) -> Callable[[Trainer], dict]:
    """Rank 0's peak memory during a streamed save and during one gathered whole, and the state's size."""

    def save(trainer: Trainer) -> dict:
        module = trainer.lightning_module
        state_bytes = 3 * sum(p.numel() * p.element_size() for p in module.parameters())  # weights + Adam
        with _setting("GATHER_BUCKET_BYTES", MEMORY_BUCKET_BYTES):
            streamed = _peak_growth(trainer, out / "memory-streamed.ckpt")
            whole = _peak_growth(trainer, out / "memory-whole.ckpt", STREAM_FULL_SAVES=False)
        same = dist.get_rank() == 0 and (
            (out / "memory-streamed.ckpt").read_bytes() == (out / "memory-whole.ckpt").read_bytes()
        )
        return {"state_bytes": state_bytes, "streamed": streamed, "whole": whole, "same_bytes": same}

    return save


def _final_weights(trainer: Trainer) -> dict:
    """The model's full state (rank 0), gathered outside a save: real tensors."""
    return {"weights": trainer.strategy.lightning_module_state_dict()}


def _resumed_differences(out: Path, world: int) -> list[str]:
    """Four steps in one run against two, the streamed save, and two more resumed from it (rank 0)."""
    sizes = (6, 7, 5, 1)
    straight = _fit(out, world, sizes, _final_weights, max_steps=4)
    resumed = _fit(out, world, sizes, _final_weights, max_steps=4, ckpt_path=out / "bucketed.ckpt")
    return differences(resumed, straight) if dist.get_rank() == 0 else []


def _plugin_saves(out: Path, world: int) -> dict:
    """Save a trained module's checkpoint streamed, gathered whole, and with torch's path; compare on rank 0."""
    saves = _fit(out, world, (6, 7, 5, 1), _same_file_three_ways(out))
    memory = _fit(out, world, MEMORY_SIZES, _memory(out))
    resumed = _resumed_differences(out, world)
    found: list[str] = []
    same: dict[str, bool] = {}
    if dist.get_rank() == 0:
        streamed_bytes = (out / "bucketed.ckpt").read_bytes()
        same = {name: (out / f"{name}.ckpt").read_bytes() == streamed_bytes for name in ("whole", "hooked")}
        with fsspec.open(MEMORY_URL, "rb") as f:
            same["memory-url"] = f.read() == streamed_bytes
        bucketed = torch.load(out / "bucketed.ckpt", weights_only=True)
        plain = torch.load(out / "torch.ckpt", weights_only=True)
        found = differences(bucketed, plain)
        # AsyncCheckpointIO writes its staged copy (bytes of its own): the same checkpoint once loaded.
        same["async"] = differences(torch.load(out / "async.ckpt", weights_only=True), bucketed) == []
        hooked_sum = float(sum(v.double().sum() for v in bucketed["state_dict"].values()))
        same["hook_saw_values"] = saves["hooked"]["seen"].get("sum") == hooked_sum
    return {
        "case": "plugin-checkpoint",
        "differences": found,
        "same_bytes": same,
        "sent": saves["bucketed"]["sent"],
        "saves": saves,
        "memory": memory,
        "resumed": resumed,
        "bucketed": saves["bucketed"]["sent"],
        "torch": saves["torch"]["sent"],
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
