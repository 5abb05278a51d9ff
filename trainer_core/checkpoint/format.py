"""What a trainer-core checkpoint file holds, and the checks that turn a bad file into one clear error.

The top-level keys are module constants so that the Trainer that writes a checkpoint, the plugins that
fill its sharded parts and the code that reads it cannot drift apart on a spelling. ``FORMAT_VERSION``
is bumped whenever a reader of the previous version could misread a new file; a reader refuses files
from the future instead of guessing.

Loading does not unpickle freely unless asked to (``torch.load(..., weights_only=True)``). The few non-tensor types the
format legitimately contains (numpy's RNG state is an ``ndarray``) are listed in :func:`safe_globals`;
a user whose hyper-parameters hold a class of their own registers it with :func:`register_safe_globals`,
or, for a file they trust, loads it whole with ``weights_only=False`` (:func:`trusted_unpickling`).
Lightning's hyper-parameter containers (its ``AttributeDict``, ``argparse.Namespace``) load by default,
without Lightning installed: see :func:`load_weights_only`.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from trainer_core.__about__ import __version__
from trainer_core.errors import CheckpointError
from trainer_core.utilities import AttributeDict, listing
from trainer_core.utilities.nesting import nesting_problem

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
#: What the training-type plugin keeps of its own (``plugin_state_dict()`` on global rank 0; a DDP
#: communication hook's state), in full checkpoints only, when it keeps anything.
KEY_PLUGIN_STATE = "plugin_state"
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


#: Where PyTorch Lightning (both packagings, 1.x and 2.x) and trainer-core define the ``AttributeDict`` that
#: ``self.hparams`` is: a checkpoint holds one when a hyper-parameter was another module's ``hparams``.
ATTRIBUTE_DICT_NAMES = (
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "trainer_core.utilities.AttributeDict",
)

# The containers the stand-ins made during the load in progress (see load_weights_only), with their classes.
_made_containers: contextvars.ContextVar[Optional[list[tuple[Any, type]]]] = contextvars.ContextVar(
    "trainer_core_made_containers", default=None
)


@functools.cache
def _stand_in(target: type) -> type:
    """What a checkpoint's dict or list subclass ``target`` unpickles as: a plain one, made ``target`` after the load.

    torch's weights-only unpickler fills only exact ``dict``s and ``list``s (its ``SETITEMS`` and
    ``APPENDS`` refuse a subclass, even a registered one), so the stand-in's ``__new__`` returns a
    plain container and notes it; :func:`load_weights_only` then gives it its class (without calling
    its ``__init__``). Nothing of the file's choosing runs.
    """
    plain = dict if issubclass(target, dict) else list

    class StandIn:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            made = plain()
            pending = _made_containers.get()
            if pending is not None:
                pending.append((made, target))
            return made

    StandIn.__qualname__ = f"StandIn[{target.__qualname__}]"
    return StandIn


def safe_globals() -> list[SafeGlobal]:
    """Everything beyond tensors and plain containers that a checkpoint may name when it is loaded."""
    # argparse.Namespace: Lightning's hyper-parameters of `save_hyperparameters(args)`; building one sets
    # attributes of that instance only.
    lightning: list[SafeGlobal] = [argparse.Namespace]
    lightning += [(_stand_in(AttributeDict), name) for name in ATTRIBUTE_DICT_NAMES]
    user: list[SafeGlobal] = [
        (_stand_in(obj), f"{obj.__module__}.{obj.__qualname__}")
        if isinstance(obj, type) and issubclass(obj, (dict, list))
        else obj
        for obj in _user_safe_globals
    ]
    return [*_numpy_safe_globals(), *lightning, *user]


def register_safe_globals(*objects: SafeGlobal) -> None:
    """Allow ``objects`` (classes or functions you trust) to be named by checkpoints you load.

    Use it when a checkpoint's hyper-parameters or a callback's state hold one of your own classes:
    loading refuses any global that is not registered, because unpickling one can run code.
    """
    _user_safe_globals.extend(objects)


# Set (trusted_unpickling) while the user's ckpt_path loads with fit/validate/test/predict(weights_only=False).
_trusted: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trainer_core_trusted_unpickling", default=False
)


@contextlib.contextmanager
def trusted_unpickling(trusted: bool = True) -> Iterator[None]:
    """Within the block (and ``trusted``), torch files are unpickled whole: ``torch.load(weights_only=False)``.

    Lightning's ``weights_only=False``, for a checkpoint the user trusts whose hyper-parameters hold
    objects no allow-list can name (an ``nn.Module``, a ``functools.partial``). Unpickling runs any
    code the file names, so nothing turns it on but that explicit argument, for that one load.
    """
    token = _trusted.set(trusted)
    try:
        yield
    finally:
        _trusted.reset(token)


def unpickling_trusted() -> bool:
    """Whether the load in progress was asked for with ``weights_only=False`` (see :func:`trusted_unpickling`)."""
    return _trusted.get()


def load_weights_only(load: Callable[[], Any], path: str) -> Any:
    """``load()`` (a ``torch.load(..., weights_only=True)`` of ``path``) with :func:`safe_globals` allowed.

    What it returns is checked to be walkable (:func:`~trainer_core.utilities.nesting.nesting_problem`:
    not nested too deep, not containing itself, not a "billion laughs" of shared references), and the
    containers that stand-ins made get their class (Lightning's ``AttributeDict`` becomes trainer-core's).
    Raises :class:`CheckpointError` naming ``path``; torch's own errors pass through to the caller.
    """
    made: list[tuple[Any, type]] = []
    token = _made_containers.set(made)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            loaded = load()
    finally:
        _made_containers.reset(token)
    problem = nesting_problem(loaded)
    if problem is not None:
        raise CheckpointError(
            f"{path} {problem}; no checkpoint trainer-core or Lightning writes does. It was crafted or "
            "damaged: use another checkpoint."
        )
    if made:
        targets = {id(plain): target for plain, target in made}
        loaded = _with_classes(loaded, targets, {})
    return loaded


def _with_classes(value: Any, targets: dict[int, type], done: dict[int, Any]) -> Any:
    """``value`` with each container a stand-in made (``targets``: id to class) as an instance of its class.

    Recursive: only called on what :func:`nesting_problem` passed (shallow, no cycles); ``done``
    keeps a container referenced twice one object.
    """
    key = id(value)
    if key in done:
        return done[key]
    result = value
    if isinstance(value, dict):
        for name, item in value.items():
            value[name] = _with_classes(item, targets, done)
        if key in targets:
            result = dict.__new__(targets[key])
            dict.update(result, value)
    elif type(value) is list:
        value[:] = [_with_classes(item, targets, done) for item in value]
        if key in targets:
            result = list.__new__(targets[key])
            list.extend(result, value)
    elif type(value) is tuple:
        result = tuple(_with_classes(item, targets, done) for item in value)
    elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, torch.Tensor):
        for name, item in vars(value).items():
            vars(value)[name] = _with_classes(item, targets, done)
    done[key] = result
    return result


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
    _check_value_types(checkpoint, path)
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
        _check_rng_states(checkpoint, path)


def _is_count(value: Any) -> bool:
    """A step or epoch counter: an int (not a bool, so not NaN or a float either), never negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_list_of_mappings(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(item, Mapping) for item in value)


