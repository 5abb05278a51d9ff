"""Building the checkpoint dict of a run, and putting a run back from one.

``dump_checkpoint`` assembles DESIGN.md's dict on every rank; the plugin fills the parts it owns
(model state, optimizer state under the consolidation rule) and writes it. ``restore_checkpoint``
checks *everything* (format, parameter names and shapes, optimizer names, counts) before it
changes anything, so a bad file leaves the model, the optimizers and the trainer as they were.
"""

from __future__ import annotations

import copy
import os
import random
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

from trainer_core.__about__ import __version__
from trainer_core.checkpoint import (
    FORMAT_VERSION,
    KEY_CALLBACKS,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_HPARAMS,
    KEY_LOOPS,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PLUGIN,
    KEY_PRECISION,
    KEY_RNG,
    KEY_STATE_DICT,
    KEY_VERSION,
    check_state_dict_matches,
    merge_named_states,
    select_named_state,
    validate_checkpoint,
)
from trainer_core.errors import CheckpointError
from trainer_core.optim import rebase_learning_rates
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

KEY_DATAMODULE = "datamodule"
KEY_RNG_PER_RANK = "rng_states_per_rank"
# Inside ``loops``: what each rank holds for itself, and (rank 0's) at the top for another world size.
KEY_LOOP_PER_RANK = "per_rank"
KEY_LOOP_DATALOADER = "dataloader"
KEY_LOOP_GRADS = "accumulated_grads"


# ---------------------------------------------------------------------- RNG
def collect_rng_states() -> dict[str, Any]:
    """Every generator a training step may draw from, as plain tensors and tuples."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _numpy_state() -> tuple[Any, ...]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # A tensor and plain numbers load under weights_only without any numpy global.
    return (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def apply_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ---------------------------------------------------------------------- dump
def _plain_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters that load without unpickling code; others are dropped with a warning."""
    kept: dict[str, Any] = {}
    dropped = []
    for key, value in hparams.items():
        if _is_plain(value):
            kept[key] = value
        else:
            dropped.append(key)
    if dropped:
        rank_zero_warn(
            f"hyper-parameters {dropped} are not plain values (numbers, strings, tensors, lists, dicts) and are not "
            "saved in the checkpoint; pass them to load_from_checkpoint, or exclude them with "
            "save_hyperparameters(ignore=[...])."
        )
    return kept


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in value.items())
    return False


def loop_state(trainer: Trainer) -> dict[str, Any]:
    """Where the fit loop stands: enough to continue on the very next batch."""
    epoch = trainer._loop_epoch
    state: dict[str, Any] = {
        "epoch": trainer.current_epoch if epoch is None else epoch,
        "batches_done_in_epoch": trainer._batches_done_in_epoch,
        "epoch_finished": trainer._epoch_finished,
        "total_batch_idx": trainer.total_batch_idx,
        "batches_that_stepped": trainer._batches_that_stepped,
        # The number of data-parallel replicas: what splits an epoch's batches (pipeline ranks do not).
        "world_size": _data_replicas(trainer),
        # With ``world_size``, how many samples of the epoch are done (to resume at another world size).
        "batch_size": _loader_batch_size(trainer.train_dataloader),
        # Whether the last batch's validation (if it was due) already ran before this save.
        "validated_last_batch": trainer._validated_batch,
    }
    if trainer._epoch_start_rng is not None and not trainer._epoch_finished:
        state["epoch_start_rng"] = trainer._epoch_start_rng
    if trainer._epoch_finished and not trainer._plateau_stepped:
        # Saved in an epoch-end hook, before the epoch's ReduceLROnPlateau step: keep the metric it
        # will read, so the resumed run takes that step exactly as the saved run did next.
        pending = {}
        for config in trainer.lr_scheduler_configs:
            if (
                config.reduce_on_plateau
                and config.interval == "epoch"
                and config.monitor in trainer.callback_metrics
            ):
                pending[config.monitor] = (
                    torch.as_tensor(trainer.callback_metrics[config.monitor]).detach().cpu()
                )
        if pending:
            state["pending_plateau_metrics"] = pending
    loader = trainer.train_dataloader
    seed = getattr(getattr(loader, "sampler", None), "seed", None)
    if isinstance(seed, int):
        # A DistributedSampler shuffles from its own seed (from seed_everything): a resumed process
        # seeded differently must still draw the saved run's order.
        state["sampler_seed"] = seed
    return state


