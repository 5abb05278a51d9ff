"""Reading a PyTorch Lightning 2.x checkpoint as a trainer-core one, so a project can move over mid-run.

A ``.ckpt`` written by ``pytorch_lightning.Trainer`` is converted, in memory, into this format
(:func:`from_lightning`); the result then takes the normal path: the same validation, the same
checks against the model, the same restore. So every plugin resumes a Lightning checkpoint
(DDP, FSDP, sharded optimizers), because they all take the name-keyed format, and nothing past
the conversion knows Lightning exists. The conversion runs where a loaded checkpoint is first
looked at (``restore_module_and_callbacks`` and ``load_module_from_checkpoint``); the checkpoint
IO returns a Lightning checkpoint as it read it.

What maps to what:

======================================  ===========================================================
Lightning                               trainer-core
======================================  ===========================================================
``state_dict``, ``epoch``,              the same keys (the module's code is the same but for its
``global_step``, ``hyper_parameters``,  imports, so the parameter names are too)
``lr_schedulers``
``optimizer_states`` (torch's,          name-keyed (``checkpoint/optimizer.py``), by the position of
keyed by parameter index)               each parameter in the module's own optimizer (see below)
``loops`` (fit loop progress)           the loop position (``LOOP_*``): epoch, batches done in it,
                                        whether its validation ran, batch counters
``callbacks``                           the same keys: ``ModelCheckpoint``, ``EarlyStopping`` and
                                        ``Timer`` keep Lightning's state keys and state layout, and
                                        a project's own callbacks have the same code; Lightning's
                                        other built-in callbacks are dropped with a warning
``MixedPrecision``/``FSDPPrecision``    the loss scaler's state (``precision``)
``<DataModule class name>``             the data module's ``state_dict`` (``datamodule``)
anything else (``on_save_checkpoint``)  kept under its own key, for the hooks that read it
======================================  ===========================================================

Optimizer state. Torch numbers an optimizer's parameters ``0..n-1`` in the order its param groups
list them; Lightning stores that. The names come from the optimizer the module builds now: the
parameter at position ``i`` of this run's optimizer gets the state saved at position ``i``. That is
exact under one assumption, the same one ``torch.optim.Optimizer.load_state_dict`` makes (and so
Lightning's own resume): ``configure_optimizers`` builds its optimizers over the same parameters, in
the same groups and the same order, as in the run that saved the checkpoint. What can be checked is:
the number of optimizers, of groups and of parameters in each group, and every per-parameter state
tensor against the shape of the parameter it is given to; any difference is one
:class:`CheckpointError` naming the file, never a silent wrong mapping. (Two parameters of the same
shape swapped between runs cannot be told apart; that is the assumption.) Where torch saved the
parameters' names too (an optimizer built from ``named_parameters()``), those names are used
instead of positions. Before ``configure_optimizers`` has run the states wait, index-keyed, under
``KEY_LIGHTNING_OPTIMIZER_STATES`` (only what needs no optimizer is checked then: each holds no more
parameters than the module has) and :func:`name_pending_optimizer_states` names them once the
optimizers exist, before any of them loads.

Where this differs from Lightning's own resume, and why:

* Lightning does not save the random generators. The resumed run draws from them as they stand
  when the checkpoint is loaded, as a Lightning resume does; a run that must continue exactly
  draws nothing random the data order depends on (or seeds it itself).
* Saved in the middle of an epoch, the run continues at the next batch of that epoch (the batches
  already trained on are skipped), which is what the run that never stopped did. Lightning
  restarts the data from the epoch's beginning (with a warning) unless the loader is stateful.
* Saved in the middle of a validation (``on_validation_batch_end``), the rest of that validation
  does not run after the resume, as for trainer-core's own checkpoints; Lightning's resume runs it.
* Saved between two optimizer steps of an accumulation cycle, the gradients accumulated so far are
  not in the file (Lightning does not save them): the cycle's next step sums only the batches
  after the resume, as in a Lightning resume. Save at optimizer steps for an exact resume.
* A ``ReduceLROnPlateau`` step due right after a checkpoint written in ``on_train_epoch_end`` is
  not taken: Lightning does not store the metric it would read (Lightning's resume skips it too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
from torch import nn

from trainer_core.checkpoint.format import (
    FORMAT_VERSION,
    KEY_CALLBACKS,
    KEY_DATAMODULE,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_LIGHTNING_OPTIMIZER_STATES,
    KEY_LIGHTNING_VERSION,
    KEY_LOOPS,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PRECISION,
    KEY_RNG,
    KEY_STATE_DICT,
    LOOP_BATCHES_DONE,
    LOOP_BATCHES_THAT_STEPPED,
    LOOP_EPOCH,
    LOOP_EPOCH_FINISHED,
    LOOP_TOTAL_BATCH_IDX,
    LOOP_VALIDATED_LAST_BATCH,
    PER_ELEMENT_OPTIMIZER_STATE,
    a_type,
    validate_checkpoint,
)
from trainer_core.checkpoint.optimizer import optimizer_state_to_names, parameter_names
from trainer_core.checkpoint.rng import collect_rng_states
from trainer_core.errors import CheckpointError
from trainer_core.utilities import listing, rank_zero_warn
from trainer_core.utilities.compiled_names import plain_name, plain_state_dict

if TYPE_CHECKING:
    from torch.optim import Optimizer

# Lightning's own keys (pytorch_lightning/trainer/connectors/checkpoint_connector.py and loops/).
_OPTIMIZER_STATES = "optimizer_states"
_LOOPS = "loops"
_FIT_LOOP = "fit_loop"
_EPOCH_PROGRESS = "epoch_progress"
_BATCH_PROGRESS = "epoch_loop.batch_progress"
_EPOCH_LOOP_STATE = "epoch_loop.state_dict"
_BATCHES_THAT_STEPPED = "_batches_that_stepped"
_IS_LAST_BATCH = "is_last_batch"
#: Where Lightning's precision plugins keep the loss scaler (the last one is Lightning 1.x's name).
_PRECISION_KEYS = ("MixedPrecision", "FSDPPrecision", "native_amp_scaling_state")
#: torch's copy of the parameter names in a param group (optimizers built from ``named_parameters()``).
_TORCH_PARAM_NAMES = "param_names"
#: Lightning's built-in callbacks whose state trainer-core's callback of the same name loads as it is
#: (same state key, same state layout; tests/checkpoint/test_lightning_checkpoint.py checks them).
COMPATIBLE_CALLBACKS = frozenset({"ModelCheckpoint", "EarlyStopping", "Timer"})
#: Lightning's other built-in callbacks that keep a state: it is not carried over (the callback
#: starts afresh), because its layout is Lightning's internals (optimizer indices, averaged models).
_LIGHTNING_STATEFUL_CALLBACKS = frozenset(
    {
        "BackboneFinetuning",
        "BaseFinetuning",
        "StochasticWeightAveraging",
        "WeightAveraging",
        "EMAWeightAveraging",
        "ModelPruning",
        "SpikeDetection",
        "LearningRateFinder",
        "BatchSizeFinder",
    }
)

#: The keys this module translates; every other top-level key of the Lightning file is kept as it is.
_TRANSLATED = frozenset(
    {
        KEY_EPOCH,
        KEY_GLOBAL_STEP,
        KEY_STATE_DICT,
        _LOOPS,
        KEY_CALLBACKS,
        _OPTIMIZER_STATES,
        KEY_LR_SCHEDULERS,
        *_PRECISION_KEYS,
    }
)


def is_lightning_checkpoint(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` (a loaded dict) was written by PyTorch Lightning, not by trainer-core."""
    return (
        isinstance(checkpoint, Mapping)
        and KEY_LIGHTNING_VERSION in checkpoint
        and KEY_FORMAT_VERSION not in checkpoint
    )


