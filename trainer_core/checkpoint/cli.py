"""``python -m trainer_core.checkpoint``: look inside a checkpoint, or turn a sharded one into one file.

``inspect PATH`` answers the questions asked of a checkpoint before it is used: which run wrote it
(plugin, world size, step), whether it can resume a run or holds only weights, and how big its
model and optimizer parts are. ``consolidate SHARDED_DIR OUT`` reads a sharded folder whole in this
one process (no process group, no GPUs) and writes it as an ordinary single-file checkpoint, which
every plugin resumes from and which can be copied, uploaded or loaded with ``torch.load``.

Both work on any fsspec URL. Every failure the user can fix (a wrong path, a file that is not a
checkpoint, a folder whose save was interrupted, an output that exists) is one line on stderr that
names the path, and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import fsspec

from trainer_core.checkpoint.format import (
    KEY_CALLBACKS,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_LIGHTNING_VERSION,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PLUGIN,
    KEY_STATE_DICT,
    KEY_VERSION,
    PLUGIN_LAYOUT,
    PLUGIN_NAME,
    PLUGIN_WORLD_SIZE,
    RESUME_KEYS,
)
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike, resolve

PROG = "python -m trainer_core.checkpoint"
#: Exit status for every input the user must fix (argparse uses the same for bad arguments).
EXIT_BAD_INPUT = 2
_SHARD_SUFFIX = ".distcp"
#: What a PyTorch Lightning checkpoint holds when it can resume a run (one saved with weights_only lacks them).
_LIGHTNING_RESUME_KEYS = ("optimizer_states", "lr_schedulers", "loops", "callbacks")


# ---------------------------------------------------------------------- inspect
def _tensor_stats(obj: Any) -> tuple[int, int]:
    """``(number of tensors, bytes of tensor data)`` anywhere inside ``obj``."""
    import torch

    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    values: Sequence[Any]
    if isinstance(obj, Mapping):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        return 0, 0
    count = nbytes = 0
    for value in values:
        c, b = _tensor_stats(value)
        count += c
        nbytes += b
    return count, nbytes


def _optimizer_parameter_names(optimizer_states: Sequence[Any]) -> set[str]:
    """The parameter names the (name-keyed) optimizer states are stored under."""
    names: set[str] = set()
    for state in optimizer_states:
        if not isinstance(state, Mapping):
            continue
        for group in state.get("param_groups", []):
            names.update(str(name) for name in group.get("params", []))
        names.update(str(name) for name in state.get("state", {}))
    return names


def _open(path: PathLike, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, fs_path = resolve(path, **storage_options)
    if not fs.exists(fs_path):
        raise CheckpointError(
            f"{os.fspath(path)} does not exist; pass the path of a checkpoint file or folder."
        )
    return fs, fs_path


def _load(path: PathLike, storage_options: dict[str, Any]) -> tuple[dict[str, Any], Optional[int]]:
    """The whole checkpoint on CPU, and the number of shard files (``None`` for a single file)."""
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    fs, fs_path = _open(path, storage_options)
    if not fs.isdir(fs_path):
        return TorchCheckpointIO(storage_options).load_checkpoint(path, map_location="cpu"), None
    # Checks the folder is a complete sharded checkpoint (trainer_state.pt, then .metadata) first.
    checkpoint = DistributedCheckpointIO(storage_options).load_checkpoint(path, map_location="cpu")
    shards = [name for name in fs.find(fs_path) if name.endswith(_SHARD_SUFFIX)]
    return checkpoint, len(shards)


def summarize(checkpoint: Mapping[str, Any], path: str, shard_files: Optional[int] = None) -> dict[str, Any]:
    """What ``inspect`` reports about ``checkpoint``, as plain JSON-able values."""
    plugin = checkpoint.get(KEY_PLUGIN)
    plugin = dict(plugin) if isinstance(plugin, Mapping) else {}
    lightning = KEY_LIGHTNING_VERSION in checkpoint and KEY_FORMAT_VERSION not in checkpoint
    optimizer_states = checkpoint.get(KEY_OPTIMIZER_STATES) or []
    model_tensors, model_bytes = _tensor_stats(checkpoint.get(KEY_STATE_DICT, {}))
    optim_tensors, optim_bytes = _tensor_stats(optimizer_states)
    all_tensors, all_bytes = _tensor_stats(checkpoint)
    return {
        "path": path,
        "format_version": checkpoint.get(KEY_FORMAT_VERSION),
        # A PyTorch Lightning checkpoint: trainer-core converts it when it loads it (checkpoint/lightning.py).
        "pytorch_lightning_version": checkpoint.get(KEY_LIGHTNING_VERSION),
        "trainer_core_version": checkpoint.get(KEY_VERSION),
        "epoch": checkpoint.get(KEY_EPOCH),
        "global_step": checkpoint.get(KEY_GLOBAL_STEP),
        "plugin": {
            "name": plugin.get(PLUGIN_NAME),
            "world_size": plugin.get(PLUGIN_WORLD_SIZE),
            "layout": dict(plugin[PLUGIN_LAYOUT]) if isinstance(plugin.get(PLUGIN_LAYOUT), Mapping) else None,
        },
        "sharded": shard_files is not None,
        "shard_files": shard_files,
        "resumable": all(key in checkpoint for key in (_LIGHTNING_RESUME_KEYS if lightning else RESUME_KEYS)),
        "keys": [str(key) for key in checkpoint],
        "model": {"tensors": model_tensors, "bytes": model_bytes},
        "optimizer": {"tensors": optim_tensors, "bytes": optim_bytes},
        "other": {
            "tensors": all_tensors - model_tensors - optim_tensors,
            "bytes": all_bytes - model_bytes - optim_bytes,
        },
        "parameter_names": len(_optimizer_parameter_names(optimizer_states)),
        "optimizers": len(optimizer_states),
        "lr_schedulers": len(checkpoint.get(KEY_LR_SCHEDULERS) or []),
        "callbacks": [str(key) for key in checkpoint.get(KEY_CALLBACKS) or {}],
    }


def inspect_checkpoint(path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Read the checkpoint file or sharded folder at ``path`` and return :func:`summarize`'s report."""
    checkpoint, shard_files = _load(path, dict(storage_options or {}))
    return summarize(checkpoint, os.fspath(path), shard_files)


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes} B ({size:.1f} {unit})"
        size /= 1024
    raise AssertionError("unreachable")