def rank_loop_state(trainer: Trainer) -> dict[str, Any]:
    """The parts of the loop position each rank holds for itself: its loader's state, its gradients."""
    state: dict[str, Any] = {}
    loader = trainer.train_dataloader
    if loader is not None and callable(getattr(loader, "state_dict", None)):
        state[KEY_LOOP_DATALOADER] = loader.state_dict()
    module = trainer.lightning_module
    mid_cycle = (
        module is not None
        and module.automatic_optimization
        and trainer.accumulate_grad_batches > 1
        and trainer._batches_done_in_epoch % trainer.accumulate_grad_batches != 0
        and not trainer._epoch_finished
    )
    unsaved = (
        trainer.plugin.mid_accumulation_gradients_unsaved if mid_cycle and trainer.world_size > 1 else None
    )
    if unsaved:
        rank_zero_warn(
            f"This checkpoint is written between two optimizer steps (accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}) under {type(trainer.plugin).__name__}: {unsaved}. A run resumed from it "
            "continues without them, so it is not exactly the run that went on. Save at optimizer steps "
            "(ModelCheckpoint(every_n_train_steps=...) does) for an exact resume."
        )
    elif mid_cycle:
        # Saved between two optimizer steps: keep the gradients accumulated so far (each rank's own
        # under data parallelism, where they are synchronised only at the step; a shard under FSDP).
        state[KEY_LOOP_GRADS] = {
            name: _local_tensor(p.grad).detach().clone()
            for name, p in module.named_parameters()
            if p.grad is not None
        }
    return state


