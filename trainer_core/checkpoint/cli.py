"""``python -m trainer_core.checkpoint``: look inside a checkpoint, or turn a sharded one into one file.

``inspect PATH`` answers the questions asked of a checkpoint before it is used: which run wrote it
(plugin, world size, step), whether it can resume a run or holds only weights, and how big its
model and optimizer parts are (a sharded folder's tensors are counted from its metadata, not read).
``consolidate SHARDED_DIR OUT`` reads a sharded folder in this one process (no process group, no
GPUs), one tensor at a time, and writes it as an ordinary single-file checkpoint, which every
plugin resumes from and which can be copied, uploaded or loaded with ``torch.load``: its memory is
about the largest tensor, whatever the checkpoint's size. ``consolidate SRC --to safetensors
OUT_DIR`` writes the model weights of a folder or a file as Hugging Face lays them out
(:mod:`trainer_core.checkpoint.safetensors`), streamed the same way.

Both work on any fsspec URL. Every failure the user can fix (a wrong path, a file that is not a
checkpoint, a folder whose save was interrupted, an output that exists) is one line on stderr that
names the path, and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import fsspec

from trainer_core.checkpoint.format import (
    BLOBS_SHA256,
    BLOBS_STORE,
    KEY_BLOBS,
    KEY_CALLBACKS,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_FROZEN_PARAMETERS,
    KEY_GLOBAL_STEP,
    KEY_LIGHTNING_VERSION,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PLUGIN,
    KEY_STATE_DICT,
    KEY_VERSION,
    PLUGIN_LAYOUT,
    PLUGIN_NAME,
    PLUGIN_PRECISION,
    PLUGIN_WORLD_SIZE,
    RESUME_KEYS,
)
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike, is_local, resolve

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

    from trainer_core.checkpoint.stream import LazyTensor

    if isinstance(obj, (torch.Tensor, LazyTensor)):
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
    """The whole checkpoint on CPU (a folder's tensors as :class:`LazyTensor`), and the number of
    shard files (``None`` for a single file)."""
    from trainer_core.checkpoint.stream import ShardedSource
    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    fs, fs_path = _open(path, storage_options)
    if not fs.isdir(fs_path):
        return TorchCheckpointIO(storage_options).load_checkpoint(path, map_location="cpu"), None
    # A folder's tensors are counted from its metadata, never read (see stream.ShardedSource, which
    # checks first that the folder is a complete sharded checkpoint: trainer_state.pt, then .metadata).
    checkpoint = ShardedSource(path, storage_options).checkpoint()
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
            "precision": plugin.get(PLUGIN_PRECISION),
        },
        "sharded": shard_files is not None,
        "shard_files": shard_files,
        "resumable": all(key in checkpoint for key in (_LIGHTNING_RESUME_KEYS if lightning else RESUME_KEYS)),
        "keys": [str(key) for key in checkpoint],
        "model": {"tensors": model_tensors, "bytes": model_bytes},
        "blobs": _blob_summary(checkpoint),
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


def _blob_summary(checkpoint: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """Where a file written by FrozenBlobCheckpointIO keeps its frozen weights (``None`` for other files)."""
    blobs = checkpoint.get(KEY_BLOBS)
    if not isinstance(blobs, Mapping):
        return None
    return {
        "store": blobs.get(BLOBS_STORE),
        "blobs": len(blobs.get(BLOBS_SHA256) or []),
        "frozen_parameters": len(checkpoint.get(KEY_FROZEN_PARAMETERS) or []),
    }


def _blobs_row(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    blobs = summary.get("blobs")
    if not blobs:
        return []
    return [
        (
            "frozen_blobs",
            f"references {blobs['blobs']} blobs in {blobs['store']}/ beside the file for its "
            f"{blobs['frozen_parameters']} frozen parameters (counted in 'model'); each was read and its sha256 "
            "checked. Copy or move the file together with that folder.",
        )
    ]


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
        *_blobs_row(summary),
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

    Runs in this process without a process group, streaming: the structure and the small trainer
    state are read first, then each tensor on its own, written into ``out`` and freed
    (:mod:`trainer_core.checkpoint.stream`), so the memory it needs is about the largest tensor,
    not the checkpoint. The file is what ``torch.save`` of the whole checkpoint writes, byte for
    byte. ``out`` is published atomically (a temporary renamed over it; on object stores an upload
    published whole, then its commit marker): an interrupted run leaves any previous ``out`` as
    it was. ``force``: replace the file ``out`` if it exists (a link named ``out`` is replaced as a
    link, its target untouched). An ``out`` inside ``sharded_dir`` (or that is it, or holds it) is
    refused before anything is written. Returns :func:`summarize`'s report of what was written.
    """
    from trainer_core.checkpoint.files import publish_file
    from trainer_core.checkpoint.format import encode_byte_payloads
    from trainer_core.checkpoint.stream import ShardedSource, iter_lazy_tensors, write_torch_zip

    options = dict(storage_options or {})
    src, dst = os.fspath(sharded_dir), os.fspath(out)
    fs, fs_path = _open(src, options)
    if not fs.isdir(fs_path):
        raise CheckpointError(
            f"{src} is a single-file checkpoint already; there is nothing to consolidate (copy it instead)."
        )
    _check_output(src, dst, options, force, folder=False)
    source = ShardedSource(src, options)
    checkpoint = encode_byte_payloads(source.checkpoint())
    total = sum(t.nbytes for t in iter_lazy_tensors(checkpoint))
    try:
        publish_file(dst, lambda file: write_torch_zip(checkpoint, file), options, expected_bytes=total)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"Could not write {dst}: {type(err).__name__}: {err}. Any previous {dst} is unchanged; fix the cause "
            "(space, permissions, credentials) and run again."
        ) from err
    return summarize(checkpoint, dst, shard_files=None) | {
        "consolidated_from": src,
        "source_shards": source.shard_files,
    }