def _is_hparams(value: Any) -> bool:
    return value is None or (isinstance(value, Mapping) and all(isinstance(key, str) for key in value))


#: What each top-level key holds when present, in both this format and Lightning's: (test, description).
_VALUE_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    KEY_EPOCH: (_is_count, "a non-negative int"),
    KEY_GLOBAL_STEP: (_is_count, "a non-negative int"),
    KEY_STATE_DICT: (
        lambda value: isinstance(value, Mapping) and all(isinstance(key, str) for key in value),
        "a dict of tensors by parameter name",
    ),
    KEY_OPTIMIZER_STATES: (_is_list_of_mappings, "a list of optimizer state dicts"),
    KEY_LR_SCHEDULERS: (_is_list_of_mappings, "a list of scheduler state dicts"),
    KEY_LOOPS: (lambda value: isinstance(value, Mapping), "a dict"),
    KEY_CALLBACKS: (lambda value: isinstance(value, Mapping), "a dict of callback states by state key"),
    KEY_RNG: (lambda value: isinstance(value, Mapping), "a dict"),
    KEY_RNG_PER_RANK: (_is_list_of_mappings, "a list of dicts, one per rank"),
    KEY_PRECISION: (lambda value: value is None or isinstance(value, Mapping), "a dict"),
    KEY_PLUGIN_STATE: (lambda value: isinstance(value, Mapping), "a dict (the plugin's plugin_state_dict())"),
    KEY_HPARAMS: (_is_hparams, "a dict of hyper-parameters by name"),
    KEY_DATAMODULE_HPARAMS: (_is_hparams, "a dict of hyper-parameters by name"),
    KEY_HPARAMS_NAME: (lambda value: value is None or isinstance(value, str), "an argument name"),
    KEY_DATAMODULE_HPARAMS_NAME: (lambda value: value is None or isinstance(value, str), "an argument name"),
}
#: The loop position ``Progress.load_state_dict`` reads from ``KEY_LOOPS`` (checked where present).
_LOOP_COUNTS = (LOOP_EPOCH, LOOP_BATCHES_DONE, LOOP_TOTAL_BATCH_IDX, LOOP_BATCHES_THAT_STEPPED)
_LOOP_FLAGS = (LOOP_EPOCH_FINISHED, LOOP_VALIDATED_LAST_BATCH)


