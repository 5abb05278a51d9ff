"""How much private memory each rank adds while a sharded plugin resumes from one full checkpoint file.

Run as a user runs a script (``plugins=...`` with ``devices=N`` starts it again as the other ranks).
For each plugin named in ``--plugins``, every rank:

1. with ``--continued``: trains ``STEPS + 1`` steps without stopping and keeps its own final weights;
2. trains ``STEPS`` steps in a fresh run and writes one full checkpoint file;
3. resumes from that file with fresh seeds and trains one more step. While the checkpoint is read
   and loaded, a thread samples the process's ``RssAnon`` (private, anonymous memory; file pages
   mapped from the page cache are not counted) every half millisecond: ``added_bytes`` is the peak
   above what the process held when loading began, summed over the two steps of a restore (see
   :func:`added_private_bytes`). With ``--check``, at the start of training the loaded model and
   optimizer state, gathered, are compared tensor by tensor with the file; with ``--continued``, at
   the end the weights with the uninterrupted run's. ``downloads`` counts the downloads of a
   checkpoint on an object store (an entry ``zero@remote`` of ``--plugins`` writes it under
   ``--remote-dir s3://...``): once per node, or by each rank itself.

Each rank writes ``<out>/<plugin>.<mode>.rank<r>.json``. ``--mode whole`` reads the file into memory
(``TorchCheckpointIO(mmap=False)``); ``--mode before`` puts back the rest of the earlier load path as
well: every rank of a sharded optimizer deep-copies the whole optimizer state, and FSDP slices its
shards from every rank's own copy of the full tensors. ``--lightning`` runs the same module under PyTorch Lightning's DDP strategy instead.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 1
BATCH = 4


class PrivateMemory:
    """``RssAnon`` of this process: read from ``/proc/self/status``, sampled by a thread inside a window."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self.windows: list[dict[str, int]] = []

    def read(self) -> int:
        data = os.pread(self._fd, 8192, 0)
        start = data.index(b"RssAnon:") + len(b"RssAnon:")
        return int(data[start : data.index(b"kB", start)]) * 1024

    @contextmanager
    def window(self) -> Iterator[None]:
        base = self.read()
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.0005):
                peak[0] = max(peak[0], self.read())

        previous = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)  # the sampler gets the interpreter between two bytecodes of a long load
        thread = threading.Thread(target=sample, daemon=True)
        collecting = gc.isenabled()
        gc.disable()  # a collection inside the window would free memory the load never took
        thread.start()
        try:
            yield
        finally:
            if collecting:
                gc.enable()
            stop.set()
            thread.join()
            sys.setswitchinterval(previous)
            end = self.read()
            self.windows.append({"base": base, "peak": max(peak[0], end), "end": end})

    def wrap(self, owner: Any, name: str) -> None:
        """Measure every call of ``owner.name`` in a window."""
        original: Callable[..., Any] = getattr(owner, name)

        def measured(*args: Any, **kwargs: Any) -> Any:
            with self.window():
                return original(*args, **kwargs)

        setattr(owner, name, measured)


def added_private_bytes(windows: list[dict[str, int]]) -> int:
    """The peak private memory a restore added: what earlier steps kept, plus the peak of the current one.

    A restore before setup loads in two steps with the plugin's setup between them (which allocates
    gradient buckets and the like, not part of the load); each step is measured on its own.
    """
    kept, worst = 0, 0
    for w in windows:
        worst = max(worst, kept + w["peak"] - w["base"])
        kept += w["end"] - w["base"]
    return worst


def make_net(base: type, width: int, layers: int) -> Any:
    class BigNet(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return BigNet()


def loader(width: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = BATCH * 4 * (STEPS + 2)
    return DataLoader(
        TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)), BATCH
    )


def _plugin(name: str, mode: str) -> Any:
    from trainer_core.plugins.ddp import DDPPlugin
    from trainer_core.plugins.fsdp import FSDPPlugin
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO
    from trainer_core.plugins.model_parallel import ModelParallelPlugin
    from trainer_core.plugins.sharded import DDPShardedPlugin
    from trainer_core.plugins.zero import ZeroPlugin

    io = TorchCheckpointIO(mmap=mode == "ours")
    if name == "fsdp_full":
        return FSDPPlugin(state_dict_type="full", checkpoint_io=io)
    if name == "model_parallel_full":
        return ModelParallelPlugin(
            save_distributed_checkpoint=False, tensor_parallel_size=1, checkpoint_io=io
        )
    return {"zero": ZeroPlugin, "ddp_sharded": DDPShardedPlugin, "ddp": DDPPlugin}[name](checkpoint_io=io)


