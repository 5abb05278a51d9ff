"""Where the run stands: the one owner of the loop state that checkpoints save and restore.

The fit loop moves these counters; the checkpoint code reads ``state_dict()`` and hands a saved
one back to ``load_state_dict()``; the Trainer's ``current_epoch``, ``global_step`` and the
like read them. Nothing else keeps a copy, so a save at any moment describes exactly the
position the loop is at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from trainer_core.checkpoint.format import (
    LOOP_BATCH_SIZE,
    LOOP_BATCHES_DONE,
    LOOP_BATCHES_THAT_STEPPED,
    LOOP_EPOCH,
    LOOP_EPOCH_FINISHED,
    LOOP_EPOCH_START_RNG,
    LOOP_SAMPLER_SEED,
    LOOP_TOTAL_BATCH_IDX,
    LOOP_TRAIN_LOADER_EPOCH,
    LOOP_VAL_LOADER_EPOCH,
    LOOP_VALIDATED_LAST_BATCH,
    LOOP_WORLD_SIZE,
)


@dataclass
class ResumePlan:
    """What a restore leaves for the first epoch after it; each part is consumed once."""

    # The first batch of the epoch to train (0: the epoch starts from its beginning).
    batch_idx: int = 0
    # Generators at the start of the saved epoch: recreate its sampler order before skipping batches.
    epoch_rng: Optional[dict[str, Any]] = None
    # This rank's stateful-loader state and unfinished accumulation's gradients.
    dataloader_state: Any = None
    grads: Optional[dict[str, Any]] = None
    # A DistributedSampler's own seed in the saved run.
    sampler_seed: Optional[int] = None
    # Samples of the epoch a checkpoint from another world size had seen (becomes a batch index
    # once the loader's batch size is known).
    samples_done: Optional[int] = None
    # Whether the restore put the run in the middle of an epoch (no sanity check then).
    mid_run: bool = False


class Progress:
    """Counters and positions of the fit loop, with their checkpoint form."""

    __slots__ = (
        "batch_idx",
        "batches_done_in_epoch",
        "batches_that_stepped",
        "current_epoch",
        "epoch_finished",
        "epoch_start_rng",
        "global_step",
        "is_last_batch",
        "loop_epoch",
        "paused_rng",
        "plateau_stepped",
        "resume",
        "total_batch_idx",
        "train_loader_epoch",
        "val_loader_epoch",
        "validated_batch",
    )

    def __init__(self) -> None:
        # Epochs finished (inside an epoch: those before it), optimizer steps taken, the batch
        # being processed and all training batches so far.
        self.current_epoch = 0
        self.global_step = 0
        self.batch_idx = 0
        self.total_batch_idx = 0
        # Training batches that ended in an optimizer step: the step loggers record metrics at.
        self.batches_that_stepped = 0
        self.batches_done_in_epoch = 0
        self.is_last_batch = False
        # The epoch the position (batches done, finished) counts in; None before the first epoch.
        self.loop_epoch: Optional[int] = None
        # Whether that epoch ran to its end (an epoch cut short by max_steps or a stop stays unfinished).
        self.epoch_finished = False
        # Whether the last batch's validation (if due) has run: a save from a validation hook must
        # not repeat it on resume.
        self.validated_batch = False
        # Whether this epoch's ReduceLROnPlateau step has run (a save at epoch end may precede it).
        self.plateau_stepped = False
        self.epoch_start_rng: Optional[dict[str, Any]] = None
        # The generators of the position while no batch is running: set by a restore or when the
        # fit loop stops, written by checkpoints meanwhile, put back when the next epoch starts.
        self.paused_rng: Optional[dict[str, Any]] = None
        self.resume = ResumePlan()
        # Under reload_dataloaders_every_n_epochs only: the epoch the train and val loaders in use
        # were made in (None: not yet; for validation, none made in a validating epoch yet).
        self.train_loader_epoch: Optional[int] = None
        self.val_loader_epoch: Optional[int] = None

    def start_fit(self) -> None:
        """A new ``fit`` call: no epoch position yet (the counters carry on, as in Lightning)."""
        self.paused_rng = None
        self.loop_epoch = None
        self.train_loader_epoch = None
        self.val_loader_epoch = None

    def state_dict(self) -> dict[str, Any]:
        """The loop position in the checkpoint's ``loops`` entry: enough to continue on the very next batch."""
        state: dict[str, Any] = {
            LOOP_EPOCH: self.current_epoch if self.loop_epoch is None else self.loop_epoch,
            LOOP_BATCHES_DONE: self.batches_done_in_epoch,
            LOOP_EPOCH_FINISHED: self.epoch_finished,
            LOOP_TOTAL_BATCH_IDX: self.total_batch_idx,
            LOOP_BATCHES_THAT_STEPPED: self.batches_that_stepped,
            LOOP_VALIDATED_LAST_BATCH: self.validated_batch,
        }
        if self.epoch_start_rng is not None and not self.epoch_finished:
            state[LOOP_EPOCH_START_RNG] = self.epoch_start_rng
        if self.train_loader_epoch is not None:
            state[LOOP_TRAIN_LOADER_EPOCH] = self.train_loader_epoch
        if self.val_loader_epoch is not None:
            state[LOOP_VAL_LOADER_EPOCH] = self.val_loader_epoch
        return state

    def load_state_dict(
        self, state: dict[str, Any], global_step: int, rng: dict[str, Any], replicas: int
    ) -> None:
        """Continue from a saved position: the next epoch if the saved one finished, else its next batch.

        ``rng`` is this rank's saved generators, put back when the epoch (re)starts; ``replicas``
        the data-parallel processes of this run. Saved at another number of replicas, the run
        continues after the samples already seen (exact only at the saved number). The checkpoint
        code adds this rank's own parts (loader state, gradients) to ``resume`` afterwards.
        """
        self.global_step = global_step
        self.total_batch_idx = state[LOOP_TOTAL_BATCH_IDX]
        self.batches_that_stepped = state[LOOP_BATCHES_THAT_STEPPED]
        resume = ResumePlan(sampler_seed=state.get(LOOP_SAMPLER_SEED))
        if state[LOOP_EPOCH_FINISHED]:
            self.current_epoch = state[LOOP_EPOCH] + 1
        else:
            self.current_epoch = state[LOOP_EPOCH]
            done = state[LOOP_BATCHES_DONE]
            saved_replicas = state.get(LOOP_WORLD_SIZE, replicas)
            if saved_replicas != replicas:
                # Without the batch sizes, assume each rank's batch kept its size.
                done = round(done * saved_replicas / replicas)
                saved_batch = state.get(LOOP_BATCH_SIZE)
                if saved_batch:
                    resume.samples_done = state[LOOP_BATCHES_DONE] * saved_replicas * saved_batch
            resume.batch_idx = done
            resume.epoch_rng = state.get(LOOP_EPOCH_START_RNG)
        resume.mid_run = resume.batch_idx > 0
        self.resume = resume
        self.loop_epoch = self.current_epoch
        self.epoch_finished = False
        self.batches_done_in_epoch = resume.batch_idx
        self.epoch_start_rng = resume.epoch_rng
        self.paused_rng = rng
        self.validated_batch = state.get(LOOP_VALIDATED_LAST_BATCH, False)
        self.train_loader_epoch = state.get(LOOP_TRAIN_LOADER_EPOCH)
        self.val_loader_epoch = state.get(LOOP_VAL_LOADER_EPOCH)