def _check_value_types(checkpoint: Mapping[Any, Any], path: str) -> None:
    """Raise :class:`CheckpointError` naming ``path`` and the key whose value is of the wrong kind.

    Checked before anything reads the values, so an edited or crafted file is one clear error and
    never a ``TypeError`` from deep inside a restore, with the model unchanged.
    """
    for key, (is_valid, expected) in _VALUE_TYPES.items():
        if key in checkpoint and not is_valid(checkpoint[key]):
            raise CheckpointError(
                f"{path} has an invalid {key!r}: {_describe(checkpoint[key])} (expected {expected}). The file "
                "was edited or written by a broken writer; use another checkpoint."
            )
    # torch's optimizer states key parameters by index (Lightning's files); this format, by name.
    key_type = str if KEY_FORMAT_VERSION in checkpoint else int
    for index, state in enumerate(checkpoint.get(KEY_OPTIMIZER_STATES, [])):
        problem = _optimizer_state_problem(state, key_type)
        if problem is not None:
            raise CheckpointError(
                f"{path} has an invalid '{KEY_OPTIMIZER_STATES}[{index}]': {problem}. The file was edited or "
                "written by a broken writer; use another checkpoint."
            )
    if KEY_FORMAT_VERSION not in checkpoint:
        return  # Lightning's loops have their own layout (checkpoint/lightning.py checks it)
    loops = checkpoint.get(KEY_LOOPS)
    if not isinstance(loops, Mapping):
        return
    per_rank = loops.get(LOOP_PER_RANK, [])
    if not _is_list_of_mappings(per_rank):
        raise CheckpointError(
            f"{path} has an invalid '{KEY_LOOPS}.{LOOP_PER_RANK}': {_describe(per_rank)} (expected a list of "
            "dicts, one per rank). The file was edited or written by a broken writer; use another checkpoint."
        )
    for name, is_valid, expected in [
        *((name, _is_count, "a non-negative int") for name in _LOOP_COUNTS),
        *((name, lambda value: isinstance(value, bool), "True or False") for name in _LOOP_FLAGS),
    ]:
        if name in loops and not is_valid(loops[name]):
            raise CheckpointError(
                f"{path} has an invalid '{KEY_LOOPS}.{name}': {_describe(loops[name])} (expected {expected}). "
                "The file was edited or written by a broken writer; use another checkpoint."
            )


