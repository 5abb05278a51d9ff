"""Building the checkpoint dict of a run, on every rank.

``dump_checkpoint`` assembles the dict of the checkpoint contract (docs/architecture.md) from the
run's stateful parts (:class:`~trainer_core.run_state.CheckpointParts`, which the Trainer hands over:
this module never sees the Trainer); the plugin fills the parts it owns (model state, optimizer state
under the consolidation rule) and writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from trainer_core.__about__ import __version__
from trainer_core.checkpoint.format import (
    FORMAT_VERSION,
    KEY_CALLBACKS,
    KEY_DATAMODULE,
    KEY_DATAMODULE_HPARAMS,
    KEY_DATAMODULE_HPARAMS_NAME,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_FROZEN_PARAMETERS,
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
    KEY_VERSION,
    LOOP_BATCH_SIZE,
    LOOP_DATALOADER,
    LOOP_GRADS,
    LOOP_PENDING_PLATEAU,
    LOOP_PER_RANK,
    LOOP_SAMPLER_SEED,
    LOOP_WORLD_SIZE,
    PLUGIN_LAYOUT,
    PLUGIN_NAME,
    PLUGIN_PRECISION,
    PLUGIN_WORLD_SIZE,
)
from trainer_core.checkpoint.rng import collect_rng_states
from trainer_core.utilities import rank_zero_warn
from trainer_core.utilities.compiled_names import plain_name

if TYPE_CHECKING:
    from trainer_core.run_state import CheckpointParts, CheckpointPlugin


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


def data_replicas(plugin: CheckpointPlugin) -> int:
    """Processes that each draw their own part of the data (all of them, but for pipeline parallelism)."""
    kwargs = plugin.distributed_sampler_kwargs
    return kwargs["num_replicas"] if kwargs else plugin.world_size


def loader_batch_size(loader: Any) -> Optional[int]:
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


def loop_state(parts: CheckpointParts) -> dict[str, Any]:
    """Where the fit loop stands (``parts.progress``), with what the data and schedulers add to it."""
    progress = parts.progress
    state = progress.state_dict()
    state[LOOP_WORLD_SIZE] = data_replicas(parts.plugin)
    state[LOOP_BATCH_SIZE] = loader_batch_size(parts.train_dataloader)
    if progress.epoch_finished and not progress.plateau_stepped:
        # Saved in an epoch-end hook, before the epoch's ReduceLROnPlateau step: keep the metric it
        # will read, so the resumed run takes that step exactly as the saved run did next.
        pending = {}
        for config in parts.plugin.lr_scheduler_configs:
            if (
                config.reduce_on_plateau
                and config.interval == "epoch"
                and config.monitor in parts.callback_metrics()
            ):
                pending[config.monitor] = (
                    torch.as_tensor(parts.callback_metrics()[config.monitor]).detach().cpu()
                )
        if pending:
            state[LOOP_PENDING_PLATEAU] = pending
    seed = getattr(getattr(parts.train_dataloader, "sampler", None), "seed", None)
    if isinstance(seed, int):
        # A DistributedSampler shuffles from its own seed (from seed_everything): a resumed process
        # seeded differently must still draw the saved run's order.
        state[LOOP_SAMPLER_SEED] = seed
    return state


def rank_loop_state(parts: CheckpointParts) -> dict[str, Any]:
    """The parts of the loop position each rank holds for itself: its loader's state, its gradients."""
    state: dict[str, Any] = {}
    loader = parts.train_dataloader
    if loader is not None and callable(getattr(loader, "state_dict", None)):
        state[LOOP_DATALOADER] = loader.state_dict()
    module = parts.module
    progress = parts.progress
    accumulate = parts.accumulate_grad_batches
    plugin = parts.plugin
    mid_cycle = (
        module is not None
        and module.automatic_optimization
        and accumulate > 1
        and progress.batches_done_in_epoch % accumulate != 0
        and not progress.epoch_finished
    )
    unsaved = plugin.mid_accumulation_gradients_unsaved if mid_cycle and plugin.world_size > 1 else None
    if unsaved:
        rank_zero_warn(
            f"This checkpoint is written between two optimizer steps (accumulate_grad_batches="
            f"{accumulate}) under {type(plugin).__name__}: {unsaved}. A run resumed from it "
            "continues without them, so it is not exactly the run that went on. Save at optimizer steps "
            "(ModelCheckpoint(every_n_train_steps=...) does) for an exact resume."
        )
    elif mid_cycle:
        # Saved between two optimizer steps: keep the gradients accumulated so far (each rank's own
        # under data parallelism, where they are synchronised only at the step; a shard under FSDP).
        state[LOOP_GRADS] = plugin.accumulated_gradients(module)
    return state


def frozen_parameter_names(module: torch.nn.Module, state_dict: dict[str, Any]) -> list[str]:
    """The ``state_dict`` names of parameters that do not train, so a checkpoint IO can store them once.

    Tied parameters are listed under every name the state dict gives them. Only a hint for the IO:
    it stores what it replaces by content hash, so a name listed wrongly costs space, never exactness.
    """
    frozen = {
        plain_name(name) for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad
    }
    return [name for name in state_dict if name in frozen] if frozen else []