def from_lightning(
    checkpoint: Mapping[str, Any],
    module: Optional[nn.Module],
    path: str,
    optimizers: Optional[Sequence[Optimizer]] = None,
) -> dict[str, Any]:
    """The trainer-core checkpoint that the Lightning checkpoint ``checkpoint`` (read from ``path``) describes.

    ``module`` is the module it will load into (``None`` when only its weights and hyper-parameters
    are wanted, as in ``load_from_checkpoint``); ``optimizers`` are the module's optimizers when they
    exist already. Without them the optimizer states wait for :func:`name_pending_optimizer_states`.
    Tensors are shared with ``checkpoint``, not copied. Raises :class:`CheckpointError` naming ``path``
    and the key, for a value of the wrong kind too (``validate_checkpoint``), before anything is converted.
    """
    validate_checkpoint(checkpoint, path, accept_lightning=True)
    precision = next((checkpoint[key] for key in _PRECISION_KEYS if key in checkpoint), None)
    if precision is not None and not isinstance(precision, Mapping):
        key = next(key for key in _PRECISION_KEYS if key in checkpoint)
        raise _invalid(path, key, precision, "a dict: the loss scaler's state")
    converted: dict[str, Any] = {k: v for k, v in checkpoint.items() if k not in _TRANSLATED}
    converted[KEY_FORMAT_VERSION] = FORMAT_VERSION
    converted[KEY_EPOCH] = checkpoint[KEY_EPOCH]
    converted[KEY_GLOBAL_STEP] = checkpoint[KEY_GLOBAL_STEP]
    # Lightning writes a compiled submodule's weights as `net._orig_mod.0.weight`: here they are `net.0.weight`.
    converted[KEY_STATE_DICT] = plain_state_dict(checkpoint[KEY_STATE_DICT])
    trainer = getattr(module, "_trainer", None)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    converted[KEY_LOOPS] = loop_position(
        checkpoint, accumulate if isinstance(accumulate, int) else 1, path=path
    )
    # Lightning does not save them: the generators as they stand now (see the module's docstring).
    converted[KEY_RNG] = collect_rng_states()
    if KEY_LR_SCHEDULERS in checkpoint:
        converted[KEY_LR_SCHEDULERS] = list(checkpoint[KEY_LR_SCHEDULERS])
    if KEY_CALLBACKS in checkpoint:
        converted[KEY_CALLBACKS] = _callback_states(checkpoint[KEY_CALLBACKS])
    if precision:
        converted[KEY_PRECISION] = precision
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and type(datamodule).__qualname__ in checkpoint:
        converted[KEY_DATAMODULE] = checkpoint[type(datamodule).__qualname__]
    if _OPTIMIZER_STATES in checkpoint:
        states = list(checkpoint[_OPTIMIZER_STATES])
        if module is not None and optimizers:
            converted[KEY_OPTIMIZER_STATES] = optimizer_states_to_names(states, module, optimizers, path)
        else:
            if module is not None:
                _check_fits_module(states, module, path)
            # Named once the optimizers exist; until then nothing may read them as name-keyed.
            converted[KEY_OPTIMIZER_STATES] = []
            converted[KEY_LIGHTNING_OPTIMIZER_STATES] = states
    return converted


