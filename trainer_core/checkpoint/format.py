"""What a trainer-core checkpoint file holds, and the checks that turn a bad file into one clear error.

The top-level keys are module constants so that the Trainer that writes a checkpoint, the plugins that
fill its sharded parts and the code that reads it cannot drift apart on a spelling. ``FORMAT_VERSION``
is bumped whenever a reader of the previous version could misread a new file; a reader refuses files
from the future instead of guessing.

Loading never unpickles freely (``torch.load(..., weights_only=True)``). The few non-tensor types the
format legitimately contains (numpy's RNG state is an ``ndarray``) are listed in :func:`safe_globals`;
a user whose hyper-parameters hold a class of their own registers it with :func:`register_safe_globals`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Union

import numpy as np
import torch

from trainer_core.__about__ import __version__
from trainer_core.errors import CheckpointError
from trainer_core.utilities import listing

FORMAT_VERSION = 1
#: The ``format_version`` of a file whose frozen tensors are stored apart, as blob references (``KEY_BLOBS``):
#: a trainer-core from before blob references refuses it as "written by a newer trainer-core" instead of
#: loading a reference as a weight. Files without references keep :data:`FORMAT_VERSION`.
BLOBS_FORMAT_VERSION = 2
#: The newest ``format_version`` this trainer-core reads.
NEWEST_FORMAT_VERSION = BLOBS_FORMAT_VERSION

KEY_FORMAT_VERSION = "format_version"
KEY_VERSION = "trainer_core_version"
KEY_EPOCH = "epoch"
KEY_GLOBAL_STEP = "global_step"
KEY_STATE_DICT = "state_dict"
KEY_OPTIMIZER_STATES = "optimizer_states"
KEY_LR_SCHEDULERS = "lr_schedulers"
KEY_LOOPS = "loops"
KEY_CALLBACKS = "callbacks"
KEY_RNG = "rng_states"
KEY_HPARAMS = "hyper_parameters"
KEY_HPARAMS_NAME = (
    "hparams_name"  # the __init__ argument that held the one dict given to save_hyperparameters
)
KEY_DATAMODULE_HPARAMS = "datamodule_hyper_parameters"  # Lightning's key, so its checkpoints read the same
KEY_DATAMODULE_HPARAMS_NAME = "datamodule_hparams_name"
KEY_PRECISION = "precision"
KEY_PLUGIN = "plugin"  # {PLUGIN_NAME: ..., PLUGIN_WORLD_SIZE: ...} of the run that wrote it
PLUGIN_NAME = "name"
PLUGIN_WORLD_SIZE = "world_size"
#: ``{"pipeline_parallel": pp, "data_parallel": dp, "tensor_parallel": tp}`` of the writing run (older checkpoints lack it).
PLUGIN_LAYOUT = "layout"
#: The writing run's ``Trainer(precision=...)`` (``"16-mixed"``, ...; older checkpoints lack it).
PLUGIN_PRECISION = "precision"
KEY_DATAMODULE = "datamodule"
KEY_RNG_PER_RANK = "rng_states_per_rank"  # every rank's generators (rank 0's are also under KEY_RNG)
#: What marks a PyTorch Lightning checkpoint: readers return one as it is, and the code that loads it
#: into a module converts it to this format first (trainer_core/checkpoint/lightning.py).
KEY_LIGHTNING_VERSION = "pytorch-lightning_version"
#: A converted Lightning checkpoint's index-keyed optimizer states, kept until the optimizers exist to name them.
KEY_LIGHTNING_OPTIMIZER_STATES = "lightning_optimizer_states"

# Inside ``KEY_LOOPS``: the loop position (written by ``Progress.state_dict``, read by its
# ``load_state_dict``), then what the checkpoint code adds about the data and the schedulers.
LOOP_EPOCH = "epoch"  # the epoch the position counts in
LOOP_BATCHES_DONE = "batches_done_in_epoch"
LOOP_EPOCH_FINISHED = "epoch_finished"
LOOP_TOTAL_BATCH_IDX = "total_batch_idx"
LOOP_BATCHES_THAT_STEPPED = "batches_that_stepped"
LOOP_VALIDATED_LAST_BATCH = "validated_last_batch"  # the last batch's validation (if due) already ran
LOOP_EPOCH_START_RNG = "epoch_start_rng"  # generators at the epoch's start: recreate its sampler order
LOOP_WORLD_SIZE = "world_size"  # data-parallel replicas that split the epoch (pipeline ranks do not)
LOOP_BATCH_SIZE = "batch_size"  # with LOOP_WORLD_SIZE: samples done, to resume at another world size
LOOP_SAMPLER_SEED = "sampler_seed"  # a DistributedSampler's own seed
LOOP_PENDING_PLATEAU = "pending_plateau_metrics"  # ReduceLROnPlateau steps the saved run took next
LOOP_PER_RANK = "per_rank"  # what each rank holds for itself (rank 0's also at the top level)
LOOP_DATALOADER = "dataloader"  # a stateful loader's state_dict
LOOP_GRADS = "accumulated_grads"  # gradients of an unfinished accumulation cycle, by parameter name
# Trainer(reload_dataloaders_every_n_epochs=n) only: the epoch each loader was last made in, so that a
# resumed run reloads at the epochs the saved run would have.
LOOP_TRAIN_LOADER_EPOCH = "train_dataloader_epoch"
LOOP_VAL_LOADER_EPOCH = "val_dataloader_epoch"

#: Names (keys of ``state_dict``) of the parameters that do not train (``requires_grad=False``), written
#: only when there are some: ``FrozenBlobCheckpointIO`` stores these tensors once, by content hash, and
#: has each checkpoint reference them instead of repeating them.
KEY_FROZEN_PARAMETERS = "frozen_parameters"
#: In a file whose frozen tensors are stored apart: ``{BLOBS_STORE: the store folder beside the file,
#: BLOBS_SHA256: [the sha256 of every blob the file references]}``.
KEY_BLOBS = "blobs"
BLOBS_STORE = "store"
BLOBS_SHA256 = "sha256"
#: A tensor stored apart, in place of the tensor in ``state_dict``: ``{BLOB_REF_TAG: sha256 of its bytes,
#: BLOB_REF_DTYPE: "float32", BLOB_REF_SHAPE: [..]}`` (plain values, so the file loads weights-only).
BLOB_REF_TAG = "__trainer_core_blob__"
BLOB_REF_DTYPE = "dtype"
BLOB_REF_SHAPE = "shape"

#: Keys every checkpoint has, including one saved with ``weights_only=True``.
REQUIRED_KEYS = (KEY_FORMAT_VERSION, KEY_EPOCH, KEY_GLOBAL_STEP, KEY_STATE_DICT)
#: Keys a checkpoint needs on top of :data:`REQUIRED_KEYS` to resume training exactly.
RESUME_KEYS = (KEY_OPTIMIZER_STATES, KEY_LR_SCHEDULERS, KEY_LOOPS, KEY_CALLBACKS, KEY_RNG)

SafeGlobal = Union[Callable[..., Any], tuple[Callable[..., Any], str]]
_user_safe_globals: list[SafeGlobal] = []


def _numpy_safe_globals() -> list[SafeGlobal]:
    """The numpy pieces an ``ndarray`` or numpy scalar pickles to, under both numpy 1 and 2 spellings.

    ``numpy.random.get_state()`` returns an ``ndarray``; a checkpoint written under numpy 1 names
    ``numpy.core.multiarray`` and one written under numpy 2 names ``numpy._core.multiarray``, so both
    names are allowed for the same (current) objects. Only array/scalar reconstruction and dtypes are
    allowed, nothing that calls arbitrary functions.
    """
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    allowed: list[SafeGlobal] = [np.ndarray, np.dtype]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed.append((multiarray._reconstruct, f"{module}._reconstruct"))
        allowed.append((multiarray.scalar, f"{module}.scalar"))
    numeric = (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint32, np.uint64)
    numeric += (np.float16, np.float32, np.float64)
    allowed.extend(type(np.dtype(t)) for t in numeric)
    return allowed


def safe_globals() -> list[SafeGlobal]:
    """Everything beyond tensors and plain containers that a checkpoint may name when it is loaded."""
    return [*_numpy_safe_globals(), *_user_safe_globals]


def register_safe_globals(*objects: SafeGlobal) -> None:
    """Allow ``objects`` (classes or functions you trust) to be named by checkpoints you load.

    Use it when a checkpoint's hyper-parameters or a callback's state hold one of your own classes:
    loading refuses any global that is not registered, because unpickling one can run code.
    """
    _user_safe_globals.extend(objects)


def _describe_foreign(checkpoint: Mapping[Any, Any]) -> str:
    """Say what a dict without ``format_version`` most likely is, so the user knows how to load it."""
    if KEY_LIGHTNING_VERSION in checkpoint:
        return (
            f"it is a PyTorch Lightning checkpoint (pytorch-lightning {checkpoint[KEY_LIGHTNING_VERSION]}); "
            "resume from it with trainer.fit(model, ckpt_path=path), or load it with "
            "YourModule.load_from_checkpoint(path)"
        )
    if checkpoint and all(isinstance(value, torch.Tensor) for value in checkpoint.values()):
        return (
            "it looks like a plain state_dict (model weights only); load it with "
            "model.load_state_dict(torch.load(path, weights_only=True)), or write checkpoints with "
            "trainer.save_checkpoint(path)"
        )
    keys = listing(sorted(map(str, checkpoint.keys())))
    return f"its top-level keys are [{keys}]; write checkpoints with trainer.save_checkpoint(path)"


def validate_checkpoint(
    checkpoint: Any, path: str, *, for_resume: bool = False, accept_lightning: bool = False
) -> None:
    """Raise :class:`CheckpointError` unless ``checkpoint`` is a trainer-core checkpoint this version reads.

    ``for_resume=True`` also requires the training state (optimizers, schedulers, loops, callbacks,
    RNG); a checkpoint saved with ``weights_only=True`` holds only the model and cannot resume a run.
    ``accept_lightning=True`` (for readers such as the checkpoint IO) also passes a complete PyTorch
    Lightning checkpoint as it is: whoever loads it into a module converts it first.
    """
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(
            f"{path} is not a trainer-core checkpoint: it holds a {type(checkpoint).__name__}, not a dict. "
            "Write checkpoints with trainer.save_checkpoint(path)."
        )
    if accept_lightning and KEY_FORMAT_VERSION not in checkpoint and KEY_LIGHTNING_VERSION in checkpoint:
        missing = [key for key in (KEY_EPOCH, KEY_GLOBAL_STEP, KEY_STATE_DICT) if key not in checkpoint]
        if missing:
            raise CheckpointError(
                f"{path} is an incomplete PyTorch Lightning checkpoint: it lacks the keys [{', '.join(missing)}]. "
                "It was edited or written by a broken writer; use another checkpoint."
            )
        return
    if KEY_FORMAT_VERSION not in checkpoint:
        raise CheckpointError(
            f"{path} is not a trainer-core checkpoint (no {KEY_FORMAT_VERSION!r} key): {_describe_foreign(checkpoint)}."
        )
    version = checkpoint[KEY_FORMAT_VERSION]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(
            f"{path} has an invalid {KEY_FORMAT_VERSION!r}: {version!r} (expected a positive int). "
            "The file was not written by trainer-core or was edited; re-save it with trainer.save_checkpoint."
        )
    if version > NEWEST_FORMAT_VERSION:
        writer = checkpoint.get(KEY_VERSION, "an unknown version")
        raise CheckpointError(
            f"{path} was written by a newer trainer-core ({writer}, format_version {version}); this is "
            f"trainer-core {__version__}, which reads format_version {NEWEST_FORMAT_VERSION} and older. "
            "Upgrade trainer-core to load it."
        )
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"{path} is an incomplete trainer-core checkpoint: it lacks the keys [{', '.join(missing)}]. "
            "It was edited or written by a broken writer; use another checkpoint."
        )
    if for_resume:
        missing = [key for key in RESUME_KEYS if key not in checkpoint]
        if missing:
            raise CheckpointError(
                f"{path} holds only the model weights (no [{', '.join(missing)}]; was it saved with "
                "weights_only=True?), so training cannot resume from it. Load the weights with "
                "LightningModule.load_from_checkpoint, or resume from a full checkpoint."
            )


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _dtype_kind(value: Any) -> str | None:
    """``"floating"``, ``"complex"``, ``"bool"`` or ``"integer"``: copying across kinds loses values.

    Across floating dtypes (a float32 checkpoint into a bf16 model) the copy converts, as a run with
    another precision setting must; from floating into integer it would silently truncate.
    """
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_floating_point():
        return "floating"
    if value.is_complex():
        return "complex"
    return "bool" if value.dtype == torch.bool else "integer"


def _has_nan(value: Any) -> bool:
    # Only plain tensors with data: a DTensor's check would be a collective, a meta tensor has no
    # values; NaN, not inf (masks hold -inf).
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.is_floating_point()
        and not value.is_meta
        and bool(torch.isnan(value).any())
    )


def check_state_dict_matches(
    expected: Mapping[str, Any], loaded: Mapping[str, Any], path: str, strict: bool = True
) -> None:
    """Raise :class:`CheckpointError` listing every name and shape where ``loaded`` differs from the model.

    ``expected`` is the model's ``{name: tensor}`` (for example ``model.state_dict()``), ``loaded`` the
    checkpoint's state dict. Checking before ``load_state_dict`` means a mismatch leaves the model
    untouched, and the user sees every difference at once instead of torch's first one. With
    ``strict=False`` only shape mismatches of names present on both sides are errors.
    """
    missing = sorted(name for name in expected if name not in loaded)
    unexpected = sorted(name for name in loaded if name not in expected)
    mismatched = []
    wrong_kind = []
    for name in sorted(set(expected) & set(loaded)):
        model_shape, ckpt_shape = _shape(expected[name]), _shape(loaded[name])
        if model_shape is not None and ckpt_shape is not None and model_shape != ckpt_shape:
            mismatched.append(f"{name}: checkpoint {ckpt_shape} vs model {model_shape}")
        model_kind, ckpt_kind = _dtype_kind(expected[name]), _dtype_kind(loaded[name])
        if model_kind is not None and ckpt_kind is not None and model_kind != ckpt_kind:
            wrong_kind.append(f"{name}: checkpoint {loaded[name].dtype} vs model {expected[name].dtype}")
    problems = []
    if strict and missing:
        problems.append(f"missing in the checkpoint ({len(missing)}): {listing(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected in the checkpoint ({len(unexpected)}): {listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch ({len(mismatched)}): {listing(mismatched)}")
    if wrong_kind:
        problems.append(f"dtype mismatch ({len(wrong_kind)}): {listing(wrong_kind)}")
    if problems:
        hint = "Load a checkpoint of this model, or change the model to match"
        if strict and not mismatched and not wrong_kind:
            hint += "; pass strict=False to load only the names both have"
        raise CheckpointError(f"{path} does not match the model:\n  " + "\n  ".join(problems) + f"\n{hint}.")
    with_nan = sorted(name for name in set(expected) & set(loaded) if _has_nan(loaded[name]))
    if with_nan:
        raise CheckpointError(
            f"{path} holds NaN weights ({len(with_nan)}): {listing(with_nan)}. It was saved after training "
            "diverged; resume from an earlier checkpoint of the run (and lower the learning rate or clip "
            "gradients)."
        )


# ---------------------------------------------------------------------- byte payloads
#: Marks an ``io.BytesIO`` stored as bytes: modules' extra state (TransformerEngine keeps its FP8
#: metadata as one) must load with ``weights_only=True``, which refuses a pickled ``BytesIO``.
BYTES_IO_TAG = "__trainer_core_bytes_io__"


def encode_byte_payloads(obj: Any) -> Any:
    """``obj`` with every ``io.BytesIO`` replaced by ``{BYTES_IO_TAG: uint8 tensor}``.

    Containers are copied only along the paths that hold one, so a checkpoint without byte
    payloads comes back as the very same object (no copy of its tensors, ever).
    """
    import io

    if isinstance(obj, io.BytesIO):
        data = obj.getvalue()
        return {
            BYTES_IO_TAG: torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        }
    if isinstance(obj, dict):
        encoded = {key: encode_byte_payloads(value) for key, value in obj.items()}
        if all(encoded[key] is obj[key] for key in obj):
            return obj
        out = type(obj)() if type(obj) is not dict and _constructible(type(obj)) else {}
        out.update(encoded)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        items = [encode_byte_payloads(value) for value in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else items
    return obj


def decode_byte_payloads(obj: Any) -> Any:
    """The inverse of :func:`encode_byte_payloads` (in place for dicts and lists)."""
    import io

    if isinstance(obj, dict):
        if len(obj) == 1 and BYTES_IO_TAG in obj:
            return io.BytesIO(obj[BYTES_IO_TAG].numpy().tobytes())
        for key, value in obj.items():
            obj[key] = decode_byte_payloads(value)
        return obj
    if isinstance(obj, list):
        for index, value in enumerate(obj):
            obj[index] = decode_byte_payloads(value)
    return obj


def _constructible(kind: type) -> bool:
    try:
        kind()
    except Exception:
        return False
    return True