def consolidate_safetensors(
    src: PathLike,
    out_dir: PathLike,
    force: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
    max_shard_size: Union[int, str, None] = None,
    strip_prefix: Optional[str] = None,
) -> dict[str, Any]:
    """Write the model weights (``state_dict``) of the checkpoint ``src`` as a Hugging Face folder at ``out_dir``.

    ``src`` is a sharded folder (each tensor read on its own) or a single checkpoint file (local
    files are memory-mapped; a remote one is downloaded to a temporary local file first, disk not
    memory), trainer-core's or PyTorch Lightning's, or a plain ``state_dict`` file. Names are the
    LightningModule's ``state_dict`` names (``model.encoder.weight`` when the module holds its
    network as ``self.model``); ``strip_prefix="model."`` writes ``encoder.weight``, the names of
    the bare network that Hugging Face users load into, and leaves out the tensors outside that
    prefix (the LightningModule's own, e.g. a loss's weights), which it reports. Non-tensor
    entries (a module's extra state) cannot be stored in safetensors and are reported as skipped.
    ``force``: write into ``out_dir`` if it exists, replacing only the files this writes there
    (``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``, ``model.safetensors.index.json``)
    and removing those of a previous write that this one does not rewrite; every other file in it
    stays. An ``out_dir`` that holds ``src`` (or is it, or is inside it) is refused before anything is
    written. See :func:`trainer_core.checkpoint.safetensors.save_safetensors` for the layout and
    publishing.
    """
    import contextlib

    from trainer_core.checkpoint.safetensors import parse_size, save_safetensors

    options = dict(storage_options or {})
    src_url, dst = os.fspath(src), os.fspath(out_dir)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    fs, fs_path = _open(src_url, options)
    _check_output(src_url, dst, options, force, folder=True)
    with contextlib.ExitStack() as stack:
        if fs.isdir(fs_path):
            weights, skipped, shard_files = _sharded_weights(src_url, options)
        else:
            weights, skipped = _file_weights(src_url, fs, fs_path, stack)
            shard_files = None
        left_out: list[str] = []
        if strip_prefix:
            kept = {
                name[len(strip_prefix) :]: t for name, t in weights.items() if name.startswith(strip_prefix)
            }
            left_out = [name for name in weights if not name.startswith(strip_prefix)]
            if not kept:
                raise CheckpointError(
                    f"--strip-prefix {strip_prefix!r}: no weight of {src_url} starts with it; its names are like "
                    f"{', '.join(list(weights)[:3]) or '(none)'}."
                )
            weights = kept
        if not weights:
            raise CheckpointError(
                f"{src_url} holds no model weights (its state_dict has no tensors); nothing to write."
            )
        try:
            written = save_safetensors(weights, dst, limit, options, origin=src_url)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"Could not write {dst}: {type(err).__name__}: {err}. Any previous {dst} on local disk is unchanged; "
                "fix the cause (space, permissions, credentials) and run again."
            ) from err
    return written | {
        "consolidated_from": src_url,
        "source_shards": shard_files,
        "skipped_non_tensors": skipped,
        "left_out_by_prefix": left_out,
    }