def _optimizer_state_problem(state: Mapping[str, Any], key_type: type) -> Optional[str]:
    """What is wrong with the layout of an optimizer state whose parameters are ``key_type`` keys, or ``None``."""
    kind = "parameter name" if key_type is str else "parameter index"

    def is_key(key: Any) -> bool:
        return isinstance(key, key_type) and not isinstance(key, bool)

    per_parameter = state.get("state", {})
    if not isinstance(per_parameter, Mapping):
        return f"its 'state' is {_describe(per_parameter)} (expected a dict by {kind})"
    for key, values in per_parameter.items():
        if not is_key(key):
            return f"its 'state' has the key {_describe(key)} (expected a {kind})"
        if not isinstance(values, Mapping):
            return f"'state[{key!r}]' is {_describe(values)} (expected a dict)"
        for name, value in values.items():
            # None: torch before 2.0 kept SGD's momentum_buffer as None without momentum (old Lightning files).
            if (name in PER_ELEMENT_OPTIMIZER_STATE and value is not None and not _is_tensor(value)) or (
                name == "step" and not _is_count_like(value)
            ):
                expected = "a non-negative number" if name == "step" else "a tensor"
                return f"'state[{key!r}].{name}' is {_describe(value)} (expected {expected})"
    groups = state.get("param_groups", [])
    if not _is_list_of_mappings(groups):
        return f"its 'param_groups' is {_describe(groups)} (expected a list of dicts)"
    for number, group in enumerate(groups):
        params = group.get("params", [])
        if not isinstance(params, (list, tuple)) or not all(is_key(key) for key in params):
            return f"'param_groups[{number}].params' is {_describe(params)} (expected a list of {kind}s)"
        # torch's own copy of the names (optimizers built over named_parameters()).
        names = group.get("param_names", [])
        if not isinstance(names, (list, tuple)):
            return f"'param_groups[{number}].param_names' is {_describe(names)} (expected a list)"
        for name, value in group.items():
            problem = _hyperparameter_problem(name, value)
            if problem is not None:
                return f"'param_groups[{number}].{name}' is {_describe(value)} (expected {problem})"
    return None


#: State that torch's optimizers keep per element of a parameter: a tensor of the parameter's shape.
PER_ELEMENT_OPTIMIZER_STATE = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "exp_inf",
        "momentum_buffer",
        "square_avg",
        "grad_avg",
        "acc_delta",
        "sum",
        "ax",
        "prev",
        "step_size",
        "variance",
    }
)
#: torch's optimizers' hyper-parameters of one kind, checked because a wrong one passes the load and then
#: fails the first step, after the weights loaded. (``eps`` is a pair in Adafactor; others are not checked.)
_NUMBER_HPARAMS = frozenset({"momentum", "dampening", "weight_decay", "alpha", "rho", "lr_decay"})
_FLAG_HPARAMS = frozenset(
    {"nesterov", "amsgrad", "maximize", "centered", "capturable", "differentiable", "foreach", "fused"}
)


def _is_tensor(value: Any) -> bool:
    # Or a tensor not read yet (checkpoint/stream.py's LazyTensor, in a sharded folder the CLI inspects).
    return isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype"))


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or _is_tensor(value)


def _scalar(value: Any) -> Optional[float]:
    """A number or a plain one-element tensor as a float; ``None`` for what is not read here (a DTensor)."""
    if isinstance(value, (int, float)):
        return float(value)
    if type(value) is torch.Tensor and value.numel() == 1 and not value.is_meta:
        return float(value.item())
    return None


def _is_count_like(value: Any) -> bool:
    """A number (or a one-element tensor) that is finite and not negative: torch's ``step``, a learning rate."""
    if not _is_number(value) or (isinstance(value, torch.Tensor) and value.numel() != 1):
        return False
    number = _scalar(value)
    return number is None or (math.isfinite(number) and number >= 0)