def _invalid(path: str, key: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(
        f"{path} (a PyTorch Lightning checkpoint) has an invalid {key!r}: {a_type(value)} (expected "
        f"{expected}). The file was edited or written by a broken writer; use another checkpoint."
    )


def name_pending_optimizer_states(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[Optimizer], path: str
) -> None:
    """Name the optimizer states a converted Lightning checkpoint kept index-keyed (no-op for others).

    Called once ``configure_optimizers`` has run, before any optimizer loads a state.
    """
    states = checkpoint.pop(KEY_LIGHTNING_OPTIMIZER_STATES, None)
    if states is not None:
        checkpoint[KEY_OPTIMIZER_STATES] = optimizer_states_to_names(states, module, optimizers, path)


def optimizer_states_to_names(
    states: Sequence[Mapping[str, Any]], module: nn.Module, optimizers: Sequence[Optimizer], path: str
) -> list[dict[str, Any]]:
    """Lightning's index-keyed optimizer states as name-keyed ones, one per optimizer, all checked first."""
    where = f"{path} (a PyTorch Lightning checkpoint)"
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"{where} holds the state of {len(states)} optimizer(s), and configure_optimizers returned "
            f"{len(optimizers)}. Return the optimizers of the run that saved it, in the same order."
        )
    names = parameter_names(module)
    return [
        _name_one(state, optimizer, names, f"{where}, optimizer {index} ({type(optimizer).__name__})")
        for index, (state, optimizer) in enumerate(zip(states, optimizers))
    ]


