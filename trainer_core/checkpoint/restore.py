"""Putting a run back from a checkpoint, and building a module from one.

``restore_checkpoint`` checks *everything* (format, parameter names and shapes, optimizer names,
counts) before it changes anything, so a bad file leaves the model, the optimizers and the trainer
as they were. It works on the run's stateful parts (:class:`~trainer_core.run_state.CheckpointParts`,
which the Trainer hands over), never on the Trainer.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

import torch
from torch import nn

from trainer_core.checkpoint.format import (
    KEY_CALLBACKS,
    KEY_DATAMODULE,
    KEY_GLOBAL_STEP,
    KEY_HPARAMS,
    KEY_HPARAMS_NAME,
    KEY_LOOPS,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PLUGIN,
    KEY_PLUGIN_STATE,
    KEY_PRECISION,
    KEY_RNG,
    KEY_RNG_PER_RANK,
    KEY_STATE_DICT,
    LOOP_DATALOADER,
    LOOP_EPOCH,
    LOOP_GRADS,
    LOOP_PENDING_PLATEAU,
    LOOP_PER_RANK,
    PER_ELEMENT_OPTIMIZER_STATE,
    PLUGIN_PRECISION,
    check_state_dict_matches,
    trusted_unpickling,
    validate_checkpoint,
)
from trainer_core.checkpoint.lightning import (
    from_lightning,
    is_lightning_checkpoint,
    name_pending_optimizer_states,
)
from trainer_core.checkpoint.optimizer import (
    merge_named_states,
    named_parameters_of,
    parameter_names,
    select_named_state,
)
from trainer_core.checkpoint.save import data_replicas, loader_batch_size
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.hparams import hparams_argument
from trainer_core.optim import rebase_learning_rates
from trainer_core.precision import Precision, describe_change, loaded_state
from trainer_core.utilities import listing, rank_zero_info, rank_zero_warn
from trainer_core.utilities.compiled_names import (
    module_state_dict,
    plain_named_parameters,
    plain_optimizer_state,
    plain_state_dict,
)

if TYPE_CHECKING:
    from trainer_core.loops.progress import Progress
    from trainer_core.run_state import CheckpointParts, CheckpointPlugin

# A ``LightningModule`` class (trainer_core.module), built from a checkpoint's hyper-parameters.
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def resolve_ckpt_path(parts: CheckpointParts, ckpt_path: Union[str, os.PathLike]) -> Optional[str]:
    """A path as given; ``"best"``: the best checkpoint of this run; ``"last"``: the newest complete one."""
    path = os.fspath(ckpt_path)
    if path == "best":
        callback = parts.checkpoint_callbacks[0] if parts.checkpoint_callbacks else None
        best = getattr(callback, "best_model_path", "") if callback is not None else ""
        if not best:
            raise CheckpointError(
                'ckpt_path="best" needs a ModelCheckpoint that has saved a checkpoint in this run; pass a path instead.'
            )
        return best
    if path != "last":
        return path
    plugin = parts.plugin
    io = plugin.checkpoint_io
    folders: list[list[str]] = []  # every complete checkpoint this rank sees, per folder, oldest first
    for cb in parts.checkpoint_callbacks:
        if cb.dirpath is None:
            parts.hooks.setup_callback(cb, "fit")
        folders += [io.list_complete(folder) for folder in cb.resume_search_dirs()]
    if plugin.world_size > 1:
        common = _agreed_checkpoints(parts, [found for listed in folders for found in listed])
        folders = [[found for found in listed if found in common] for listed in folders]
    # The newest of each folder, then the newest of those.
    candidates = [listed[-1] for listed in folders if listed]
    reason = parts.resume_reason
    if not candidates:
        rank_zero_warn(
            f"{reason + ': ' if reason else ''}"
            'fit(ckpt_path="last") found no complete checkpoint; training starts from the beginning.'
        )
        return None
    newest = candidates[0] if len(candidates) == 1 else max(candidates, key=io.saved_at)
    if reason:
        rank_zero_info(f"{reason}: resuming from {newest}.")
    return newest


def _agreed_checkpoints(parts: CheckpointParts, listed: list[str]) -> set[str]:
    """The checkpoints every rank sees as complete, so that every rank resumes the same step.

    Nodes list the folder at slightly different moments (a save may finish, or an old checkpoint be
    removed, in between), and on a folder that is not shared they may see different files: each rank
    picking its own newest could load different steps.
    """
    seen = parts.plugin.all_gather_object(listed)
    common = set(seen[0]).intersection(*seen[1:])
    if not common and any(seen):
        newest = "; ".join(
            f"rank {rank}: {found[-1] if found else 'none'}" for rank, found in enumerate(seen)
        )
        raise CheckpointError(
            f'fit(ckpt_path="last"): the ranks see no complete checkpoint in common (newest per rank: {newest}). '
            "Every node must see the same checkpoint folder (a shared file system or an object store); "
            "or pass one path that every rank can read as ckpt_path."
        )
    return common


def restore_checkpoint(
    parts: CheckpointParts, ckpt_path: Union[str, os.PathLike], weights_only: bool = False
) -> None:
    """Load ``ckpt_path`` into a run already set up (its optimizers exist): both steps below at once."""
    pending = restore_module_and_callbacks(parts, ckpt_path, weights_only, optimizers_ready=True)
    if pending is not None and not weights_only:
        restore_training_state(parts, pending)


@dataclass
class PendingRestore:
    """A checkpoint whose weights and callbacks are loaded, and whose training state loads once the optimizers exist."""

    checkpoint: dict[str, Any]
    path: str
    # Checked and prepared already when the optimizers existed at the first step.
    optimizer_states: Optional[list[Any]] = None
    scheduler_states: Optional[list[dict[str, Any]]] = None
    # The weights the model had before the first step loaded the checkpoint's, on the CPU, while the second
    # step's checks (against optimizers that did not exist yet) may still refuse the file.
    previous_weights: Optional[dict[str, Any]] = None


def restore_module_and_callbacks(
    parts: CheckpointParts,
    ckpt_path: Union[str, os.PathLike],
    weights_only: bool = False,
    optimizers_ready: bool = False,
    checkpoint: Optional[dict[str, Any]] = None,
) -> Optional[PendingRestore]:
    """The first step of a restore, before ``configure_optimizers`` (Lightning's order): the module, then callbacks.

    The file is read and checked; the module's ``on_load_checkpoint`` runs (it may edit the
    checkpoint, renaming weights, or change the model); then the weights are checked against the
    model and the saved optimizer states against its parameters (against the optimizers themselves
    when they exist already, ``optimizers_ready``: plugins that restore after setting up), all before anything loads, so
    a file that does not fit leaves the model as it was. Then the weights load, and (unless
    ``weights_only``) the data module's state and the callbacks' ``on_load_checkpoint`` and
    ``load_state_dict``. Returns what :func:`restore_training_state` finishes, or ``None`` when
    ``ckpt_path="last"`` found nothing. ``checkpoint``: one already in memory (a live peer's, which
    ``ckpt_path`` then only names in messages).
    """
    module = parts.module
    plugin = parts.plugin
    assert module is not None
    if checkpoint is not None:
        path = os.fspath(ckpt_path)
    else:
        resolved = resolve_ckpt_path(parts, ckpt_path)
        if resolved is None:
            return None
        path = resolved
        with trusted_unpickling(parts.trusted_checkpoint):
            checkpoint = plugin.load_checkpoint(path)
    if is_lightning_checkpoint(checkpoint):  # converted to this format (checkpoint/lightning.py)
        optimizers = plugin.optimizers if optimizers_ready and not weights_only else None
        checkpoint = from_lightning(checkpoint, module, path, optimizers)
    validate_checkpoint(checkpoint, path, for_resume=not weights_only)
    _plain_names(checkpoint)
    runner = parts.hooks
    runner.call_module("on_load_checkpoint", checkpoint)
    strict = module.strict_loading
    check_state_dict_matches(
        plain_state_dict(module.state_dict()), checkpoint[KEY_STATE_DICT], path, strict=strict
    )
    pending = PendingRestore(checkpoint, path)
    if not weights_only:
        if optimizers_ready:
            # Schedulers first: states that disagree are the root cause of ambiguous optimizer groups.
            pending.scheduler_states = _scheduler_states_for(
                checkpoint[KEY_LR_SCHEDULERS], len(plugin.lr_scheduler_configs), path
            )
            pending.optimizer_states = _optimizer_states_for(
                plugin, module, checkpoint[KEY_OPTIMIZER_STATES], path
            )
        else:
            _check_optimizer_names(module, checkpoint[KEY_OPTIMIZER_STATES], path)

    # Nothing has changed yet; from here on the weights are known to fit.
    if not weights_only and not optimizers_ready:
        # The optimizer and scheduler states can only be checked once configure_optimizers has run: until
        # then the model's own weights are kept, to be put back if those checks refuse the file. (Plugins
        # whose weights are sharded restore after setup, with every check first, and keep no copy.)
        # Extra state may be any object (TransformerEngine's is an io.BytesIO): copied as it is.
        pending.previous_weights = {
            k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in module.state_dict().items()
        }
    plugin.load_model_state_dict(checkpoint[KEY_STATE_DICT], strict=strict)
    parts.restored_from(path)
    if weights_only:
        return pending
    if parts.datamodule is not None and KEY_DATAMODULE in checkpoint:
        parts.datamodule.load_state_dict(checkpoint[KEY_DATAMODULE])
    # Lightning's signature: each callback's hook receives the Trainer, which the hook runner holds.
    runner.call_callbacks_on_checkpoint("on_load_checkpoint", checkpoint)
    callback_states = checkpoint.get(KEY_CALLBACKS, {})
    for cb in parts.callbacks:
        if cb.state_key in callback_states:
            cb.load_state_dict(callback_states[cb.state_key])
    return pending


def restore_training_state(parts: CheckpointParts, pending: PendingRestore) -> None:
    """The second step, once the optimizers exist: optimizers, schedulers, precision and loop position.

    The optimizer and scheduler states are checked against this run's optimizers and schedulers
    before any of them loads.
    """
    plugin = parts.plugin
    checkpoint, path = pending.checkpoint, pending.path
    try:
        # A Lightning checkpoint's optimizer states are index-keyed until the optimizers exist to name them.
        name_pending_optimizer_states(checkpoint, parts.module, plugin.optimizers, path)
        scheduler_states = pending.scheduler_states
        if scheduler_states is None:
            scheduler_states = _scheduler_states_for(
                checkpoint[KEY_LR_SCHEDULERS], len(plugin.lr_scheduler_configs), path
            )
        optimizer_states = pending.optimizer_states
        if optimizer_states is None:
            optimizer_states = _optimizer_states_for(
                plugin, parts.module, checkpoint[KEY_OPTIMIZER_STATES], path
            )
    except CheckpointError:
        if pending.previous_weights is not None:
            # The file does not fit this run's optimizers: the model gets its own weights back.
            plugin.load_model_state_dict(pending.previous_weights)
        raise
    pending.previous_weights = None
    _load_stepping_state(parts, checkpoint, optimizer_states, scheduler_states)
    _take_pending_plateau_steps(parts, checkpoint[KEY_LOOPS])
    _restore_loops(parts.progress, plugin, checkpoint)


def _load_stepping_state(
    parts: CheckpointParts,
    checkpoint: dict[str, Any],
    optimizer_states: list[Any],
    scheduler_states: list[dict[str, Any]],
) -> None:
    """What changes with every optimizer step, checked already: optimizers, plugin state, schedulers, scaler."""
    plugin = parts.plugin
    for opt, state in zip(plugin.optimizers, optimizer_states):
        plugin.load_optimizer_state_dict(opt, state)
    if KEY_PLUGIN_STATE in checkpoint:
        plugin.load_plugin_state_dict(checkpoint[KEY_PLUGIN_STATE])
    regrouped = len(checkpoint[KEY_LR_SCHEDULERS]) != len(plugin.lr_scheduler_configs)
    for config, state in zip(plugin.lr_scheduler_configs, scheduler_states):
        config.scheduler.load_state_dict(state)
        if regrouped:
            rebase_learning_rates(config.scheduler)
    _restore_precision(plugin.precision, checkpoint)


def restore_between_steps(parts: CheckpointParts, checkpoint: dict[str, Any], source: str) -> None:
    """A live peer's state, taken between two optimizer steps of a running loop (``"ddp_ft"``'s heal).

    What moves with the steps: the weights, the optimizers, the schedulers, the loss scaler, the
    plugin's state and the step count. The loop position stays: the groups draw their batches in
    step with one another, so this process is at the peer's batch already. Every part is checked
    before any loads.
    """
    plugin = parts.plugin
    module = parts.module
    assert module is not None
    validate_checkpoint(checkpoint, source, for_resume=True)
    _plain_names(checkpoint)
    check_state_dict_matches(
        plain_state_dict(module.state_dict()),
        checkpoint[KEY_STATE_DICT],
        source,
        strict=module.strict_loading,
    )
    scheduler_states = _scheduler_states_for(
        checkpoint[KEY_LR_SCHEDULERS], len(plugin.lr_scheduler_configs), source
    )
    optimizer_states = _optimizer_states_for(plugin, module, checkpoint[KEY_OPTIMIZER_STATES], source)
    plugin.load_model_state_dict(checkpoint[KEY_STATE_DICT], strict=module.strict_loading)
    _load_stepping_state(parts, checkpoint, optimizer_states, scheduler_states)
    parts.progress.global_step = checkpoint[KEY_GLOBAL_STEP]


def _restore_precision(precision: Precision, checkpoint: dict[str, Any]) -> None:
    """The precision's state (the loss scaler's), and a note when the checkpoint was written under another precision."""
    state = checkpoint.get(KEY_PRECISION) or {}
    writer = checkpoint.get(KEY_PLUGIN)
    saved = writer.get(PLUGIN_PRECISION) if isinstance(writer, dict) else None
    note = describe_change(saved, precision.name, state)
    if note is not None:
        rank_zero_warn(note)
    state = loaded_state(precision, saved, state)
    if state:
        precision.load_state_dict(state)


def _check_optimizer_names(module: nn.Module, saved: list[dict[str, Any]], path: str) -> None:
    """Before the optimizers exist: every parameter a saved optimizer state names is one of the module's.

    And its per-element state (Adam's ``exp_avg``, SGD's ``momentum_buffer``) has that parameter's
    shape: a wrong one loads without complaint and fails the first step, after the weights loaded.
    (Only here, where the saved states are whole tensors: sharded plugins check against their shards.)
    """
    shapes = {name: tuple(param.shape) for name, param in plain_named_parameters(module)}
    unknown = sorted(set().union(*map(named_parameters_of, saved)) - set(shapes))
    if unknown:
        raise CheckpointError(
            f"the optimizer state in {path} names parameters the model does not have: {unknown[:20]}. "
            "configure_optimizers must optimize the same parameters as the run that saved the checkpoint."
        )
    mismatched = [
        f"{name}: {key} {tuple(value.shape)} vs parameter {shapes[name]}"
        for state in saved
        for name, values in state.get("state", {}).items()
        for key, value in values.items()
        if key in PER_ELEMENT_OPTIMIZER_STATE
        and isinstance(value, torch.Tensor)
        and tuple(value.shape) != shapes[name]
    ]
    if mismatched:
        raise CheckpointError(
            f"the optimizer state in {path} does not fit the model's parameters ({len(mismatched)}): "
            f"{listing(mismatched)}. Resume from a checkpoint of this model."
        )


def _optimizer_states_for(
    plugin: CheckpointPlugin, module: nn.Module, saved: list[dict[str, Any]], path: str
) -> list[Any]:
    """What each of this run's optimizers loads, checked; nothing is changed here.

    With as many optimizers as were saved, each takes its own state. With more or fewer (the model
    was split into more or fewer parts, each with its own optimizer), the name-keyed states are
    pooled and every optimizer takes, by name, the parameters it holds.
    """
    optimizers = plugin.optimizers
    if len(saved) == len(optimizers):
        return [plugin.prepare_optimizer_state(opt, state, path) for state, opt in zip(saved, optimizers)]
    if not saved:
        raise CheckpointError(f"{path} holds no optimizer state; resume from a full checkpoint.")
    pooled = merge_named_states(saved)
    names = parameter_names(module)
    prepared = []
    for opt in optimizers:
        mine = [names[p] for group in opt.param_groups for p in group["params"] if p in names]
        prepared.append(plugin.prepare_optimizer_state(opt, select_named_state(pooled, mine), path))
    return prepared


def _scheduler_states_for(saved: list[dict[str, Any]], count: int, path: str) -> list[dict[str, Any]]:
    """One state per scheduler of this run from the flat saved list (copies when the counts differ).

    A scheduler's ``load_state_dict`` keeps references into the dict it is given, so each
    scheduler gets its own deep copy; the copies are only valid if every saved state is at the
    same step.
    """
    if len(saved) == count:
        return saved
    if count == 0:
        return []
    if not saved:
        raise CheckpointError(
            f"{path} holds no scheduler state but configure_optimizers returned {count} scheduler(s)."
        )
    steps = sorted({state.get("last_epoch") for state in saved}, key=str)
    kinds = sorted({tuple(sorted(state)) for state in saved})
    if len(steps) > 1 or len(kinds) > 1:
        raise CheckpointError(
            f"{path} holds {len(saved)} scheduler states and this run has {count} scheduler(s); they can only be "
            f"shared out when the saved ones agree, but they are at different steps ({steps}) or of different "
            "kinds. Resume with the same number of schedulers as the saved run."
        )
    return [copy.deepcopy(saved[0]) for _ in range(count)]


def _take_pending_plateau_steps(parts: CheckpointParts, loops: dict[str, Any]) -> None:
    """The ReduceLROnPlateau steps the saved run took right after writing the checkpoint."""
    pending = loops.get(LOOP_PENDING_PLATEAU)
    if not pending:
        return
    for config in parts.plugin.lr_scheduler_configs:
        due = (loops[LOOP_EPOCH] + 1) % config.frequency == 0
        if config.reduce_on_plateau and config.interval == "epoch" and due and config.monitor in pending:
            parts.hooks.call_module("lr_scheduler_step", config.scheduler, pending[config.monitor])


def _restore_loops(progress: Progress, plugin: CheckpointPlugin, checkpoint: dict[str, Any]) -> None:
    loops = checkpoint[KEY_LOOPS]
    progress.load_state_dict(
        loops, checkpoint[KEY_GLOBAL_STEP], _rng_for_this_rank(plugin, checkpoint), data_replicas(plugin)
    )
    own = loops
    per_rank = loops.get(LOOP_PER_RANK)
    if per_rank is not None and len(per_rank) == plugin.world_size:
        own = per_rank[plugin.global_rank]
    progress.resume.dataloader_state = own.get(LOOP_DATALOADER)
    progress.resume.grads = own.get(LOOP_GRADS)


def resume_batch_at_another_world_size(progress: Progress, plugin: CheckpointPlugin, loader: Any) -> None:
    """Once the loader exists: the first batch after the samples the saved run had already seen."""
    resume = progress.resume
    samples = resume.samples_done
    resume.samples_done = None
    batch = loader_batch_size(loader)
    if samples is not None and batch:
        resume.batch_idx = samples // (data_replicas(plugin) * batch)


def _rng_for_this_rank(plugin: CheckpointPlugin, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """This rank's own saved generators at the same world size; rank 0's at another one."""
    per_rank = checkpoint.get(KEY_RNG_PER_RANK)
    if per_rank is not None and len(per_rank) == plugin.world_size:
        return per_rank[plugin.global_rank]
    return checkpoint[KEY_RNG]


def load_module_from_checkpoint(
    cls: type[ModuleT],
    checkpoint_path: Union[str, os.PathLike],
    map_location: Any = None,
    strict: Optional[bool] = None,
    **overrides: Any,
) -> ModuleT:
    """``cls`` (a ``LightningModule``) built from the checkpoint's hyper-parameters (``overrides`` win), with its weights loaded.

    ``cls`` need not be the class that saved the file (Lightning's rules): hyper-parameters its
    ``__init__`` does not take are left out (unless it takes ``**kwargs``), and with ``strict=False``
    the weights both have load while the others keep their initial values, each side's extra names
    named in a warning. ``map_location`` is ``torch.load``'s (a device, a string, a dict of devices, or
    a ``(storage, location)`` callable); ``None`` maps storages of a device this machine lacks to the CPU.
    """
    from trainer_core.plugins.io import TorchCheckpointIO

    path = os.fspath(checkpoint_path)
    if map_location is None:
        map_location = _to_available_device
    checkpoint = TorchCheckpointIO().load_checkpoint(path, map_location=map_location)
    if is_lightning_checkpoint(checkpoint):  # converted to this format (checkpoint/lightning.py)
        checkpoint = from_lightning(checkpoint, None, path)
    validate_checkpoint(checkpoint, path)
    _plain_names(checkpoint)
    hparams = {**(checkpoint.get(KEY_HPARAMS) or {}), **overrides}  # a Mapping or None (validated)
    name = hparams_argument(cls, checkpoint.get(KEY_HPARAMS_NAME))
    if name:  # `__init__(self, hparams)` with `save_hyperparameters(hparams)`: the dict goes back whole
        parameters = inspect.signature(cls.__init__).parameters
        hparams = {name: hparams, **{k: v for k, v in overrides.items() if k in parameters and k != name}}
    try:
        model = cls(**_accepted_by_init(cls, hparams))
    except (CheckpointError, MisconfigurationException):
        raise
    except Exception as err:  # a missing argument, or a value the module refuses (nn.Linear(-1, 2))
        raise CheckpointError(
            f"{cls.__name__}(**hyper_parameters of {path}) failed: {type(err).__name__}: {err}. Pass the missing or "
            f"changed arguments to load_from_checkpoint as keywords."
        ) from err
    model.on_load_checkpoint(checkpoint)
    strict = _strict_for(model, strict)
    check_state_dict_matches(
        plain_state_dict(model.state_dict()), checkpoint[KEY_STATE_DICT], path, strict=strict
    )
    state = checkpoint[KEY_STATE_DICT]
    keys = model.load_state_dict(module_state_dict(model, state), strict=strict)
    if keys.missing_keys:
        rank_zero_warn(
            f"{cls.__name__}.load_from_checkpoint({path!r}, strict=False): the checkpoint has no value for "
            f"{keys.missing_keys}; they keep their initial values."
        )
    if keys.unexpected_keys:
        rank_zero_warn(
            f"{cls.__name__}.load_from_checkpoint({path!r}, strict=False): {cls.__name__} has no place for "
            f"{keys.unexpected_keys} of the checkpoint; they are not loaded."
        )
    # On the device the weights were read to (Lightning's rule), not where ``__init__`` built the module.
    device = next((t.device for t in state.values() if isinstance(t, torch.Tensor)), None)
    return model if device is None else model.to(device)


def _accepted_by_init(cls: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters ``cls.__init__`` takes: all of them when it has ``**kwargs``.

    A checkpoint loaded into another class than the one that saved it holds arguments of that class.
    """
    parameters = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return hparams
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in hparams.items() if k in names}