def _check_output(src: str, dst: str, options: dict[str, Any], force: bool, folder: bool) -> None:
    """Refuse, before anything is written, an output that is, holds or lies inside ``src``, or exists
    without ``force``."""
    _check_apart(src, dst, options)
    out_fs, out_path = resolve(dst, **options)
    if not out_fs.exists(out_path):
        return
    if out_fs.isdir(out_path) and not folder:
        raise CheckpointError(f"{dst} is a folder; pass the path of the checkpoint file to write.")
    if folder and not out_fs.isdir(out_path):
        raise CheckpointError(
            f"{dst} is a file; pass the path of the folder to write the safetensors files into."
        )
    if not force and folder:
        raise CheckpointError(
            f"{dst} already exists; pass --force to write into it (it replaces only model.safetensors, "
            "model-NNNNN-of-NNNNN.safetensors and model.safetensors.index.json there; other files stay)."
        )
    if not force:
        raise CheckpointError(f"{dst} already exists; pass --force to replace it.")


def _check_apart(src: str, dst: str, options: dict[str, Any]) -> None:
    """Refuse an output that is the source, holds it, or lies inside it: writing there would mix the
    output into the checkpoint being read (or, with ``--force``, replace its files).

    Local paths are compared as real paths (links and ``..`` resolved, so ``.`` and a link to the
    source's folder are caught); other filesystems by their normalized paths.
    """
    src_fs, src_path = resolve(src, **options)
    dst_fs, dst_path = resolve(dst, **options)
    if _protocol(src_fs) != _protocol(dst_fs):
        return
    if is_local(src_fs):
        source, output, sep = os.path.realpath(src_path), os.path.realpath(dst_path), os.sep
    else:
        source, output, sep = posixpath.normpath(src_path), posixpath.normpath(dst_path), "/"
    if output == source:
        why = "it is the source itself"
    elif source.startswith(output.rstrip(sep) + sep):
        why = f"it holds the source {src}"
    elif output.startswith(source.rstrip(sep) + sep):
        why = f"it is inside the source {src}"
    else:
        return
    raise CheckpointError(
        f"Refused to write {dst}: {why}. Pass an output outside the checkpoint and the folder that holds it "
        "(e.g. a new folder next to it); nothing was written."
    )


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return "file" if protocol == "local" else protocol