def _name_one(
    state: Mapping[str, Any], optimizer: Optimizer, names: Mapping[torch.Tensor, str], where: str
) -> dict[str, Any]:
    if not state:
        return {}
    saved_groups = state.get("param_groups", [])
    saved_sizes = [len(group["params"]) for group in saved_groups]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"{where}: the saved optimizer has {len(saved_sizes)} param group(s) of {saved_sizes} parameters, "
            f"the one configure_optimizers built now has {len(sizes)} of {sizes}. The state is mapped to "
            "parameters by their position, so configure_optimizers must build its optimizers over the same "
            "parameters, in the same groups and order, as the run that saved the checkpoint."
        )
    unnamed = sum(1 for group in optimizer.param_groups for p in group["params"] if p not in names)
    if unnamed:
        raise CheckpointError(
            f"{where}: {unnamed} parameter(s) of the optimizer are not parameters of the module; "
            "configure_optimizers must optimize the module's own parameters."
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ordered = [names[p] for p in params]
    saved_names = _saved_param_names(saved_groups, set(ordered))
    by_name = dict(zip(ordered, params))
    position_names = saved_names if saved_names is not None else ordered
    index_to_name = {
        index: name
        for saved_group, group_names in zip(saved_groups, _split(position_names, sizes))
        for index, name in zip(saved_group["params"], group_names)
    }
    mismatched = []
    unknown = [str(index) for index in state.get("state", {}) if index not in index_to_name]
    for index, values in state.get("state", {}).items():
        name = index_to_name.get(index)
        if name is None:
            continue
        shape = tuple(by_name[name].shape)
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and not _state_fits(key, value, shape):
                mismatched.append(f"{name}: {key} {tuple(value.shape)} vs parameter {shape}")
    if unknown or mismatched:
        problems = []
        if unknown:
            problems.append(f"state for parameter positions no param group lists: {listing(unknown)}")
        if mismatched:
            problems.append(
                f"state of another shape than the parameter at its position ({len(mismatched)}): "
                f"{listing(mismatched)}"
            )
        raise CheckpointError(
            f"{where} does not fit the optimizer configure_optimizers built:\n  "
            + "\n  ".join(problems)
            + "\nconfigure_optimizers must build its optimizers over the same parameters, in the same groups "
            "and order, as the run that saved the checkpoint."
        )
    return optimizer_state_to_names(dict(state), optimizer, position_names)


def _state_fits(key: str, value: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a state tensor can belong to a parameter of ``shape``.

    The per-element statistics of torch's optimizers have the parameter's shape. Of other tensors,
    one with the parameter's number of dimensions must broadcast to it (Adafactor's factored row and
    column variances); scalars (``step``) and flat whole-optimizer vectors (L-BFGS) are not checked.
    """
    if key in PER_ELEMENT_OPTIMIZER_STATE:
        return tuple(value.shape) == shape
    if value.dim() != len(shape):
        return True
    return all(size in (full, 1) for size, full in zip(value.shape, shape))


def _saved_param_names(saved_groups: Sequence[Mapping[str, Any]], known: set[str]) -> Optional[list[str]]:
    """The names torch saved with the groups, if it did and they are the module's names; else ``None``."""
    if not saved_groups or not all(_TORCH_PARAM_NAMES in group for group in saved_groups):
        return None
    names = [plain_name(str(name)) for group in saved_groups for name in group[_TORCH_PARAM_NAMES]]
    return names if set(names) == known and len(names) == len(known) else None


def _split(names: Sequence[str], sizes: Sequence[int]) -> list[Sequence[str]]:
    out, start = [], 0
    for size in sizes:
        out.append(names[start : start + size])
        start += size
    return out


def _check_fits_module(states: Sequence[Mapping[str, Any]], module: nn.Module, path: str) -> None:
    """Before the optimizers exist: no saved optimizer holds more parameters than the module has."""
    count = sum(1 for _ in module.parameters())
    for index, state in enumerate(states):
        saved = sum(len(group["params"]) for group in state.get("param_groups", []))
        if saved > count:
            raise CheckpointError(
                f"{path} (a PyTorch Lightning checkpoint): optimizer {index} holds {saved} parameters and "
                f"{type(module).__name__} has {count}. Load a checkpoint of this model."
            )


def _callback_states(states: Mapping[str, Any]) -> dict[str, Any]:
    """The callback states trainer-core's callbacks load as they are (see :data:`COMPATIBLE_CALLBACKS`)."""
    kept: dict[str, Any] = {}
    dropped = []
    for key, state in states.items():
        class_name = str(key).split("{", 1)[0]
        if class_name in _LIGHTNING_STATEFUL_CALLBACKS and class_name not in COMPATIBLE_CALLBACKS:
            dropped.append(str(key))
        else:
            kept[key] = state
    if dropped:
        rank_zero_warn(
            f"The PyTorch Lightning checkpoint holds the state of {listing(dropped)}; its layout is Lightning's "
            "own, so trainer-core's callback of that name starts afresh instead of resuming it."
        )
    return kept


# ---------------------------------------------------------------------- the loop position
class _Counts(NamedTuple):
    ready: int
    started: int
    processed: int
    completed: int


def _mapping(value: Any, path: str, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(path, key, value, "a dict")
    return value


def _count(values: Mapping[str, Any], name: str, default: int, path: str, prefix: str) -> int:
    """``values[name]``, one of Lightning's counters (``prefix``: where ``values`` is, as ``"loops.x."``).

    An int, never negative (so never NaN, a float or a bool).
    """
    value = values.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(
            f"{path} (a PyTorch Lightning checkpoint) has an invalid '{prefix}{name}': {value!r} (expected a "
            "non-negative int). The file was edited or written by a broken writer; use another checkpoint."
        )
    return value


def _counts(progress: Mapping[str, Any], part: str, path: str, key: str) -> _Counts:
    key = f"{key}.{part}"
    values = _mapping(progress.get(part, {}), path, key)
    key += "."
    completed = _count(values, "completed", 0, path, key)
    ready = _count(values, "ready", 0, path, key)
    # Trackers without a started/processed stage count them with ``ready``/``completed``.
    return _Counts(
        ready,
        _count(values, "started", ready, path, key),
        _count(values, "processed", completed, path, key),
        completed,
    )


def loop_position(
    checkpoint: Mapping[str, Any], accumulate_grad_batches: int = 1, path: str = "the checkpoint"
) -> dict[str, Any]:
    """Where Lightning's fit loop stood, as the ``loops`` entry ``Progress.load_state_dict`` reads.

    Lightning counts each epoch and batch as ready, started, processed and completed, so the
    counters tell which hook the checkpoint was written from:

    * a batch processed but not completed: its ``on_train_batch_end``; the validation it may be due
      has not run;
    * batches all completed, the epoch not processed: a validation during the epoch (or at its end);
    * the epoch processed, not completed: ``on_train_epoch_end``;
    * everything completed: between epochs or after ``fit``; the epoch was cut short (``max_steps``)
      if its last batch was not reached, and then the run continues inside it, as trainer-core's own
      checkpoints of a cut epoch do.

    ``accumulate_grad_batches`` tells whether the last batch stepped the optimizer (Lightning
    counts the batches that stepped only after the batch's validation). A counter that is not a
    non-negative int is a :class:`CheckpointError` naming ``path`` and the counter.
    """
    epoch = _count(checkpoint, KEY_EPOCH, 0, path, "")
    global_step = _count(checkpoint, KEY_GLOBAL_STEP, 0, path, "")
    fit = checkpoint.get(_LOOPS, {}).get(_FIT_LOOP) if isinstance(checkpoint.get(_LOOPS), Mapping) else None
    if not isinstance(fit, Mapping) or _EPOCH_PROGRESS not in fit:
        # No loop state (edited, or not from Lightning 2.x): the start of the saved epoch.
        return _position(epoch, 0, False, False, 0, global_step)
    key = f"{_LOOPS}.{_FIT_LOOP}"
    epoch_progress = _mapping(fit[_EPOCH_PROGRESS], path, f"{key}.{_EPOCH_PROGRESS}")
    epochs = _counts(epoch_progress, "current", path, f"{key}.{_EPOCH_PROGRESS}")
    batch_progress = _mapping(fit.get(_BATCH_PROGRESS, {}), path, f"{key}.{_BATCH_PROGRESS}")
    batches = _counts(batch_progress, "current", path, f"{key}.{_BATCH_PROGRESS}")
    is_last = batch_progress.get(_IS_LAST_BATCH, False)
    if not isinstance(is_last, bool):
        raise _invalid(path, f"{key}.{_BATCH_PROGRESS}.{_IS_LAST_BATCH}", is_last, "True or False")
    total_batches = _counts(batch_progress, "total", path, f"{key}.{_BATCH_PROGRESS}").processed
    epoch_loop = _mapping(fit.get(_EPOCH_LOOP_STATE, {}), path, f"{key}.{_EPOCH_LOOP_STATE}")
    stepped = _count(epoch_loop, _BATCHES_THAT_STEPPED, 0, path, f"{key}.{_EPOCH_LOOP_STATE}.")
    if epochs.processed < epochs.started:
        # Inside the epoch's batches, or a validation between them.
        done = batches.processed
        if done and batches.ready == done and (done % accumulate_grad_batches == 0 or is_last):
            stepped += 1  # this batch stepped; Lightning counts it after its validation
        validated = done > 0 and batches.completed >= done
        return _position(epochs.started - 1, done, False, validated, total_batches, stepped)
    if epochs.completed < epochs.processed:
        # In on_train_epoch_end: the epoch finished, unless it was cut short before its last batch.
        return _position(epochs.processed - 1, batches.processed, is_last, True, total_batches, stepped)
    if epochs.completed and epochs.ready == epochs.started and batches.processed and not is_last:
        # Saved after the run stopped inside an epoch (max_steps): continue with its next batch.
        return _position(epochs.completed - 1, batches.processed, False, True, total_batches, stepped)
    # Between epochs (or in on_train_epoch_start): the next epoch starts from its first batch.
    return _position(epochs.completed, 0, False, False, total_batches, stepped)


def _position(
    epoch: int, done: int, finished: bool, validated: bool, total_batches: int, stepped: int
) -> dict[str, Any]:
    return {
        LOOP_EPOCH: epoch,
        LOOP_BATCHES_DONE: done,
        LOOP_EPOCH_FINISHED: finished,
        LOOP_TOTAL_BATCH_IDX: total_batches,
        LOOP_BATCHES_THAT_STEPPED: stepped,
        LOOP_VALIDATED_LAST_BATCH: validated,
    }
