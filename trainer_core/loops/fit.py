"""The fit loop: sanity check, epochs of training batches, validation inside fit, and the stop rules.

``FitLoop`` is made by ``trainer.fit`` (``trainer.fit_loop``, as in Lightning) and runs in every
process the plugin starts. The loop position lives in ``trainer.progress``; this module moves it
and reads it, and ``trainer_core.checkpoint`` saves and restores it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer_core.callback_queries import monitoring_callbacks
from trainer_core.checkpoint.restore import (
    PendingRestore,
    restore_module_and_callbacks,
    restore_training_state,
    resume_batch_at_another_world_size,
)
from trainer_core.checkpoint.rng import apply_rng_states, collect_rng_states
from trainer_core.datamodule import LightningDataModule, log_stage_hyperparameters
from trainer_core.errors import MisconfigurationException
from trainer_core.loops.data import (
    batch_mover,
    has_length,
    num_batches,
    resolve_stage_dataloaders,
    resolve_train_dataloader,
    set_sampler_epoch,
    with_last_flag,
)
from trainer_core.loops.evaluation import run_loop
from trainer_core.loops.schedulers import update_lr_schedulers
from trainer_core.loops.training_step import TrainingStep
from trainer_core.module import LightningModule
from trainer_core.profilers.base import profiled, profiled_iter
from trainer_core.utilities import rank_zero_warn
from trainer_core.utilities.combined_loader import CombinedLoader, is_stateful
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from trainer_core.run_state import RunState
    from trainer_core.signals import PreemptionHandler

_EXHAUSTED = object()
# torchdata's StatefulDataLoader: the key of its state that says its pass over the data has ended.
_TORCHDATA_ENDED = "_iterator_finished"


class FitLoop:
    """One ``fit`` call: its data sources, checkpoint to resume, and the loop over epochs."""

    #: Set by a callback in ``on_train_epoch_start`` for one epoch that runs ``training_step`` only,
    #: without backward or optimizer step (``StochasticWeightAveraging``'s BatchNorm statistics pass).
    forward_only: bool = False

    def __init__(self, trainer: RunState, train_source: Any, val_source: Any, ckpt_path: Any) -> None:
        self.trainer = trainer
        self.train_source = train_source
        self.val_source = val_source
        self.ckpt_path = ckpt_path
        # What the training epochs read: the one training loader, or a CombinedLoader of several
        # (``trainer.train_dataloader`` shows their structure, as Lightning's does).
        self.train_loader: Any = None
        # The validation loaders of this fit (empty: no validation; None: not made yet).
        self.val_loaders: Optional[list[Any]] = None
        # The pre-emption signal record while the loop runs in the main thread (trainer_core.signals).
        self.preemption: Optional[PreemptionHandler] = None
        # A checkpoint whose module and callbacks were restored before the optimizers were made; its
        # training state loads when the loop starts.
        self.pending_restore: Optional[PendingRestore] = None
        # Whether the train loader was made for the epoch about to start (reload_dataloaders_every_n_epochs).
        self._fresh_train_loader = False
        # The first epoch's batch iterator, started before ``on_train_start`` as Lightning starts it.
        self._first_epoch_iterator: Optional[Iterator[Any]] = None

    def run(self) -> None:
        t = self.trainer
        module = t.lightning_module
        assert module is not None
        runner = t.hook_runner
        runner.call("on_fit_start")
        log_stage_hyperparameters(t)
        if self.ckpt_path is not None:
            pending, self.pending_restore = self.pending_restore, None
            parts = t.checkpoint_parts()
            if pending is None and t.plugin.restore_checkpoint_after_setup:
                pending = restore_module_and_callbacks(parts, self.ckpt_path, optimizers_ready=True)
            if pending is not None:
                restore_training_state(parts, pending)
        peer = t.plugin.checkpoint_from_peer()
        if peer is not None:
            checkpoint, source = peer
            parts = t.checkpoint_parts()
            pending = restore_module_and_callbacks(
                parts, source, optimizers_ready=True, checkpoint=checkpoint
            )
            assert pending is not None
            restore_training_state(parts, pending)

        sanity = (
            t.num_sanity_val_steps != 0
            and t.limit_val_batches != 0
            and not t.progress.resume.mid_run
            and t.plugin.defines_step("validation_step")
            and self._validation_data_defined()
        )
        # Without a sanity check the validation loaders are made once the training loader is, in the
        # first epoch that validates (Lightning's order and count of dataloader hook calls).
        self.val_loaders = self._sanity_check() if sanity else None
        # Trainer(detect_anomaly=True): around training only (not the sanity check), as in Lightning;
        # the setting the user had comes back afterwards.
        with torch.autograd.set_detect_anomaly(True) if t.detect_anomaly else contextlib.nullcontext():
            self.train()
        runner.call("on_fit_end")

    def train(self) -> None:
        """``on_train_start``, epochs until a stop rule holds, ``on_train_end``: Lightning's ``fit_loop.run()``.

        The part of ``fit`` that the tuner's searches (``trainer_core.tuner``) run again, from
        ``on_fit_start``, with their own callbacks, limits and schedulers.
        """
        t = self.trainer
        progress = t.progress
        every = t.reload_dataloaders_every_n_epochs
        paused = progress.paused_rng
        resumed_at_reload = (
            every
            and paused is not None
            and progress.train_loader_epoch is not None
            and self._reload_due(progress.train_loader_epoch)
        )
        if resumed_at_reload:
            # A resumed run starts an epoch the saved run reloaded at: make the loader from the generators
            # the saved run had there (a sampler may seed itself from them).
            apply_rng_states(paused)
            t.train_dataloader = None
        self.setup_train_dataloader()
        if resumed_at_reload:
            self._first_pass_of_reloaded_loader()
            progress.paused_rng = collect_rng_states()
        if every and self._reload_due(progress.train_loader_epoch):
            # The loader just made is the one the first epoch would have reloaded.
            progress.train_loader_epoch = progress.current_epoch
            self._fresh_train_loader = True
        if progress.paused_rng is None and t.limit_train_batches != 0:
            # A run that does not resume starts its first pass with the loader (a resumed one places
            # its pass when the epoch starts, from the saved generators).
            progress.epoch_start_rng = collect_rng_states()
            self._first_epoch_iterator = _started(self.train_loader)
        if self.val_loaders is None and self._validates_this_epoch():
            self.val_loaders = self._setup_val()
        runner = t.hook_runner
        runner.call("on_train_start")
        train_epoch = self._train_epoch
        if runner.profiler is not None:
            train_epoch = profiled(runner.profiler, "run_training_epoch", train_epoch)
        while not self._done():
            train_epoch()
            progress.current_epoch += 1
            progress.resume.batch_idx = 0
        self._first_epoch_iterator = None  # unread when the run had nothing to train
        # Stopped at an epoch's end: the generators stand where the next epoch would begin.
        self._pause()
        runner.call("on_train_end")

    # ------------------------------------------------------------------ data
    def setup_train_dataloader(self) -> None:
        """The training loader and the batch counts that depend on it (once per fit)."""
        t = self.trainer
        if t.train_dataloader is not None:
            return
        loader, t.train_dataloader = resolve_train_dataloader(t, self.train_source)
        self.train_loader = loader
        resume = t.progress.resume
        seed = resume.sampler_seed
        if seed is not None and isinstance(getattr(getattr(loader, "sampler", None), "seed", None), int):
            loader.sampler.seed = seed
        if resume.samples_done is not None:
            resume_batch_at_another_world_size(t.progress, t.plugin, loader)
        t.num_training_batches = num_batches(loader, t.limit_train_batches, "limit_train_batches")
        if isinstance(t.val_check_interval, int):
            t.val_check_batch = t.val_check_interval
            if (
                not math.isinf(t.num_training_batches)
                and t.val_check_batch > t.num_training_batches
                and t.check_val_every_n_epoch is not None
            ):
                raise MisconfigurationException(
                    f"Trainer(val_check_interval={t.val_check_interval}) is more than the {t.num_training_batches} "
                    "training batches of an epoch; lower it, or set check_val_every_n_epoch=None to count across epochs."
                )
        elif math.isinf(t.num_training_batches):
            t.val_check_batch = float("inf")
        else:
            t.val_check_batch = max(1, int(t.num_training_batches * t.val_check_interval))

    def _first_pass_of_reloaded_loader(self) -> None:
        """A pass started and dropped, as Lightning's of a training loader reloaded after the first epoch.

        Lightning starts one when it makes the loader and another as the epoch begins; the first moves
        the global RNG (a DataLoader draws its workers' seed), so the epoch shuffles as under Lightning
        only if that pass is started here too (and in a run resumed at that epoch).
        """
        iter(self.train_loader)

    def _setup_val(self) -> list[Any]:
        t = self.trainer
        if t.limit_val_batches == 0:
            t.val_dataloaders, t.num_val_batches = [], []
            return []
        loaders, shown = resolve_stage_dataloaders(t, "val", self.val_source)
        loaders = [dl for dl in loaders if dl is not None]
        if loaders and not t.plugin.defines_step("validation_step"):
            rank_zero_warn(
                "Validation data was given but the module has no `validation_step`; validation is skipped."
            )
            loaders = []
        t.val_dataloaders = shown if loaders else []
        t.num_val_batches = [num_batches(dl, t.limit_val_batches, "limit_val_batches") for dl in loaders]
        progress = t.progress
        if (
            t.reload_dataloaders_every_n_epochs
            and self._validates_this_epoch()
            and self._reload_due(progress.val_loader_epoch)
        ):
            # Lightning counts a load only in an epoch that validates (a sanity check's at epoch 0 with
            # check_val_every_n_epoch=2 does not): the first validation then loads again.
            progress.val_loader_epoch = progress.current_epoch
        return loaders

    def _reload_due(self, made_in: Optional[int]) -> bool:
        """Lightning's rule: a loader is made anew once ``reload_dataloaders_every_n_epochs`` epochs have passed.

        ``made_in`` is the epoch the loader in use was made in (``trainer.progress``), saved in
        checkpoints, so that a resumed run reloads at the epochs the saved run would have; Lightning
        counts from the epoch it resumed at instead.
        """
        t = self.trainer
        return made_in is None or t.progress.current_epoch - made_in >= t.reload_dataloaders_every_n_epochs

    def _validation_data_defined(self) -> bool:
        """Whether validation data was given or a hook returns it: Lightning runs no sanity check otherwise."""
        t = self.trainer
        if self.val_source is not None:
            return True
        if t.datamodule is not None:
            return is_overridden("val_dataloader", t.datamodule, LightningDataModule)
        return is_overridden("val_dataloader", t.lightning_module, LightningModule)

    def _sanity_check(self) -> list[Any]:
        """A few validation batches before training, to fail fast; returns the validation loaders."""
        t = self.trainer
        # The check must not change the run: creating a loader's iterator draws from the global RNG.
        rng = collect_rng_states()
        t.sanity_checking = True
        t.hook_runner.call_callbacks("on_sanity_check_start")
        val_loaders = self._setup_val()
        steps = t.num_sanity_val_steps
        limits = [n if steps == -1 else min(n, steps) for n in t.num_val_batches]
        if val_loaders:
            run_loop(t, "validation", val_loaders, limits, log=False)
        t.hook_runner.call_callbacks("on_sanity_check_end")
        t.sanity_checking = False
        apply_rng_states(rng)
        # What the sanity check logged must not reach callbacks or loggers (Lightning's behaviour).
        t.metrics.clear()
        return val_loaders

    # ------------------------------------------------------------------ stop rules
    def _done(self) -> bool:
        t = self.trainer
        progress = t.progress
        if t.max_steps != -1 and progress.global_step >= t.max_steps:
            return True
        if t.max_epochs != -1 and progress.current_epoch >= t.max_epochs:
            return True
        if t.num_training_batches == 0:
            rank_zero_warn("The training dataloader is empty (or limit_train_batches=0): nothing to train.")
            return True
        if t.should_stop:
            if self._can_stop():
                return True
            t.should_stop = False
        return False

    def _can_stop(self) -> bool:
        """``should_stop`` takes effect only once ``min_epochs`` and ``min_steps`` are met.

        ``current_epoch`` counts the epochs finished (inside an epoch, those before it), as Lightning's
        ``epoch_progress.current.processed`` does: the epoch that reaches ``min_epochs`` runs to its end.
        """
        t = self.trainer
        if t.min_epochs is not None and t.progress.current_epoch < t.min_epochs:
            return False
        return not (t.min_steps is not None and t.progress.global_step < t.min_steps)

    def _validation_due(self, batch_idx: int, is_last: bool) -> bool:
        """Whether the validation schedule (``val_check_interval``, ``check_val_every_n_epoch``) falls on this batch."""
        t = self.trainer
        if not self.val_loaders or not self._validates_this_epoch():
            return False
        if math.isinf(t.val_check_batch):
            return is_last
        current = t.progress.total_batch_idx - 1 if t.check_val_every_n_epoch is None else batch_idx
        return (current + 1) % t.val_check_batch == 0

    def _validates_this_epoch(self) -> bool:
        every = self.trainer.check_val_every_n_epoch
        return every is None or (self.trainer.progress.current_epoch + 1) % every == 0

    def _pause(self) -> None:
        """The loop stops training here: keep the generators as they stand for a checkpoint written from now on.

        What runs after the last batch only because the run ends (a validation the schedule did not
        call for, the hooks of an epoch cut short, ``on_train_end``) must not leak into the position a
        resumed run continues from; the run that never stopped went straight on to the next batch.
        """
        progress = self.trainer.progress
        if progress.paused_rng is None:
            progress.paused_rng = collect_rng_states()

    # ------------------------------------------------------------------ one epoch
    def _train_epoch(self) -> None:
        """One training epoch: batches, validation checks, then the epoch-end hooks."""
        t = self.trainer
        module = t.lightning_module
        assert module is not None
        runner = t.hook_runner
        hooks = runner.batch
        assert hooks is not None
        progress = t.progress
        results = t.metrics.train_results
        results.reset()
        t.metrics.results = results
        if t.reload_dataloaders_every_n_epochs and self._reload_due(progress.train_loader_epoch):
            # Before the epoch's hooks and set_epoch, as Lightning reloads.
            t.train_dataloader = None
            self.setup_train_dataloader()
            self._first_pass_of_reloaded_loader()
            progress.train_loader_epoch = progress.current_epoch
            self._fresh_train_loader = True
        if self.val_loaders is None and self._validates_this_epoch():
            self.val_loaders = self._setup_val()
        val_loaders = self.val_loaders or []
        loader = self.train_loader
        combined = isinstance(loader, CombinedLoader)
        set_sampler_epoch(loader, progress.current_epoch)

        module.train()
        runner.call("on_train_epoch_start")

        n = t.num_training_batches
        start = progress.resume.batch_idx
        step = TrainingStep(t).manual if self.forward_only else TrainingStep(t).run
        # With a profiler on (decided per run), the step and each batch fetch are recorded (Lightning's names).
        profiler = runner.profiler
        if profiler is not None:
            step = profiled(profiler, "run_training_batch", step)
        move = batch_mover(t)
        batch_start = hooks.on_train_batch_start
        batch_end = hooks.on_train_batch_end
        log_every = t.log_every_n_steps or math.inf  # 0 (barebones): never
        acc = t.accumulate_grad_batches
        automatic = module.automatic_optimization
        val_enabled = bool(val_loaders)
        # Pre-emption signals (trainer_core.signals): one attribute test per step on one process;
        # several ranks must agree on the step to stop at, which they do about once a second.
        preemption = self.preemption
        several_ranks = preemption is not None and t.world_size > 1
        # A plugin that cannot save the gradients of an unfinished accumulation cycle stops at the
        # cycle's end instead (at most accumulate_grad_batches - 1 batches later), so that the
        # pre-emption checkpoint still resumes exactly.
        stop_at_steps = (
            several_ranks and automatic and acc > 1 and bool(t.plugin.mid_accumulation_gradients_unsaved)
        )
        agreed_signal: Optional[int] = None
        if preemption is not None:
            preemption.arm()

        iterator = self._start_epoch_iterator(loader, start)
        if combined:
            iterator = _batches_only(iterator)
        if profiler is not None:
            iterator = profiled_iter(profiler, "[_TrainingEpochLoop].train_dataloader_next", iterator)
        if (
            start
            and val_enabled
            and not progress.validated_batch
            and self._validation_due(start - 1, start >= n)
        ):
            # The checkpoint was written in the last batch's ``on_train_batch_end``, before the
            # validation that batch was due: run it now, as the saved run did next.
            progress.batch_idx = start - 1
            progress.is_last_batch = start >= n
            self._validate()
        finite = not math.isinf(n)
        pairs = with_last_flag(iterator) if not finite else None
        batch_idx = start
        # Whether the loop leaves the epoch before its last batch (max_steps, should_stop): the epoch is
        # not over, and a checkpoint written from here on continues it at the next batch.
        cut = False
        while batch_idx < n:
            if finite:
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                is_last = batch_idx + 1 >= n
            else:
                try:
                    batch, is_last = next(pairs)  # type: ignore[arg-type]
                except StopIteration:
                    break
            if move is not None:
                batch = move(batch, 0)
            results.new_batch(batch)
            progress.batch_idx = batch_idx
            progress.is_last_batch = is_last
            if batch_start and runner.run("on_train_batch_start", batch_start, batch, batch_idx) == -1:
                break
            outputs = step(batch, batch_idx, is_last)
            # Counters move before ``on_train_batch_end`` so that a checkpoint written there
            # describes the batch as done.
            progress.batches_done_in_epoch = batch_idx + 1
            progress.validated_batch = False
            progress.total_batch_idx += 1
            stepped = not automatic or acc == 1 or (batch_idx + 1) % acc == 0 or is_last
            if stepped:
                progress.batches_that_stepped += 1
            if batch_end:
                runner.run("on_train_batch_end", batch_end, outputs, batch, batch_idx)
            if stepped and (progress.batches_that_stepped % log_every == 0 or t.should_stop):
                t.metrics.log_train_step()
            if val_enabled:
                if self._validation_due(batch_idx, is_last):
                    self._validate()
                elif t.should_stop and self._can_stop() and self._validates_this_epoch():
                    # Lightning validates once more when a run stops early; the run that goes on would not.
                    self._pause()
                    self._validate(step_plateau=False)
            batch_idx += 1
            if (t.max_steps != -1 and progress.global_step >= t.max_steps) or (
                t.should_stop and self._can_stop()
            ):
                cut = not is_last
                if cut:
                    self._pause()
                break
            if preemption is not None and (several_ranks or preemption.received is not None):
                if agreed_signal is None:
                    agreed_signal = preemption.agreed(t)
                if agreed_signal is not None and (stepped or not stop_at_steps):
                    preemption.save_and_stop(t, agreed_signal)
        self._end_train_epoch(cut)

    def _start_epoch_iterator(self, loader: Any, start: int) -> Iterator[Any]:
        """The epoch's batch iterator; after a restore, positioned exactly where the saved run stood.

        The sampler draws its order from the global RNG when the iterator is created, so a run
        resumed mid-epoch puts back the RNG of that moment, recreates the iterator, skips the batches
        already trained on (or lets a stateful loader seek), then puts back the RNG of the save.
        """
        t = self.trainer
        progress = t.progress
        resume = progress.resume
        progress.epoch_finished = False
        progress.plateau_stepped = False
        progress.batches_done_in_epoch = start
        followed_an_epoch = progress.loop_epoch is not None
        progress.loop_epoch = progress.current_epoch
        resume_rng = progress.paused_rng
        progress.paused_rng = None
        fresh, self._fresh_train_loader = self._fresh_train_loader, False
        stateful = _keeps_position(loader)
        first, self._first_epoch_iterator = self._first_epoch_iterator, None
        if first is not None:
            return first
        if resume_rng is None:
            progress.epoch_start_rng = collect_rng_states()
            if stateful and followed_an_epoch:
                # A stateful loader carries more than its position (its sampler's own generator), and
                # one that loaded a state draws from the global RNG unlike one that did not. A resumed
                # run loads the saved state at an epoch's start, so the run that never stopped does
                # the same with its own: both then draw alike.
                return _new_epoch_from(loader, loader.state_dict())
            return iter(loader)
        loader_state = resume.dataloader_state
        resume.dataloader_state = None
        stateful = stateful and loader_state is not None
        if not start:
            # Saved in the epoch's first batch (an error there, say): the sampler drew its order after the
            # epoch began, so the epoch starts again from its own generators, not from those of the save.
            apply_rng_states(resume_rng if resume.epoch_rng is None else resume.epoch_rng)
            progress.epoch_start_rng = collect_rng_states()
            if stateful:
                # A loader made anew for this epoch (reload_dataloaders_every_n_epochs) starts from its
                # own state, as it did in the saved run: the saved state is the previous loader's.
                return _new_epoch_from(loader, loader.state_dict() if fresh else loader_state)
            return iter(loader)
        if resume.epoch_rng is not None:
            apply_rng_states(resume.epoch_rng)
        progress.epoch_start_rng = resume.epoch_rng
        if stateful:
            loader.load_state_dict(loader_state)
            iterator = iter(loader)
        else:
            iterator = iter(loader)
            for _ in range(start):
                if next(iterator, _EXHAUSTED) is _EXHAUSTED:
                    break
        apply_rng_states(resume_rng)
        grads = resume.grads
        if grads:
            t.plugin.put_back_accumulated_gradients(t.lightning_module, grads)
        resume.grads = None
        return iterator

    def _validate(self, step_plateau: bool = True) -> None:
        t = self.trainer
        progress = t.progress
        # Marked first: a checkpoint written by a validation hook must not repeat it on resume.
        progress.validated_batch = True
        module = t.lightning_module
        acc = t.accumulate_grad_batches
        at_boundary = acc == 1 or (progress.batch_idx + 1) % acc == 0 or progress.is_last_batch
        t.validating_in_fit = True  # trainer.training/validating, as Lightning's running stage
        try:
            if at_boundary or not module.automatic_optimization:
                # Gradients are not needed until the next step: release their memory for validation.
                t.hook_runner.call_module("on_validation_model_zero_grad")
            if t.reload_dataloaders_every_n_epochs and self._reload_due(progress.val_loader_epoch):
                self.val_loaders = self._setup_val()
            run_loop(
                t,
                "validation",
                self.val_loaders,
                t.num_val_batches,
                log=True,
                step=max(0, progress.batches_that_stepped - 1),
            )
        finally:
            t.validating_in_fit = False
        t.metrics.results = t.metrics.train_results
        if step_plateau and module.automatic_optimization and at_boundary:
            update_lr_schedulers(t, "step", plateau=True)

    def _end_train_epoch(self, cut: bool = False) -> None:
        """Lightning's epoch end: callbacks, the module, then callbacks that monitor metrics.

        An epoch ``cut`` short (the run stopped before its last batch) runs the same hooks, but stays
        unfinished in checkpoints and does not step ReduceLROnPlateau, just as the other epoch-interval
        schedulers step only after an epoch's last batch: the run that goes on steps them there.
        """
        t = self.trainer
        progress = t.progress
        metrics = t.metrics
        runner = t.hook_runner
        module = t.lightning_module
        progress.epoch_finished = not cut
        results = metrics.train_results
        metrics.results = results
        metrics.take_step_values()
        metrics.publish_epoch(results, log=False)
        monitoring = monitoring_callbacks(t.callbacks)
        runner.current_fx = "on_train_epoch_end"
        for cb in t.callbacks:
            if cb not in monitoring:
                runner.call_callback(cb, "on_train_epoch_end")
        runner.call_module("on_train_epoch_end")
        metrics.publish_epoch(results, log=False)
        runner.current_fx = "on_train_epoch_end"
        for cb in monitoring:
            runner.call_callback(cb, "on_train_epoch_end")
        if module.automatic_optimization and not cut:
            update_lr_schedulers(t, "epoch", plateau=True)
        progress.plateau_stepped = True
        _, logged, _ = results.epoch_metrics()
        if logged:
            metrics.log(logged, max(0, progress.batches_that_stepped - 1))
        results.reset_torchmetrics()
        for lg in t.loggers:
            lg.save()


def _batches_only(combined: Iterator[tuple[Any, int, int]]) -> Iterator[Any]:
    """The batches of a CombinedLoader already started (``iter`` again would start it over)."""
    while True:
        try:
            batch, _, _ = next(combined)
        except StopIteration:
            return
        yield batch


def _started(loader: Any) -> Iterator[Any]:
    """A pass over ``loader`` begun as Lightning begins one: a loader without a length yields its first batch now.

    Lightning reads one batch ahead of a loader without a length, to know its last batch; the pass
    of every later epoch reads it just before the batch loop, where the loop's look-ahead does.
    """
    iterator = iter(loader)
    if has_length(loader):
        return iterator
    first = next(iterator, _EXHAUSTED)
    return iter(()) if first is _EXHAUSTED else itertools.chain((first,), iterator)


def _keeps_position(loader: Any) -> bool:
    """Whether checkpoints hold where ``loader`` stands (a CombinedLoader: where each of its loaders does)."""
    if isinstance(loader, CombinedLoader):
        return all(is_stateful(each) for each in loader.flattened)
    return is_stateful(loader)


def _new_epoch_from(loader: Any, state: Any) -> Iterator[Any]:
    """The iterator of an epoch that starts from ``state``, a stateful loader's state taken at an epoch's end.

    Each loader starts its next pass, as Lightning's ``iter`` of each does: torchdata's state is marked
    as ended, so that a loader the epoch stopped before its end (``limit_train_batches``, the longer
    loader under ``min_size``) starts over too, instead of going on where it stood.
    """
    if not isinstance(loader, CombinedLoader):
        loader.load_state_dict(_as_ended(state))
        return _epoch_of_stateful_loader(loader)
    states = [_as_ended(each) for each in state.get("loaders", [])]
    loader.load_state_dict({"loaders": states})
    return iter(loader)


def _as_ended(state: Any) -> Any:
    if isinstance(state, dict) and _TORCHDATA_ENDED in state:
        return {**state, _TORCHDATA_ENDED: True}
    return state


def _epoch_of_stateful_loader(loader: Any) -> Iterator[Any]:
    """An epoch's iterator of a stateful loader that has just loaded a state taken at an epoch's end.

    The loop stops after the epoch's last batch without asking the iterator for one more, so the
    state says "every batch yielded" but not "epoch over", and a loader that loads it yields
    nothing. Such an iterator is replaced by the next one, which begins the new epoch (the same in a
    resumed run, which loads the same state here).
    """
    iterator = iter(loader)
    first = next(iterator, _EXHAUSTED)
    if first is _EXHAUSTED:
        iterator = iter(loader)
        first = next(iterator, _EXHAUSTED)
        if first is _EXHAUSTED:
            return iter(())
    return itertools.chain((first,), iterator)