def _local(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in module.state_dict().items():
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        out[name] = tensor.detach().clone()
    return out


def _mismatches(loaded: Any, saved: Any, where: str) -> list[str]:
    if isinstance(saved, torch.Tensor):
        ok = isinstance(loaded, torch.Tensor) and torch.equal(loaded.cpu(), saved)
        return [] if ok else [where]
    if isinstance(saved, dict):
        if not isinstance(loaded, dict) or set(loaded) != set(saved):
            return [f"{where}: keys differ"]
        return [m for k in saved for m in _mismatches(loaded[k], saved[k], f"{where}.{k}")]
    if isinstance(saved, (list, tuple)):
        if len(loaded) != len(saved):
            return [f"{where}: lengths differ"]
        return [m for i, (a, b) in enumerate(zip(loaded, saved)) for m in _mismatches(a, b, f"{where}[{i}]")]
    return [] if loaded == saved else [f"{where}: {loaded!r} != {saved!r}"]


def _count(owner: Any, name: str, counts: dict[str, int], key: str) -> None:
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _old_load_optimizer_state_dict(self: Any, optimizer: Any, state_dict: dict[str, Any]) -> None:
    """What the base plugin did before: every rank of a sharded optimizer deep-copies the whole state."""
    if callable(getattr(optimizer, "consolidate_state_dict", None)):
        state_dict = copy.deepcopy(state_dict)
    optimizer.load_state_dict(state_dict)


def _old_fsdp_load_model_state_dict(self: Any, state_dict: dict[str, Any], strict: bool = True) -> None:
    """FSDP before: every rank slices its shards from its own whole copy, into the checkpoint's dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from trainer_core.plugins.fsdp import _is_full

    options = StateDictOptions(full_state_dict=_is_full(state_dict), strict=strict)
    set_model_state_dict(self._lightning_module, state_dict, options=options)


def _old_fsdp_load_optimizer_state_dict(self: Any, optimizer: Any, state_dict: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from trainer_core.plugins.fsdp import _is_full

    options = StateDictOptions(full_state_dict=_is_full(state_dict))
    set_optimizer_state_dict(self._lightning_module, optimizer, state_dict, options=options)


def run_trainer_core(args: argparse.Namespace, entry: str) -> None:
    """One entry of ``--plugins``: a plugin's name, with ``@remote`` for a checkpoint under ``--remote-dir``."""
    plugin_name, _, where = entry.partition("@")
    from trainer_core import LightningModule, Trainer, seed_everything
    from trainer_core.callbacks import Callback
    from trainer_core.checkpoint import restore
    from trainer_core.checkpoint.format import KEY_OPTIMIZER_STATES, KEY_STATE_DICT
    from trainer_core.plugins.io import object_store
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    out = Path(args.out)
    ckpt = f"{args.remote_dir if where == 'remote' else out}/{plugin_name}.ckpt"
    width = args.remote_width if where == "remote" else args.width
    result: dict[str, Any] = {"plugin": entry, "mode": args.mode}

    def trainer(steps: int, callbacks: list[Any] = ()) -> Trainer:  # type: ignore[assignment]
        return Trainer(
            plugins=_plugin(plugin_name, args.mode),
            devices=args.devices,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
            callbacks=list(callbacks),
        )

    def fit(steps: int, seed: int, ckpt_path: Any = None, callbacks: list[Any] = ()) -> tuple[Trainer, Any]:  # type: ignore[assignment]
        seed_everything(seed, verbose=False)
        t = trainer(steps, callbacks)
        model = make_net(LightningModule, width, args.layers)
        t.fit(model, loader(width), ckpt_path=ckpt_path)
        return t, model

    if args.continued:
        _, model = fit(STEPS + 1, seed=7)
        reference = _local(model)
    t, _ = fit(STEPS, seed=7)
    t.save_checkpoint(ckpt)
    t.plugin.barrier("saved")
    del t
    fs, fs_path = TorchCheckpointIO()._resolve(ckpt)
    result["file_bytes"] = fs.size(fs_path)

    class Compare(Callback):
        """Once the checkpoint is loaded: the run's model and optimizer state, gathered, against the file."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            result["downloads"] = dict(downloads)  # the restore's, before the comparison reads the file
            plugin = trainer.plugin
            state = plugin.lightning_module_state_dict()
            named = plugin.named_optimizer_state(plugin.optimizers[0])
            if plugin.is_global_zero:
                saved = TorchCheckpointIO(mmap=False).load_checkpoint(ckpt)
                problems = _mismatches(state, saved[KEY_STATE_DICT], "state_dict")
                problems += _mismatches(named, saved[KEY_OPTIMIZER_STATES][0], "optimizer")
                result["loaded_equal_problems"] = problems[:20]

    if args.mode == "before":
        from trainer_core.plugins.base import TrainingTypePlugin
        from trainer_core.plugins.fsdp import FSDPPlugin

        TrainingTypePlugin.load_optimizer_state_dict = _old_load_optimizer_state_dict  # type: ignore[method-assign]
        FSDPPlugin.load_model_state_dict = _old_fsdp_load_model_state_dict  # type: ignore[method-assign]
        FSDPPlugin.load_optimizer_state_dict = _old_fsdp_load_optimizer_state_dict  # type: ignore[method-assign]
    memory = PrivateMemory()
    memory.wrap(restore, "restore_module_and_callbacks")
    memory.wrap(restore, "restore_training_state")
    downloads = {"shared": 0, "own": 0}
    _count(object_store, "download_to_local", downloads, "shared")  # ParallelPlugin's, once per node
    _count(TorchCheckpointIO, "_load_downloaded", downloads, "own")  # a rank downloading for itself
    gc.collect()  # the earlier runs' garbage goes now, not inside a measured window
    t, model = fit(STEPS + 1, seed=1234, ckpt_path=ckpt, callbacks=[Compare()] if args.check else [])
    result["windows"] = memory.windows
    result["added_bytes"] = added_private_bytes(memory.windows)
    result.setdefault("downloads", dict(downloads))
    result["temporaries_left"] = [p.name for p in Path(tempfile.gettempdir()).glob(".trainer-core-*")]
    if args.continued:
        final = _local(model)
        result["continued_equal_problems"] = [k for k in reference if not torch.equal(reference[k], final[k])]
    t.plugin.barrier("measured")
    rank = t.global_rank
    (out / f"{entry}.{args.mode}.rank{rank}.json").write_text(json.dumps(result))
    t.plugin.barrier("written")


def run_lightning(args: argparse.Namespace) -> None:
    """The same module under PyTorch Lightning's DDP strategy, resumed from a Lightning checkpoint."""
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.connectors.checkpoint_connector import _CheckpointConnector

    out = Path(args.out)
    ckpt = str(out / "lightning.ckpt")

    def trainer(steps: int) -> Any:
        return pl.Trainer(
            accelerator="cpu",
            strategy="ddp",
            devices=args.devices,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
        )

    pl.seed_everything(7, verbose=False)
    t = trainer(STEPS)
    t.fit(make_net(pl.LightningModule, args.width, args.layers), loader(args.width))
    t.save_checkpoint(ckpt)
    t.strategy.barrier()
    del t
    memory = PrivateMemory()
    memory.wrap(_CheckpointConnector, "_restore_modules_and_callbacks")
    memory.wrap(_CheckpointConnector, "restore_training_state")
    gc.collect()
    pl.seed_everything(1234, verbose=False)
    t = trainer(STEPS + 1)
    t.fit(make_net(pl.LightningModule, args.width, args.layers), loader(args.width), ckpt_path=ckpt)
    result = {
        "plugin": "lightning_ddp",
        "mode": "lightning",
        "file_bytes": os.path.getsize(ckpt),
        "windows": memory.windows,
        "added_bytes": added_private_bytes(memory.windows),
    }
    (out / f"lightning_ddp.lightning.rank{t.global_rank}.json").write_text(json.dumps(result))
    t.strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugins", default="fsdp_full,zero,ddp_sharded")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--mode", choices=("ours", "whole", "before"), default="ours")
    parser.add_argument("--check", action="store_true", help="compare the loaded state with the file")
    parser.add_argument(
        "--continued", action="store_true", help="compare the resumed run with an uninterrupted one"
    )
    parser.add_argument("--lightning", action="store_true")
    parser.add_argument(
        "--remote-dir", default="", help="where the checkpoints of `name@remote` entries go (s3://...)"
    )
    parser.add_argument("--remote-width", type=int, default=512, help="--width of `name@remote` entries")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.lightning:
        run_lightning(args)
        return
    for name in args.plugins.split(","):
        run_trainer_core(args, name)


if __name__ == "__main__":
    main()