def _local_tensor(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def dump_checkpoint(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dict of DESIGN.md, on every rank (sharded parts filled in by the plugin)."""
    module = trainer.lightning_module
    plugin = trainer.plugin
    assert module is not None
    checkpoint: dict[str, Any] = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_VERSION: __version__,
        KEY_EPOCH: trainer.current_epoch,
        KEY_GLOBAL_STEP: trainer.global_step,
        KEY_STATE_DICT: plugin.lightning_module_state_dict(),
        KEY_PLUGIN: {"name": plugin.name, "world_size": plugin.world_size},
    }
    if module.hparams:
        checkpoint[KEY_HPARAMS] = _plain_hparams(dict(module.hparams))
    if not weights_only:
        checkpoint[KEY_OPTIMIZER_STATES] = [plugin.named_optimizer_state(opt) for opt in plugin.optimizers]
        checkpoint[KEY_LR_SCHEDULERS] = [
            config.scheduler.state_dict() for config in plugin.lr_scheduler_configs
        ]
        checkpoint[KEY_LOOPS] = loops = loop_state(trainer)
        checkpoint[KEY_CALLBACKS] = {}
        for cb in trainer.callbacks:
            state = cb.state_dict()
            if state:
                checkpoint[KEY_CALLBACKS][cb.state_key] = state
        # Every rank's generators: ranks draw different dropout masks, and an exact resume at the
        # same world size gives each rank back its own stream.
        rng = trainer._paused_rng if trainer._paused_rng is not None else collect_rng_states()
        per_rank = plugin.all_gather_object((rng, rank_loop_state(trainer)))
        rngs = [entry[0] for entry in per_rank]
        owns = [entry[1] for entry in per_rank]
        # Rank 0's at the top: what a run at another world size takes.
        loops.update(owns[0])
        if len(owns) > 1 and any(owns):
            loops[KEY_LOOP_PER_RANK] = owns
        checkpoint[KEY_RNG] = rngs[0]
        if len(rngs) > 1:
            checkpoint[KEY_RNG_PER_RANK] = rngs
        checkpoint[KEY_PRECISION] = plugin.precision.state_dict()
        if trainer.datamodule is not None:
            dm_state = trainer.datamodule.state_dict()
            if dm_state:
                checkpoint[KEY_DATAMODULE] = dm_state
        trainer._current_fx = "on_save_checkpoint"
        for cb in trainer.callbacks:
            cb.on_save_checkpoint(trainer, module, checkpoint)
    trainer._call_module_hook("on_save_checkpoint", checkpoint)
    return checkpoint


# ---------------------------------------------------------------------- restore
def resolve_ckpt_path(trainer: Trainer, ckpt_path: Union[str, os.PathLike]) -> Optional[str]:
    """A path as given; ``"best"``: the best checkpoint of this run; ``"last"``: the newest complete one."""
    path = os.fspath(ckpt_path)
    if path == "best":
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", "") if callback is not None else ""
        if not best:
            raise CheckpointError(
                'ckpt_path="best" needs a ModelCheckpoint that has saved a checkpoint in this run; pass a path instead.'
            )
        return best
    if path != "last":
        return path
    io = trainer.plugin.checkpoint_io
    candidates = []
    for cb in trainer.checkpoint_callbacks:
        if cb.dirpath is None:
            cb.setup(trainer, trainer.lightning_module, "fit")
        for folder in cb.resume_search_dirs():
            found = io.latest_complete(folder)
            if found is not None:
                candidates.append(found)
    if not candidates:
        rank_zero_warn(
            'fit(ckpt_path="last") found no complete checkpoint; training starts from the beginning.'
        )
        return None
    if len(candidates) == 1:
        return candidates[0]
    return max(candidates, key=io.saved_at)


def restore_checkpoint(
    trainer: Trainer, ckpt_path: Union[str, os.PathLike], weights_only: bool = False
) -> None:
    """Load ``ckpt_path`` into the run: all checks first, then every change at once."""
    path = resolve_ckpt_path(trainer, ckpt_path)
    if path is None:
        return
    module = trainer.lightning_module
    plugin = trainer.plugin
    assert module is not None
    checkpoint = plugin.load_checkpoint(path)
    validate_checkpoint(checkpoint, path, for_resume=not weights_only)
    check_state_dict_matches(module.state_dict(), checkpoint[KEY_STATE_DICT], path)

    optimizer_states: list[dict[str, Any]] = []
    if not weights_only:
        # Schedulers first: states that disagree are the root cause of ambiguous optimizer groups.
        scheduler_states = _scheduler_states_for(
            checkpoint[KEY_LR_SCHEDULERS], len(plugin.lr_scheduler_configs), path
        )
        optimizer_states = _optimizer_states_for(trainer, checkpoint[KEY_OPTIMIZER_STATES], path)

    # Nothing has changed yet; from here on the checkpoint is known to fit.
    trainer._current_fx = "on_load_checkpoint"
    if not weights_only:
        for cb in trainer.callbacks:
            cb.on_load_checkpoint(trainer, module, checkpoint)
    trainer._call_module_hook("on_load_checkpoint", checkpoint)
    plugin.load_model_state_dict(checkpoint[KEY_STATE_DICT])
    trainer.ckpt_path = path
    if weights_only:
        return
    for opt, state in zip(plugin.optimizers, optimizer_states):
        plugin.load_optimizer_state_dict(opt, state)
    regrouped = len(checkpoint[KEY_LR_SCHEDULERS]) != len(plugin.lr_scheduler_configs)
    for config, state in zip(plugin.lr_scheduler_configs, scheduler_states):
        config.scheduler.load_state_dict(state)
        if regrouped:
            rebase_learning_rates(config.scheduler)
    _take_pending_plateau_steps(trainer, checkpoint[KEY_LOOPS])
    plugin.precision.load_state_dict(checkpoint.get(KEY_PRECISION, {}))
    callback_states = checkpoint.get(KEY_CALLBACKS, {})
    for cb in trainer.callbacks:
        if cb.state_key in callback_states:
            cb.load_state_dict(callback_states[cb.state_key])
    if trainer.datamodule is not None and KEY_DATAMODULE in checkpoint:
        trainer.datamodule.load_state_dict(checkpoint[KEY_DATAMODULE])
    _restore_loops(trainer, checkpoint)


def _optimizer_states_for(trainer: Trainer, saved: list[dict[str, Any]], path: str) -> list[Any]:
    """What each of this run's optimizers loads, checked; nothing is changed here.

    With as many optimizers as were saved, each takes its own state. With more or fewer (the model
    was split into more or fewer parts, each with its own optimizer), the name-keyed states are
    pooled and every optimizer takes, by name, the parameters it holds.
    """
    plugin = trainer.plugin
    optimizers = plugin.optimizers
    if len(saved) == len(optimizers):
        return [plugin.prepare_optimizer_state(opt, state, path) for state, opt in zip(saved, optimizers)]
    if not saved:
        raise CheckpointError(f"{path} holds no optimizer state; resume from a full checkpoint.")
    pooled = merge_named_states(saved)
    names = {param: name for name, param in trainer.lightning_module.named_parameters()}  # type: ignore[union-attr]
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


def _take_pending_plateau_steps(trainer: Trainer, loops: dict[str, Any]) -> None:
    """The ReduceLROnPlateau steps the saved run took right after writing the checkpoint."""
    pending = loops.get("pending_plateau_metrics")
    if not pending:
        return
    for config in trainer.lr_scheduler_configs:
        due = (loops["epoch"] + 1) % config.frequency == 0
        if config.reduce_on_plateau and config.interval == "epoch" and due and config.monitor in pending:
            trainer._call_module_hook("lr_scheduler_step", config.scheduler, pending[config.monitor])


def _restore_loops(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    loops = checkpoint[KEY_LOOPS]
    trainer.global_step = checkpoint[KEY_GLOBAL_STEP]
    trainer.total_batch_idx = loops["total_batch_idx"]
    trainer._batches_that_stepped = loops["batches_that_stepped"]
    if loops["epoch_finished"]:
        trainer.current_epoch = loops["epoch"] + 1
        trainer._resume_batch_idx = 0
        trainer._resume_epoch_rng = None
    else:
        trainer.current_epoch = loops["epoch"]
        done = loops["batches_done_in_epoch"]
        replicas = _data_replicas(trainer)
        saved_world = loops.get("world_size", replicas)
        if saved_world != replicas:
            # Another world size splits the data differently: continue after the samples already
            # seen (exact only at the world size the checkpoint was written at). Without the batch
            # sizes, assume each rank's batch kept its size.
            done = round(done * saved_world / replicas)
            saved_batch = loops.get("batch_size")
            if saved_batch:
                trainer._resume_samples_done = loops["batches_done_in_epoch"] * saved_world * saved_batch
        trainer._resume_batch_idx = done
        trainer._resume_epoch_rng = loops.get("epoch_start_rng")
    trainer._loop_epoch = trainer.current_epoch
    trainer._epoch_finished = False
    trainer._batches_done_in_epoch = trainer._resume_batch_idx
    trainer._epoch_start_rng = trainer._resume_epoch_rng
    trainer._paused_rng = _rng_for_this_rank(trainer, checkpoint)
    own = loops
    per_rank = loops.get(KEY_LOOP_PER_RANK)
    if per_rank is not None and len(per_rank) == trainer.world_size:
        own = per_rank[trainer.global_rank]
    trainer._resume_dataloader_state = own.get(KEY_LOOP_DATALOADER)
    trainer._resume_grads = own.get(KEY_LOOP_GRADS)
    trainer._validated_batch = loops.get("validated_last_batch", False)
    trainer._resume_sampler_seed = loops.get("sampler_seed")
    trainer._restored_mid_run = trainer._resume_batch_idx > 0


def _loader_batch_size(loader: Any) -> Optional[int]:
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


def resume_batch_at_another_world_size(trainer: Trainer, loader: Any) -> None:
    """Once the loader exists: the first batch after the samples the saved run had already seen."""
    samples = trainer._resume_samples_done
    trainer._resume_samples_done = None
    batch = _loader_batch_size(loader)
    if samples is not None and batch:
        trainer._resume_batch_idx = samples // (_data_replicas(trainer) * batch)


def _data_replicas(trainer: Trainer) -> int:
    """Processes that each draw their own part of the data (all of them, but for pipeline parallelism)."""
    kwargs = trainer.plugin.distributed_sampler_kwargs
    return kwargs["num_replicas"] if kwargs else trainer.world_size


def _rng_for_this_rank(trainer: Trainer, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """This rank's own saved generators at the same world size; rank 0's at another one."""
    per_rank = checkpoint.get(KEY_RNG_PER_RANK)
    if per_rank is not None and len(per_rank) == trainer.world_size:
        return per_rank[trainer.global_rank]
    return checkpoint[KEY_RNG]


def load_module_from_checkpoint(
    cls: type[LightningModule],
    checkpoint_path: Union[str, os.PathLike],
    map_location: Any = None,
    strict: Optional[bool] = None,
    **overrides: Any,
) -> LightningModule:
    """``cls`` built from the checkpoint's hyper-parameters (``overrides`` win), with its weights loaded."""
    from trainer_core.plugins.io import TorchCheckpointIO

    path = os.fspath(checkpoint_path)
    checkpoint = TorchCheckpointIO().load_checkpoint(path, map_location=map_location)
    validate_checkpoint(checkpoint, path)
    hparams = {**checkpoint.get(KEY_HPARAMS, {}), **overrides}
    try:
        model = cls(**hparams)
    except TypeError as err:
        raise CheckpointError(
            f"{cls.__name__}(**hyper_parameters of {path}) failed: {err}. Pass the missing or changed arguments to "
            f"load_from_checkpoint as keywords."
        ) from err
    model.on_load_checkpoint(checkpoint)
    strict = True if strict is None else strict
    check_state_dict_matches(model.state_dict(), checkpoint[KEY_STATE_DICT], path, strict=strict)
    model.load_state_dict(checkpoint[KEY_STATE_DICT], strict=strict)
    return model
