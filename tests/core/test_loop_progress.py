"""``Progress`` (``trainer_core/loops/progress.py``) without a Trainer: the loop position and its checkpoint form.

What a resume relies on: ``state_dict`` says exactly where the loop stands, and ``load_state_dict``
continues from it (the next epoch after a finished one, the next batch inside an unfinished one,
rescaled when the number of data-parallel replicas changed). End-to-end resumes are
``tests/checkpoint/``. (``tests/callbacks/test_progress.py`` is the progress bar.)
"""

from __future__ import annotations

from typing import Any

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
from trainer_core.loops.progress import Progress, ResumePlan

RNG = {"torch": "generator state"}


def _mid_epoch() -> Progress:
    """Epoch 2, five batches done (three stepped so far in the run), the epoch's start generators kept."""
    progress = Progress()
    progress.current_epoch = progress.loop_epoch = 2
    progress.batches_done_in_epoch = 5
    progress.total_batch_idx = 25
    progress.batches_that_stepped = 12
    progress.epoch_start_rng = RNG
    return progress


def _saved(**changes: Any) -> dict[str, Any]:
    state = _mid_epoch().state_dict()
    state.update(changes)
    return state


def test_a_fresh_loop_saves_the_start_of_epoch_zero() -> None:
    assert Progress().state_dict() == {
        LOOP_EPOCH: 0,
        LOOP_BATCHES_DONE: 0,
        LOOP_EPOCH_FINISHED: False,
        LOOP_TOTAL_BATCH_IDX: 0,
        LOOP_BATCHES_THAT_STEPPED: 0,
        LOOP_VALIDATED_LAST_BATCH: False,
    }


def test_mid_epoch_the_state_holds_the_position_and_the_epochs_generators() -> None:
    state = _mid_epoch().state_dict()
    assert state[LOOP_EPOCH] == 2 and state[LOOP_BATCHES_DONE] == 5 and not state[LOOP_EPOCH_FINISHED]
    assert (state[LOOP_TOTAL_BATCH_IDX], state[LOOP_BATCHES_THAT_STEPPED]) == (25, 12)
    assert state[LOOP_EPOCH_START_RNG] == RNG


def test_a_finished_epoch_drops_its_start_generators() -> None:
    progress = _mid_epoch()
    progress.epoch_finished = True
    assert LOOP_EPOCH_START_RNG not in progress.state_dict()


def test_the_position_counts_in_the_loops_epoch_not_the_epoch_counter() -> None:
    progress = _mid_epoch()
    progress.current_epoch = 3  # an epoch end moved the counter; the position still belongs to epoch 2
    assert progress.state_dict()[LOOP_EPOCH] == 2


def test_loader_epochs_are_saved_only_once_known() -> None:
    progress = _mid_epoch()
    assert LOOP_TRAIN_LOADER_EPOCH not in progress.state_dict()
    progress.train_loader_epoch, progress.val_loader_epoch = 2, 1
    state = progress.state_dict()
    assert (state[LOOP_TRAIN_LOADER_EPOCH], state[LOOP_VAL_LOADER_EPOCH]) == (2, 1)


def test_resume_inside_an_unfinished_epoch_continues_at_its_next_batch() -> None:
    progress = Progress()
    progress.load_state_dict(_saved(), global_step=12, rng={"now": 1}, replicas=1)
    assert (progress.current_epoch, progress.global_step) == (2, 12)
    assert (progress.total_batch_idx, progress.batches_that_stepped) == (25, 12)
    assert progress.resume == ResumePlan(batch_idx=5, epoch_rng=RNG, mid_run=True)
    assert (progress.loop_epoch, progress.batches_done_in_epoch, progress.epoch_finished) == (2, 5, False)
    assert progress.epoch_start_rng == RNG and progress.paused_rng == {"now": 1}


def test_resume_after_a_finished_epoch_starts_the_next_one() -> None:
    progress = Progress()
    progress.load_state_dict(_saved(**{LOOP_EPOCH_FINISHED: True}), global_step=12, rng={}, replicas=1)
    assert progress.current_epoch == 3 and progress.loop_epoch == 3
    assert progress.resume == ResumePlan(batch_idx=0, mid_run=False)
    assert progress.batches_done_in_epoch == 0 and progress.epoch_start_rng is None


def test_resume_at_another_number_of_replicas_rescales_the_batches_done() -> None:
    """Saved at 2 replicas after 5 batches of 4 samples each: 40 samples seen, 10 batches at one replica."""
    saved = _saved(**{LOOP_WORLD_SIZE: 2, LOOP_BATCH_SIZE: 4})
    progress = Progress()
    progress.load_state_dict(saved, global_step=12, rng={}, replicas=1)
    assert progress.resume.batch_idx == 10 and progress.resume.samples_done == 40
    # At the saved number the position is exact, and no sample count is needed.
    same = Progress()
    same.load_state_dict(saved, global_step=12, rng={}, replicas=2)
    assert same.resume.batch_idx == 5 and same.resume.samples_done is None


def test_resume_keeps_the_samplers_seed_and_the_loader_epochs() -> None:
    saved = _saved(
        **{
            LOOP_SAMPLER_SEED: 1234,
            LOOP_TRAIN_LOADER_EPOCH: 2,
            LOOP_VAL_LOADER_EPOCH: 1,
            LOOP_VALIDATED_LAST_BATCH: True,
        }
    )
    progress = Progress()
    progress.load_state_dict(saved, global_step=12, rng={}, replicas=1)
    assert progress.resume.sampler_seed == 1234
    assert (progress.train_loader_epoch, progress.val_loader_epoch, progress.validated_batch) == (2, 1, True)


def test_a_saved_position_round_trips() -> None:
    saved = _saved()
    progress = Progress()
    progress.load_state_dict(saved, global_step=12, rng={}, replicas=1)
    assert progress.state_dict() == saved


def test_a_new_fit_forgets_the_epoch_position_but_keeps_the_counters() -> None:
    progress = _mid_epoch()
    progress.paused_rng = RNG
    progress.train_loader_epoch = 2
    progress.start_fit()
    assert progress.loop_epoch is None and progress.paused_rng is None and progress.train_loader_epoch is None
    assert (progress.current_epoch, progress.total_batch_idx, progress.batches_that_stepped) == (2, 25, 12)