_LAYOUT_NAMES = (("pp", "pipeline_parallel"), ("dp", "data_parallel"), ("tp", "tensor_parallel"))


def format_summary(summary: Mapping[str, Any]) -> str:
    """``summary`` as aligned ``name  value`` lines."""
    plugin = summary["plugin"]
    if plugin["name"] is None:
        plugin_text = (
            "unknown (PyTorch Lightning does not record it)"
            if summary.get("pytorch_lightning_version")
            else "unknown (written before checkpoints recorded it)"
        )
    else:
        plugin_text = f"{plugin['name']} (world size {plugin['world_size']}"
        layout = plugin.get("layout")
        if layout:
            shown = [
                f"{short}={layout.get(dim, 1)}" for short, dim in _LAYOUT_NAMES if layout.get(dim, 1) > 1
            ]
            plugin_text += f", layout [{', '.join(shown) or 'one process'}]"
        plugin_text += ")"
    sharded = f"yes ({summary['shard_files']} shard files)" if summary["sharded"] else "no (single file)"

    def tensors(part: Mapping[str, int]) -> str:
        return f"{part['tensors']} tensors, {_human(part['bytes'])}"

    rows = [
        ("path", summary["path"]),
        ("format_version", summary["format_version"]),
        *_lightning_row(summary),
        ("trainer_core", summary["trainer_core_version"]),
        ("epoch", summary["epoch"]),
        ("global_step", summary["global_step"]),
        ("plugin", plugin_text),
        ("sharded", sharded),
        ("resumable", "yes" if summary["resumable"] else "no (weights only)"),
        ("keys", ", ".join(summary["keys"])),
        ("model", tensors(summary["model"])),
        ("optimizer", tensors(summary["optimizer"])),
        ("other", tensors(summary["other"])),
        ("parameter_names", summary["parameter_names"]),
        ("optimizers", summary["optimizers"]),
        ("lr_schedulers", summary["lr_schedulers"]),
        ("callbacks", ", ".join(summary["callbacks"]) or "none"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _lightning_row(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    version = summary.get("pytorch_lightning_version")
    if not version:
        return []
    return [
        (
            "written_by",
            f"PyTorch Lightning {version} (a Lightning checkpoint: trainer-core converts it when it loads it, "
            "in fit(ckpt_path=...) and load_from_checkpoint)",
        )
    ]


# ---------------------------------------------------------------------- consolidate
def consolidate(
    sharded_dir: PathLike,
    out: PathLike,
    force: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Write the sharded checkpoint folder ``sharded_dir`` as one checkpoint file at ``out``.

    Runs in this process without a process group: every shard is read whole (the host needs memory
    for the full model and optimizer state). ``out`` is written atomically with
    :class:`TorchCheckpointIO`, so an interrupted run leaves no half-written file. Returns
    :func:`summarize`'s report of what was written.
    """
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    options = dict(storage_options or {})
    src, dst = os.fspath(sharded_dir), os.fspath(out)
    fs, fs_path = _open(src, options)
    if not fs.isdir(fs_path):
        raise CheckpointError(
            f"{src} is a single-file checkpoint already; there is nothing to consolidate (copy it instead)."
        )
    out_fs, out_path = resolve(dst, **options)
    if out_fs.exists(out_path):
        if out_fs.isdir(out_path):
            raise CheckpointError(f"{dst} is a folder; pass the path of the checkpoint file to write.")
        if not force:
            raise CheckpointError(f"{dst} already exists; pass --force to overwrite it.")
    checkpoint, shard_files = _load(src, options)
    TorchCheckpointIO(options).save_checkpoint(checkpoint, dst)
    return summarize(checkpoint, dst, shard_files=None) | {
        "consolidated_from": src,
        "source_shards": shard_files,
    }


# ---------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect trainer-core checkpoints, or consolidate a sharded one into one file."
    )
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        default="{}",
        help='fsspec options for remote URLs, as a JSON object (e.g. \'{"endpoint_url": "http://..."}\')',
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="print what a checkpoint holds",
        description=(
            "Print a checkpoint's format and trainer-core version, epoch, global_step, the plugin and world "
            "size that wrote it, whether it is sharded, its top-level keys, the number and bytes of its "
            "model and optimizer tensors, the parameter names its optimizer state is keyed by, and the "
            "optimizers, schedulers and callbacks it saved."
        ),
    )
    inspect.add_argument(
        "path", metavar="PATH", help="a checkpoint file or sharded checkpoint folder (any fsspec URL)"
    )
    inspect.add_argument("--json", action="store_true", help="print the report as one JSON object")
    merge = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint folder as one checkpoint file",
        description=(
            "Read a sharded checkpoint folder whole, in this process and without a process group, and write it "
            "as a single-file checkpoint that any plugin resumes from (Trainer.fit(ckpt_path=OUT))."
        ),
    )
    merge.add_argument("sharded_dir", metavar="SHARDED_DIR", help="the sharded checkpoint folder")
    merge.add_argument("out", metavar="OUT", help="the checkpoint file to write")
    merge.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    return parser


def _storage_options(parser: argparse.ArgumentParser, text: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        parser.error(f"--storage-options is not valid JSON: {err}")
    if not isinstance(options, dict):
        parser.error("--storage-options must be a JSON object")
    return options


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    options = _storage_options(parser, args.storage_options)
    subject = args.path if args.command == "inspect" else args.sharded_dir
    try:
        if args.command == "inspect":
            summary = inspect_checkpoint(args.path, options)
            print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
        else:
            summary = consolidate(args.sharded_dir, args.out, force=args.force, storage_options=options)
            print(
                f"wrote {args.out}: global_step {summary['global_step']}, "
                f"{summary['model']['tensors'] + summary['optimizer']['tensors']} model and optimizer tensors, "
                f"{_human(summary['model']['bytes'] + summary['optimizer']['bytes'])}, "
                f"from {summary['source_shards']} shard files of {args.sharded_dir}"
            )
    except CheckpointError as err:
        _fail(str(err))
        return EXIT_BAD_INPUT
    except Exception as err:  # anything else still names the path, never a traceback
        _fail(f"could not read {subject} as a trainer-core checkpoint ({type(err).__name__}: {err}).")
        return EXIT_BAD_INPUT
    return 0


def _fail(message: str) -> None:
    one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"{PROG}: error: {one_line}", file=sys.stderr)