def _overrides(obj: Any, hook: str) -> bool:
    """Whether ``obj``'s class, or a class between it and the base that declares ``hook``, defines ``hook``."""
    return sum(hook in vars(cls) for cls in type(obj).__mro__) > 1


def hooks_read_checkpoint(parts: CheckpointParts, weights_only: bool) -> bool:
    """Whether a user hook will see the checkpoint dict: the module's or a callback's ``on_save_checkpoint``."""
    if _overrides(parts.module, "on_save_checkpoint"):
        return True
    return not weights_only and any(_overrides(cb, "on_save_checkpoint") for cb in parts.callbacks)


def dump_checkpoint(parts: CheckpointParts, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dict of the run ``parts`` describe, on every rank (sharded parts filled in by the plugin).

    Keys in the contract's order; the module's ``on_save_checkpoint`` runs last (after the callbacks'
    unless ``weights_only``) and may edit the dict. When no such hook is overridden, a plugin that
    can gathers its full state while the file is written (``start_streamed_save``, FSDP's full
    checkpoint): the dict then holds placeholders for those tensors, filled only by the plugin's
    ``save_checkpoint``; every hook that reads the dict gets the real tensors.
    """
    module = parts.module
    plugin = parts.plugin
    progress = parts.progress
    assert module is not None
    start_streamed_save = getattr(plugin, "start_streamed_save", None)
    if start_streamed_save is not None and not hooks_read_checkpoint(parts, weights_only):
        start_streamed_save()
    checkpoint: dict[str, Any] = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_VERSION: __version__,
        KEY_EPOCH: progress.current_epoch,
        KEY_GLOBAL_STEP: progress.global_step,
        KEY_STATE_DICT: plugin.lightning_module_state_dict(),
        KEY_PLUGIN: {
            PLUGIN_NAME: plugin.name,
            PLUGIN_WORLD_SIZE: plugin.world_size,
            PLUGIN_LAYOUT: plugin.layout(),
            PLUGIN_PRECISION: plugin.precision.name,
        },
    }
    frozen = frozen_parameter_names(module, checkpoint[KEY_STATE_DICT])
    if frozen:
        checkpoint[KEY_FROZEN_PARAMETERS] = frozen
    if module.hparams:
        checkpoint[KEY_HPARAMS] = _plain_hparams(dict(module.hparams))
        if getattr(module, "_hparams_name", None):
            checkpoint[KEY_HPARAMS_NAME] = module._hparams_name
    datamodule = parts.datamodule
    if datamodule is not None and datamodule.hparams:
        # Lightning's key and layout: `MyData.load_from_checkpoint(path)` rebuilds the data module.
        checkpoint[KEY_DATAMODULE_HPARAMS] = _plain_hparams(dict(datamodule.hparams))
        if getattr(datamodule, "_hparams_name", None):
            checkpoint[KEY_DATAMODULE_HPARAMS_NAME] = datamodule._hparams_name
    if not weights_only:
        checkpoint[KEY_OPTIMIZER_STATES] = [plugin.named_optimizer_state(opt) for opt in plugin.optimizers]
        checkpoint[KEY_LR_SCHEDULERS] = [
            config.scheduler.state_dict() for config in plugin.lr_scheduler_configs
        ]
        checkpoint[KEY_LOOPS] = loops = loop_state(parts)
        checkpoint[KEY_CALLBACKS] = {}
        for cb in parts.callbacks:
            state = cb.state_dict()
            if state:
                checkpoint[KEY_CALLBACKS][cb.state_key] = state
        # Every rank's generators: ranks draw different dropout masks, and an exact resume at the
        # same world size gives each rank back its own stream.
        paused = progress.paused_rng
        rng = paused if paused is not None else collect_rng_states()
        per_rank = plugin.all_gather_object((rng, rank_loop_state(parts)))
        rngs = [entry[0] for entry in per_rank]
        owns = [entry[1] for entry in per_rank]
        # Rank 0's at the top: what a run at another world size takes.
        loops.update(owns[0])
        if len(owns) > 1 and any(owns):
            loops[LOOP_PER_RANK] = owns
        checkpoint[KEY_RNG] = rngs[0]
        if len(rngs) > 1:
            checkpoint[KEY_RNG_PER_RANK] = rngs
        checkpoint[KEY_PRECISION] = plugin.precision.state_dict()
        # On every rank (it may gather each rank's part); rank 0's is what the file keeps.
        plugin_state = plugin.plugin_state_dict()
        if plugin_state:
            checkpoint[KEY_PLUGIN_STATE] = plugin_state
        if datamodule is not None:
            dm_state = datamodule.state_dict()
            if dm_state:
                checkpoint[KEY_DATAMODULE] = dm_state
        # Lightning's signature: each callback's hook receives the Trainer, which the hook runner holds.
        parts.hooks.call_callbacks_on_checkpoint("on_save_checkpoint", checkpoint)
    parts.hooks.call_module("on_save_checkpoint", checkpoint)
    return checkpoint