def _to_available_device(storage: Any, location: str) -> Any:
    """``torch.load``'s ``map_location`` when none is given: a storage of an absent accelerator to the CPU."""
    kind = location.split(":")[0]
    if (kind == "cuda" and not torch.cuda.is_available()) or (
        kind == "mps" and not torch.backends.mps.is_available()
    ):
        return storage.cpu()
    return None  # where it was saved


def _plain_names(checkpoint: dict[str, Any]) -> None:
    """The weights and optimizer states under plain names, also in a file written with ``_orig_mod`` ones.

    Before ``on_load_checkpoint``, so the module's hook sees the names this format documents; a run
    compiled or not loads either (utilities/compile.py).
    """
    checkpoint[KEY_STATE_DICT] = plain_state_dict(checkpoint[KEY_STATE_DICT])
    if checkpoint.get(KEY_OPTIMIZER_STATES):
        checkpoint[KEY_OPTIMIZER_STATES] = [
            plain_optimizer_state(state) for state in checkpoint[KEY_OPTIMIZER_STATES]
        ]


def _strict_for(model: Any, strict: Optional[bool]) -> bool:
    """``load_from_checkpoint(strict=...)`` if given, else the module's ``strict_loading``; both given must agree."""
    if strict is not None and model._strict_loading is not None and strict != model.strict_loading:
        raise MisconfigurationException(
            f"load_from_checkpoint(strict={strict}) contradicts {type(model).__name__}.strict_loading="
            f"{model.strict_loading}; pass the same value, or leave `strict` out to use strict_loading."
        )
    return model.strict_loading if strict is None else strict