def _hyperparameter_problem(name: str, value: Any) -> Optional[str]:
    """What a saved param group's ``name`` should be when ``value`` is not that, else ``None``.

    The ranges are those torch's optimizers check when built (and not when a state loads).
    """
    if name == "lr" and not (value is None or _is_count_like(value)):  # None: optimizers that find their own
        return "a non-negative number"
    if name in _NUMBER_HPARAMS and not _is_count_like(value):
        return "a non-negative number"
    if name == "betas" and not (
        isinstance(value, (list, tuple))
        and all(_is_number(beta) and (_scalar(beta) is None or 0 <= _scalar(beta) < 1) for beta in value)
    ):
        return "a pair of numbers from 0 to below 1"
    if name in _FLAG_HPARAMS and not (value is None or isinstance(value, bool)):
        return "True, False or None"
    return None


def _check_rng_states(checkpoint: Mapping[str, Any], path: str) -> None:
    """Every saved generator state a resume may put back is one the generators take.

    The states are put back only when the resumed run reaches them (the epoch's start), after the
    weights loaded; so each is tried now, and the generators are given their own states back.
    """
    from trainer_core.checkpoint.rng import apply_rng_states, collect_rng_states

    loops = checkpoint.get(KEY_LOOPS, {})
    per_rank_loops = loops.get(LOOP_PER_RANK, [])
    saved = [(KEY_RNG, checkpoint.get(KEY_RNG))]
    saved += [
        (f"{KEY_RNG_PER_RANK}[{rank}]", state)
        for rank, state in enumerate(checkpoint.get(KEY_RNG_PER_RANK) or [])
    ]
    saved += [(f"{KEY_LOOPS}.{LOOP_EPOCH_START_RNG}", loops.get(LOOP_EPOCH_START_RNG))]
    saved += [
        (f"{KEY_LOOPS}.{LOOP_PER_RANK}[{rank}].{LOOP_EPOCH_START_RNG}", own.get(LOOP_EPOCH_START_RNG))
        for rank, own in enumerate(per_rank_loops)
    ]
    own_states = collect_rng_states()
    try:
        for key, state in saved:
            if state is None:
                continue
            try:
                # The CUDA generators are not tried: that could initialize CUDA in a process that had not.
                cuda = state.get("cuda", []) if isinstance(state, Mapping) else []
                if not isinstance(cuda, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in cuda):
                    raise TypeError(f"'cuda' is {_describe(cuda)}, not a list of tensors")
                apply_rng_states({k: v for k, v in state.items() if k != "cuda"} if cuda else state)
            except Exception as err:  # torch, numpy and random each raise their own kind
                raise CheckpointError(
                    f"{path} has an invalid {key!r}: the random generators do not take it ({type(err).__name__}: "
                    f"{err}). The file was edited or written by a broken writer; use another checkpoint."
                ) from None
    finally:
        apply_rng_states(own_states)


def a_type(value: Any) -> str:
    """``"a list"``, ``"an int"``: the type of a value from a bad file, for its error message."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _describe(value: Any) -> str:
    """A value of a bad file, short: its type and, for a scalar, the value."""
    if isinstance(value, (bool, int, float)) or value is None:
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, Mapping) and not all(isinstance(key, str) for key in value):
        bad = next(key for key in value if not isinstance(key, str))
        return f"{a_type(value)} with the key {_describe(bad)}"
    if isinstance(value, (list, tuple)) and not all(isinstance(item, Mapping) for item in value):
        bad = next(item for item in value if not isinstance(item, Mapping))
        return f"{a_type(value)} with an item of type {type(bad).__name__}"
    return a_type(value)


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
    not_tensors = []
    for name in sorted(set(expected) & set(loaded)):
        if isinstance(expected[name], torch.Tensor) and not isinstance(loaded[name], torch.Tensor):
            not_tensors.append(f"{name}: {type(loaded[name]).__name__}")
            continue
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
    if not_tensors:
        problems.append(f"not a tensor in the checkpoint ({len(not_tensors)}): {listing(not_tensors)}")
    if problems:
        hint = "Load a checkpoint of this model, or change the model to match"
        if strict and not mismatched and not wrong_kind and not not_tensors:
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