def _sharded_weights(src: str, options: dict[str, Any]) -> tuple[dict[str, Any], list[str], int]:
    """``state_dict``'s tensors of a sharded folder as lazy tensors, the names of its non-tensor entries, the shard count."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer_core.checkpoint.stream import ShardedSource

    source = ShardedSource(src, options)
    weights: dict[str, Any] = {}
    skipped: list[str] = []
    for key, path, entry in source.entries():
        if not path or path[0] != KEY_STATE_DICT:
            continue
        name = ".".join(str(part) for part in path[1:])
        if isinstance(entry, TensorStorageMetadata):
            weights[name] = source.lazy_tensor(key, entry)
        else:
            skipped.append(name)
    return weights, skipped, source.shard_files


def _file_weights(
    src: str, fs: fsspec.AbstractFileSystem, fs_path: str, stack: Any
) -> tuple[dict[str, Any], list[str]]:
    """``state_dict``'s tensors of a single checkpoint file, memory-mapped (so bounded by the page cache)."""
    import tempfile

    import torch

    from trainer_core.checkpoint.format import load_weights_only

    local_path = fs_path
    if not is_local(fs):
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="trainer-core-consolidate-"))
        local_path = os.path.join(folder, "checkpoint")
        fs.get(fs_path, local_path)  # streamed to disk; mapping needs a local file
    try:
        checkpoint = load_weights_only(
            lambda: torch.load(local_path, map_location="cpu", weights_only=True, mmap=True), src
        )
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"Could not read {src} as a checkpoint file ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[-1] if str(err).strip() else 'unreadable'}). Pass a checkpoint written "
            "by trainer.save_checkpoint (or Lightning's), a state_dict saved with torch.save, or a sharded folder."
        ) from err
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get(KEY_STATE_DICT), Mapping):
        state_dict = checkpoint[KEY_STATE_DICT]
    elif (
        isinstance(checkpoint, Mapping)
        and checkpoint
        and all(isinstance(v, torch.Tensor) for v in checkpoint.values())
    ):
        state_dict = checkpoint  # a plain state_dict
    else:
        raise CheckpointError(
            f"{src} has no state_dict: it is not a trainer-core or Lightning checkpoint, nor a plain state_dict."
        )
    weights = {str(name): value for name, value in state_dict.items() if isinstance(value, torch.Tensor)}
    skipped = [str(name) for name, value in state_dict.items() if not isinstance(value, torch.Tensor)]
    return weights, skipped


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
        help="write a sharded checkpoint folder as one checkpoint file, or a checkpoint's weights as safetensors",
        description=(
            "Read a sharded checkpoint folder in this process, without a process group, one tensor at a time "
            "(memory: about the largest tensor), and write it as a single-file checkpoint that any plugin "
            "resumes from (Trainer.fit(ckpt_path=OUT)). With --to safetensors, write the model weights of a "
            "sharded folder or a checkpoint file as Hugging Face lays them out: OUT/model.safetensors, or "
            "shards with model.safetensors.index.json (--max-shard-size)."
        ),
    )
    merge.add_argument(
        "sharded_dir",
        metavar="SRC",
        help="the sharded checkpoint folder (with --to safetensors also a checkpoint file)",
    )
    merge.add_argument(
        "out", metavar="OUT", help="the checkpoint file to write (with --to safetensors: the folder to write)"
    )
    merge.add_argument(
        "--force",
        action="store_true",
        help="replace the file OUT if it exists; with --to safetensors, write into the folder OUT if it exists, "
        "replacing only model.safetensors, model-NNNNN-of-NNNNN.safetensors and model.safetensors.index.json "
        "(and removing those a previous write left that this one does not rewrite); other files in OUT stay. "
        "An OUT that is, holds or lies inside SRC is always refused",
    )
    merge.add_argument(
        "--to",
        choices=("torch", "safetensors"),
        default="torch",
        help="torch: one checkpoint file (default); safetensors: the model weights as a Hugging Face folder",
    )
    merge.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        default=None,
        help="with --to safetensors: shard into files of at most SIZE (5GB = 5*10^9 bytes, 2GiB, or bytes), "
        "with model.safetensors.index.json; default: one model.safetensors",
    )
    merge.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        default=None,
        help="with --to safetensors: write only the weights whose names start with PREFIX, without it "
        "(e.g. 'model.' turns the LightningModule's model.encoder.weight into encoder.weight, the name the "
        "bare network loads)",
    )
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
        elif args.to == "safetensors":
            written = consolidate_safetensors(
                args.sharded_dir,
                args.out,
                force=args.force,
                storage_options=options,
                max_shard_size=args.max_shard_size,
                strip_prefix=args.strip_prefix,
            )
            print(
                f"wrote {args.out}: {written['tensors']} tensors, {_human(written['bytes'])} in "
                f"{', '.join(written['files'])}, from {args.sharded_dir}"
            )
            for key, what in (
                ("skipped_non_tensors", "non-tensor entries skipped (safetensors holds tensors only)"),
                ("left_out_by_prefix", f"tensors left out (not under --strip-prefix {args.strip_prefix!r})"),
            ):
                if written[key]:
                    print(f"{len(written[key])} {what}: {', '.join(written[key][:10])}")
        else:
            if args.max_shard_size is not None or args.strip_prefix is not None:
                parser.error("--max-shard-size and --strip-prefix go with --to safetensors")
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
