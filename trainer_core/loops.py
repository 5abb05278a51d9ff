"""The fit, evaluation and prediction loops.

The training step is the hot path. It is written as plain functions over locals chosen once per
epoch: hooks nobody overrides are skipped by a truth test on an empty tuple, the default
``optimizer_step``/``optimizer_zero_grad`` are called directly, and no dict is built per step
except the ``{"loss": ...}`` that ``on_train_batch_end`` receives. Everything Lightning does on
a step (hook order, loss normalisation under accumulation, scheduler stepping, logging every
``log_every_n_steps``) happens in the same order here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning_utilities.core.overrides import is_overridden
from torch import Tensor

from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException
from trainer_core.module import LightningModule
from trainer_core.results import ResultCollection
from trainer_core.utilities import rank_zero_warn, to_float

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from trainer_core.trainer import Trainer

_KIND_HOOK = {
    "train": "train_dataloader",
    "val": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


# ---------------------------------------------------------------------- data
def resolve_dataloaders(trainer: Trainer, kind: str, given: Any) -> list[Any]:
    """The dataloaders of ``kind``: given to the entry point, else the datamodule's, else the module's."""
    hook = _KIND_HOOK[kind]
    if given is None:
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden(hook, datamodule, LightningDataModule):
            given = getattr(datamodule, hook)()
        elif datamodule is not None and kind == "train":
            raise MisconfigurationException(
                f"{type(datamodule).__name__} does not define `train_dataloader`, which `fit` needs."
            )
        else:
            given = trainer._call_module_hook(hook)
    loaders = list(given) if isinstance(given, (list, tuple)) else [given]
    if kind == "train" and len(loaders) != 1:
        raise MisconfigurationException(
            f"fit: training takes one dataloader, got {len(loaders)}; combine them into one dataset or loader."
        )
    for loader in loaders:
        if not hasattr(loader, "__iter__"):
            raise MisconfigurationException(
                f"`{hook}` returned a {type(loader).__name__}, which cannot be iterated; return a DataLoader."
            )
    return [
        trainer.plugin.process_dataloader(loader, kind, trainer.use_distributed_sampler) for loader in loaders
    ]


def num_batches(loader: Any, limit: Union[int, float], name: str) -> Union[int, float]:
    """Batches to draw from ``loader`` under ``limit`` (a number of batches or a fraction)."""
    try:
        length: Union[int, float] = len(loader)
    except (TypeError, NotImplementedError):
        length = float("inf")
    if isinstance(limit, int):
        return min(length, limit)
    if limit == 1.0:
        return length
    if math.isinf(length):
        if limit == 0.0:
            return 0
        raise MisconfigurationException(
            f"Trainer({name}={limit}) is a fraction, but the dataloader has no length; pass a number of batches instead."
        )
    count = int(length * limit)
    return max(count, 1) if limit > 0 and length > 0 else count


def _with_last_flag(iterator: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``, looking one item ahead (for loaders without a length)."""
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True


def _transfer(trainer: Trainer, batch: Any, dataloader_idx: int) -> Any:
    batch = trainer._call_module_hook("on_before_batch_transfer", batch, dataloader_idx)
    batch = trainer._call_module_hook(
        "transfer_batch_to_device", batch, trainer.plugin.root_device, dataloader_idx
    )
    return trainer._call_module_hook("on_after_batch_transfer", batch, dataloader_idx)


def _batch_mover(trainer: Trainer) -> Optional[Callable[[Any, int], Any]]:
    """How a batch reaches the device: the user's hooks, the plugin, or (on the CPU) not at all."""
    if trainer._hooks.batch_transfer:
        return lambda batch, idx: _transfer(trainer, batch, idx)
    if trainer.plugin.root_device.type != "cpu":
        move = trainer.plugin.batch_to_device
        return lambda batch, idx: move(batch)
    return None


# ---------------------------------------------------------------------- fit
def run_fit(trainer: Trainer, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
    t = trainer
    t._train_source = train_dataloaders
    t.train_dataloader = None
    t._paused_rng = None
    t._loop_epoch = None
    t._setup_run("fit")
    module = t.lightning_module
    assert module is not None
    if ckpt_path is not None:
        from trainer_core.checkpointing import restore_checkpoint

        restore_checkpoint(t, ckpt_path)
    for lg in t.loggers:
        if module._log_hyperparams and module.hparams:
            lg.log_hyperparams(dict(module.hparams))
    if t.enable_model_summary and t.is_global_zero and not t.fast_dev_run:
        from trainer_core.summary import print_summary

        print_summary(module)
    t._call_hooks("on_fit_start")

    sanity = (
        t.num_sanity_val_steps != 0
        and t.limit_val_batches != 0
        and not t._restored_mid_run
        and t.plugin.defines_step("validation_step")
    )
    if sanity:
        val_loaders = _sanity_check(t, val_dataloaders)
    else:
        val_loaders = _setup_val(t, val_dataloaders)
    _ensure_train_dataloader(t)

    t._call_hooks("on_train_start")
    while not _fit_done(t):
        _train_epoch(t, val_loaders)
        t.current_epoch += 1
        t._resume_batch_idx = 0
    # Stopped at an epoch's end: the generators stand where the next epoch would begin.
    _pause(t)
    t._call_hooks("on_train_end")
    t._call_hooks("on_fit_end")
    for lg in t.loggers:
        lg.finalize("success")
    t._teardown("fit")


def _ensure_train_dataloader(t: Trainer) -> None:
    if t.train_dataloader is not None:
        return
    (loader,) = resolve_dataloaders(t, "train", getattr(t, "_train_source", None))
    seed = t._resume_sampler_seed
    if seed is not None and isinstance(getattr(getattr(loader, "sampler", None), "seed", None), int):
        loader.sampler.seed = seed
    t.train_dataloader = loader
    if t._resume_samples_done is not None:
        from trainer_core.checkpointing import resume_batch_at_another_world_size

        resume_batch_at_another_world_size(t, loader)
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


def _setup_val(t: Trainer, given: Any) -> list[Any]:
    if t.limit_val_batches == 0:
        t.val_dataloaders, t.num_val_batches = [], []
        return []
    loaders = resolve_dataloaders(t, "val", given)
    loaders = [dl for dl in loaders if dl is not None]
    if loaders and not t.plugin.defines_step("validation_step"):
        rank_zero_warn(
            "Validation data was given but the module has no `validation_step`; validation is skipped."
        )
        loaders = []
    t.val_dataloaders = loaders[0] if len(loaders) == 1 else loaders
    t.num_val_batches = [num_batches(dl, t.limit_val_batches, "limit_val_batches") for dl in loaders]
    return loaders


def _sanity_check(t: Trainer, given: Any) -> list[Any]:
    """A few validation batches before training, to fail fast; returns the validation loaders."""
    from trainer_core.checkpointing import apply_rng_states, collect_rng_states

    # The check must not change the run: creating a loader's iterator draws from the global RNG.
    rng = collect_rng_states()
    t.sanity_checking = True
    t._call_callback_hooks("on_sanity_check_start")
    val_loaders = _setup_val(t, given)
    steps = t.num_sanity_val_steps
    limits = [n if steps == -1 else min(n, steps) for n in t.num_val_batches]
    if val_loaders:
        run_eval_loop(t, "validation", val_loaders, limits, log=False)
    t._call_callback_hooks("on_sanity_check_end")
    t.sanity_checking = False
    apply_rng_states(rng)
    # What the sanity check logged must not reach callbacks or loggers (Lightning's behaviour).
    t._callback_metrics.clear()
    t._progress_bar_metrics.clear()
    t._logged_metrics.clear()
    return val_loaders


def _fit_done(t: Trainer) -> bool:
    if t.max_steps != -1 and t.global_step >= t.max_steps:
        return True
    if t.max_epochs != -1 and t.current_epoch >= t.max_epochs:
        return True
    if t.num_training_batches == 0:
        rank_zero_warn("The training dataloader is empty (or limit_train_batches=0): nothing to train.")
        return True
    if t.should_stop:
        if _can_stop(t):
            return True
        t.should_stop = False
    return False


def _can_stop(t: Trainer) -> bool:
    """``should_stop`` takes effect only once ``min_epochs`` and ``min_steps`` are met.

    ``current_epoch`` counts the epochs finished (inside an epoch, those before it), as Lightning's
    ``epoch_progress.current.processed`` does: the epoch that reaches ``min_epochs`` runs to its end.
    """
    if t.min_epochs is not None and t.current_epoch < t.min_epochs:
        return False
    return not (t.min_steps is not None and t.global_step < t.min_steps)


def _validation_due(t: Trainer, batch_idx: int, is_last: bool) -> bool:
    """Whether the validation schedule (``val_check_interval``, ``check_val_every_n_epoch``) falls on this batch."""
    if not t._val_loaders_for_fit or not _validates_this_epoch(t):
        return False
    if math.isinf(t.val_check_batch):
        return is_last
    current = t.total_batch_idx - 1 if t.check_val_every_n_epoch is None else batch_idx
    return (current + 1) % t.val_check_batch == 0


def _validates_this_epoch(t: Trainer) -> bool:
    every = t.check_val_every_n_epoch
    return every is None or (t.current_epoch + 1) % every == 0


def _pause(t: Trainer) -> None:
    """The loop stops training here: keep the generators as they stand for a checkpoint written from now on.

    What runs after the last batch only because the run ends (a validation the schedule did not
    call for, the hooks of an epoch cut short, ``on_train_end``) must not leak into the position a
    resumed run continues from; the run that never stopped went straight on to the next batch.
    """
    if t._paused_rng is None:
        from trainer_core.checkpointing import collect_rng_states

        t._paused_rng = collect_rng_states()


def _train_epoch(t: Trainer, val_loaders: list[Any]) -> None:
    """One training epoch: batches, validation checks, then the epoch-end hooks."""
    module = t.lightning_module
    hooks = t._hooks
    assert module is not None
    t._val_loaders_for_fit = val_loaders
    results = t._train_results
    results.reset()
    t._results = results
    loader = t.train_dataloader
    sampler = getattr(loader, "sampler", None)
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(t.current_epoch)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if (
        callable(getattr(getattr(batch_sampler, "sampler", None), "set_epoch", None))
        and batch_sampler.sampler is not sampler
    ):
        batch_sampler.sampler.set_epoch(t.current_epoch)

    module.train()
    t._call_hooks("on_train_epoch_start")

    n = t.num_training_batches
    start = t._resume_batch_idx
    step = _make_step(t)
    move = _batch_mover(t)
    batch_start = hooks.on_train_batch_start
    batch_end = hooks.on_train_batch_end
    log_every = t.log_every_n_steps
    acc = t.accumulate_grad_batches
    automatic = module.automatic_optimization
    val_enabled = bool(val_loaders)
    # Pre-emption signals (trainer_core.signals): one attribute test per step on one process;
    # several ranks must agree on the step to stop at, which they do about once a second.
    preemption = t._preemption
    several_ranks = preemption is not None and t.world_size > 1
    # A plugin that cannot save the gradients of an unfinished accumulation cycle stops at the
    # cycle's end instead (at most accumulate_grad_batches - 1 batches later), so that the
    # pre-emption checkpoint still resumes exactly.
    stop_at_steps = (
        several_ranks and automatic and acc > 1 and bool(t.plugin.mid_accumulation_gradients_unsaved)
    )
    agreed_signal: Optional[int] = None

    iterator = _start_epoch_iterator(t, loader, start)
    if start and val_enabled and not t._validated_batch and _validation_due(t, start - 1, start >= n):
        # The checkpoint was written in the last batch's ``on_train_batch_end``, before the
        # validation that batch was due: run it now, as the saved run did next.
        t.batch_idx = start - 1
        t._is_last_batch = start >= n
        _validate_in_fit(t, val_loaders)
    finite = not math.isinf(n)
    pairs = _with_last_flag(iterator) if not finite else None
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
        t.batch_idx = batch_idx
        t._is_last_batch = is_last
        if batch_start and t._run_hooks("on_train_batch_start", batch_start, batch, batch_idx) == -1:
            break
        outputs = step(batch, batch_idx, is_last)
        # Counters move before ``on_train_batch_end`` so that a checkpoint written there
        # describes the batch as done.
        t._batches_done_in_epoch = batch_idx + 1
        t._validated_batch = False
        t.total_batch_idx += 1
        stepped = not automatic or acc == 1 or (batch_idx + 1) % acc == 0 or is_last
        if stepped:
            t._batches_that_stepped += 1
        if batch_end:
            t._run_hooks("on_train_batch_end", batch_end, outputs, batch, batch_idx)
        if stepped and (t._batches_that_stepped % log_every == 0 or t.should_stop):
            _log_train_step(t)
        if val_enabled:
            if _validation_due(t, batch_idx, is_last):
                _validate_in_fit(t, val_loaders)
            elif t.should_stop and _can_stop(t) and _validates_this_epoch(t):
                # Lightning validates once more when a run stops early; the run that goes on would not.
                _pause(t)
                _validate_in_fit(t, val_loaders, step_plateau=False)
        batch_idx += 1
        if (t.max_steps != -1 and t.global_step >= t.max_steps) or (t.should_stop and _can_stop(t)):
            cut = not is_last
            if cut:
                _pause(t)
            break
        if preemption is not None and (several_ranks or preemption.received is not None):
            if agreed_signal is None:
                agreed_signal = preemption.agreed(t)
            if agreed_signal is not None and (stepped or not stop_at_steps):
                preemption.save_and_stop(t, agreed_signal)
    _end_train_epoch(t, cut)


def _start_epoch_iterator(t: Trainer, loader: Any, start: int) -> Iterator[Any]:
    """The epoch's batch iterator; after a restore, positioned exactly where the saved run stood.

    The sampler draws its order from the global RNG when the iterator is created, so a run
    resumed mid-epoch puts back the RNG of that moment, recreates the iterator, skips the batches
    already trained on (or lets a stateful loader seek), then puts back the RNG of the save.
    """
    from trainer_core.checkpointing import apply_rng_states, collect_rng_states

    t._epoch_finished = False
    t._plateau_stepped = False
    t._batches_done_in_epoch = start
    followed_an_epoch = t._loop_epoch is not None
    t._loop_epoch = t.current_epoch
    resume_rng = t._paused_rng
    t._paused_rng = None
    stateful = callable(getattr(loader, "load_state_dict", None)) and callable(
        getattr(loader, "state_dict", None)
    )
    if resume_rng is None:
        t._epoch_start_rng = collect_rng_states()
        if stateful and followed_an_epoch:
            # A stateful loader carries more than its position (its sampler's own generator), and
            # one that loaded a state draws from the global RNG unlike one that did not. A resumed
            # run loads the saved state at an epoch's start, so the run that never stopped does
            # the same with its own: both then draw alike.
            loader.load_state_dict(loader.state_dict())
        return iter(loader)
    loader_state = t._resume_dataloader_state
    t._resume_dataloader_state = None
    stateful = stateful and loader_state is not None
    if not start:
        apply_rng_states(resume_rng)
        t._epoch_start_rng = collect_rng_states()
        if stateful:
            loader.load_state_dict(loader_state)
        return iter(loader)
    if t._resume_epoch_rng is not None:
        apply_rng_states(t._resume_epoch_rng)
    t._epoch_start_rng = t._resume_epoch_rng
    if stateful:
        loader.load_state_dict(loader_state)
        iterator = iter(loader)
    else:
        iterator = iter(loader)
        for _ in range(start):
            if next(iterator, _EXHAUSTED) is _EXHAUSTED:
                break
    apply_rng_states(resume_rng)
    grads = t._resume_grads
    if grads:
        for name, param in t.lightning_module.named_parameters():
            if name in grads:
                grad = grads[name].to(param.device)
                if hasattr(param, "device_mesh"):  # a DTensor shard (FSDP): the gradient is this rank's shard
                    from torch.distributed.tensor import DTensor

                    grad = DTensor.from_local(
                        grad,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                param.grad = grad
    t._resume_grads = None
    return iterator


_EXHAUSTED = object()


def _log_train_step(t: Trainer) -> None:
    callback, logged, pbar = t._train_results.step_metrics()
    t._callback_metrics.update(callback)
    t._progress_bar_metrics.update({k: to_float(v) for k, v in pbar.items()})
    if logged:
        t._log_metrics(logged, t._batches_that_stepped - 1)


def _end_train_epoch(t: Trainer, cut: bool = False) -> None:
    """Lightning's epoch end: callbacks, the module, then callbacks that monitor metrics.

    An epoch ``cut`` short (the run stopped before its last batch) runs the same hooks, but stays
    unfinished in checkpoints and does not step ReduceLROnPlateau, just as the other epoch-interval
    schedulers step only after an epoch's last batch: the run that goes on steps them there.
    """
    t._epoch_finished = not cut
    results = t._train_results
    t._results = results
    t.callback_metrics  # noqa: B018 - takes in the last step values
    t._publish_epoch_metrics(results, log=False)
    monitoring = [cb for cb in t.callbacks if getattr(cb, "_monitors_metrics", False)]
    t._current_fx = "on_train_epoch_end"
    for cb in t.callbacks:
        if cb not in monitoring:
            cb.on_train_epoch_end(t, t.lightning_module)
    t._call_module_hook("on_train_epoch_end")
    t._publish_epoch_metrics(results, log=False)
    t._current_fx = "on_train_epoch_end"
    for cb in monitoring:
        cb.on_train_epoch_end(t, t.lightning_module)
    if t.lightning_module.automatic_optimization and not cut:
        update_lr_schedulers(t, "epoch", plateau=True)
    t._plateau_stepped = True
    _, logged, _ = results.epoch_metrics()
    if logged:
        t._log_metrics(logged, max(0, t._batches_that_stepped - 1))
    for lg in t.loggers:
        lg.save()


def update_lr_schedulers(t: Trainer, interval: str, plateau: bool) -> None:
    """Step the schedulers of ``interval`` whose frequency is due (Lightning's rule)."""
    configs = t.plugin.lr_scheduler_configs
    if not configs:
        return
    for config in configs:
        if config.reduce_on_plateau != plateau or config.interval != interval:
            continue
        index = (t.batch_idx if interval == "step" else t.current_epoch) + 1
        if index % config.frequency:
            continue
        metric = None
        if config.reduce_on_plateau:
            metric = t.callback_metrics.get(config.monitor)
            if metric is None:
                if config.strict:
                    available = ", ".join(sorted(t.callback_metrics)) or "none"
                    raise MisconfigurationException(
                        f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged (logged metrics: "
                        f"{available}). Log it with self.log({config.monitor!r}, ...) or change `monitor`."
                    )
                rank_zero_warn(
                    f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged; the scheduler did not step."
                )
                continue
        t._call_module_hook("lr_scheduler_step", config.scheduler, metric)


def _make_step(t: Trainer) -> Callable[[Any, int, bool], Any]:
    """The per-batch training function for this epoch, with everything fixed that can be."""
    module = t.lightning_module
    plugin = t.plugin
    assert module is not None
    from trainer_core.plugins import TrainingTypePlugin

    training_step = plugin.training_step
    precision = plugin.precision
    needs_context = precision.forward_context_needed

    if not module.automatic_optimization:

        def manual_step(batch: Any, batch_idx: int, is_last: bool) -> Any:
            t._current_fx = "training_step"
            if needs_context:
                with precision.forward_context():
                    out = training_step(batch, batch_idx)
            else:
                out = training_step(batch, batch_idx)
            if isinstance(out, Tensor):
                return {"loss": out.detach()}
            return out if out is not None else {}

        return manual_step

    hooks = t._hooks
    optimizer = plugin.optimizers[0]
    lightning_optimizer = t._lightning_optimizers[0]
    acc = t.accumulate_grad_batches
    zero_grad_hooks = hooks.on_before_zero_grad
    custom_zero_grad = hooks.optimizer_zero_grad
    custom_step = hooks.optimizer_step
    want_outputs = bool(hooks.on_train_batch_end)
    no_sync = plugin.no_backward_sync
    step_schedulers = any(
        c.interval == "step" and not c.reduce_on_plateau for c in plugin.lr_scheduler_configs
    )
    epoch_schedulers = any(
        c.interval == "epoch" and not c.reduce_on_plateau for c in plugin.lr_scheduler_configs
    )

    # Each layer below is skipped when it would do nothing, so the default step costs about what a
    # hand-written loop does: the module's own training_step, loss.backward(), optimizer.step().
    if type(plugin).training_step is TrainingTypePlugin.training_step:
        training_step = module.training_step
    plain_backward = (
        type(plugin).backward is TrainingTypePlugin.backward
        and precision.scaler is None
        and not hooks.on_before_backward
        and not hooks.on_after_backward
        and not is_overridden("backward", module, LightningModule)
    )
    backward = plugin.backward
    # Torch's built-in optimizers give the same result whether they call the closure or we call it
    # first; calling it ourselves saves the closure machinery. LBFGS re-evaluates it, so it keeps it.
    direct_step = (
        not custom_step
        and type(plugin).optimizer_step is TrainingTypePlugin.optimizer_step
        and precision.scaler is None
        and type(optimizer).__module__.startswith("torch.optim.")
        and not isinstance(optimizer, torch.optim.LBFGS)
    )
    # Under optimizer_in_backward the parameters step inside backward, from their gradient hooks,
    # with the hyper-parameters the optimizer holds then (a scheduler's, or set in training_step).
    in_backward = plugin.in_backward_optimizer
    if in_backward is not None:
        direct_step = plain_backward = False
        plugin_backward = plugin.backward

        def backward(loss: Tensor, optimizer: Optimizer) -> Tensor:
            in_backward.sync()
            return plugin_backward(loss, optimizer)

    optimizer_step = plugin.optimizer_step
    current_batch: Any = None
    current_idx = 0
    output: Any = None

    def zero_grad(batch_idx: int) -> None:
        """At the first batch of an accumulation cycle: the hooks, then the module's zero_grad or the optimizer's."""
        if zero_grad_hooks:
            t._run_hooks("on_before_zero_grad", zero_grad_hooks, optimizer)
        if custom_zero_grad:
            t._current_fx = "optimizer_zero_grad"
            module.optimizer_zero_grad(t.current_epoch, batch_idx, optimizer)
        else:
            optimizer.zero_grad()

    def closure() -> Optional[Tensor]:
        nonlocal output
        batch_idx = current_idx
        t._current_fx = "training_step"
        if needs_context:
            with precision.forward_context():
                out = training_step(current_batch, batch_idx)
        else:
            out = training_step(current_batch, batch_idx)
        if isinstance(out, Tensor):
            loss, extra = out, None
        elif isinstance(out, dict):
            loss = out.get("loss")
            if not isinstance(loss, Tensor):
                raise MisconfigurationException(
                    "training_step returned a dict without a tensor under 'loss'; automatic optimization needs it."
                )
            extra = out
        elif out is None:
            loss, extra = None, None
        else:
            raise MisconfigurationException(
                f"training_step returned a {type(out).__name__}; return the loss tensor, a dict with 'loss', or None "
                "to skip the batch."
            )
        if acc == 1 or batch_idx % acc == 0:
            zero_grad(batch_idx)
        if loss is None:
            output = None
            return None
        if acc > 1:
            loss = loss / acc
        if plain_backward:
            loss.backward()
        else:
            backward(loss, optimizer)
        if want_outputs:
            output = {"loss": loss.detach()} if extra is None else {**extra, "loss": loss.detach()}
        return loss

    forward_backward = plugin.forward_backward()
    if forward_backward is not None:
        # The plugin runs forward and backward together (a pipeline schedule over micro-batches).
        def closure() -> Optional[Tensor]:
            nonlocal output
            batch_idx = current_idx
            if acc == 1 or batch_idx % acc == 0:
                zero_grad(batch_idx)
            t._current_fx = "training_step"
            if needs_context:
                with precision.forward_context():
                    loss = forward_backward(current_batch, batch_idx)
            else:
                loss = forward_backward(current_batch, batch_idx)
            if want_outputs:
                output = {"loss": loss}
            return loss

    t._closure = closure

    def automatic_step(batch: Any, batch_idx: int, is_last: bool) -> Any:
        nonlocal current_batch, current_idx
        current_batch = batch
        current_idx = batch_idx
        if acc == 1 or is_last or (batch_idx + 1) % acc == 0:
            if direct_step:
                closure()
                after = t._after_closure
                if after is not None:
                    after(optimizer)
                optimizer.step()
            elif in_backward is not None:
                closure()
            elif custom_step:
                t._current_fx = "optimizer_step"
                module.optimizer_step(t.current_epoch, batch_idx, lightning_optimizer, closure)
            else:
                optimizer_step(optimizer, closure)
            t.global_step += 1
            if step_schedulers:
                update_lr_schedulers(t, "step", plateau=False)
            if is_last and epoch_schedulers:
                update_lr_schedulers(t, "epoch", plateau=False)
        else:
            with no_sync():
                closure()
        return output

    return automatic_step


def _validate_in_fit(t: Trainer, val_loaders: list[Any], step_plateau: bool = True) -> None:
    # Marked first: a checkpoint written by a validation hook must not repeat it on resume.
    t._validated_batch = True
    module = t.lightning_module
    acc = t.accumulate_grad_batches
    at_boundary = acc == 1 or (t.batch_idx + 1) % acc == 0 or t._is_last_batch
    if at_boundary or not module.automatic_optimization:
        # Gradients are not needed until the next step: release their memory for validation.
        t._call_module_hook("on_validation_model_zero_grad")
    run_eval_loop(
        t, "validation", val_loaders, t.num_val_batches, log=True, step=max(0, t._batches_that_stepped - 1)
    )
    t._results = t._train_results
    if step_plateau and module.automatic_optimization and at_boundary:
        update_lr_schedulers(t, "step", plateau=True)


# ---------------------------------------------------------------------- evaluation
def run_eval_loop(
    t: Trainer,
    prefix: str,
    loaders: list[Any],
    limits: list[Union[int, float]],
    log: bool,
    step: Optional[int] = None,
) -> list[dict[str, Any]]:
    """One pass of ``validation`` or ``test`` over ``loaders``; returns epoch metrics per loader."""
    module = t.lightning_module
    plugin = t.plugin
    hooks = t._hooks
    assert module is not None
    step_fn = plugin.validation_step if prefix == "validation" else plugin.test_step
    batch_start = getattr(hooks, f"on_{prefix}_batch_start")
    batch_end = getattr(hooks, f"on_{prefix}_batch_end")
    move = _batch_mover(t)
    precision = plugin.precision
    step_name = f"{prefix}_step"

    was_training = module.training
    t._call_module_hook(f"on_{prefix}_model_eval")
    t._call_hooks(f"on_{prefix}_start")
    results = ResultCollection(training=False)
    results.plugin = plugin
    t._results = results
    multiple = len(loaders) > 1
    grad_context = torch.inference_mode() if t.inference_mode else torch.no_grad()
    with grad_context:
        t._call_hooks(f"on_{prefix}_epoch_start")
        for dl_idx, loader in enumerate(loaders):
            extra = (dl_idx,) if multiple else ()
            results.name_suffix = f"/dataloader_idx_{dl_idx}" if multiple else ""
            limit = limits[dl_idx]
            if limit == 0:
                continue
            for batch_idx, batch in enumerate(loader):
                if move is not None:
                    batch = move(batch, dl_idx)
                results.new_batch(batch)
                if batch_start:
                    t._run_hooks(f"on_{prefix}_batch_start", batch_start, batch, batch_idx, *extra)
                t._current_fx = step_name
                with precision.forward_context():
                    out = step_fn(batch, batch_idx, *extra)
                if batch_end:
                    t._run_hooks(f"on_{prefix}_batch_end", batch_end, out, batch, batch_idx, *extra)
                if log and results.step_dirty:
                    _, logged, _ = results.step_metrics()
                    if logged:
                        t._log_metrics(logged, t._eval_step)
                    t._eval_step += 1
                if batch_idx + 1 >= limit:
                    break
        results.name_suffix = ""
        t._call_hooks(f"on_{prefix}_epoch_end")
    metrics = t._publish_epoch_metrics(results, log=log, step=step)
    t._call_hooks(f"on_{prefix}_end")
    if was_training:
        t._call_module_hook(f"on_{prefix}_model_train")
    return _split_per_loader(metrics, len(loaders))


def _split_per_loader(metrics: dict[str, Any], count: int) -> list[dict[str, Any]]:
    if count <= 1:
        return [{k: to_float(v) for k, v in metrics.items()}]
    shared = {k: to_float(v) for k, v in metrics.items() if "/dataloader_idx_" not in k}
    return [
        {**shared, **{k: to_float(v) for k, v in metrics.items() if k.endswith(f"/dataloader_idx_{idx}")}}
        for idx in range(count)
    ]


def run_evaluation(
    t: Trainer, stage: str, dataloaders: Any, ckpt_path: Any, verbose: bool
) -> list[dict[str, float]]:
    kind, prefix, limit_name = (
        ("val", "validation", "limit_val_batches")
        if stage == "validate"
        else ("test", "test", "limit_test_batches")
    )
    t._setup_run(stage)
    if ckpt_path is not None:
        from trainer_core.checkpointing import restore_checkpoint

        restore_checkpoint(t, ckpt_path, weights_only=True)
    loaders = resolve_dataloaders(t, kind, dataloaders)
    limit = getattr(t, limit_name)
    limits = [num_batches(dl, limit, limit_name) for dl in loaders]
    if stage == "validate":
        t.val_dataloaders, t.num_val_batches = (loaders[0] if len(loaders) == 1 else loaders), limits
    else:
        t.test_dataloaders, t.num_test_batches = (loaders[0] if len(loaders) == 1 else loaders), limits
    if not t.plugin.defines_step(f"{prefix}_step"):
        raise MisconfigurationException(
            f"`trainer.{stage}()` needs `{type(t.lightning_module).__name__}.{prefix}_step`; define it."
        )
    results = run_eval_loop(t, prefix, loaders, limits, log=True)
    for lg in t.loggers:
        lg.save()
    if verbose and t.is_global_zero:
        _print_results(stage, results)
    t._teardown(stage)
    return results


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    rows = [(name, value) for res in results for name, value in sorted(res.items())]
    if not rows:
        return
    width = max(len(name) for name, _ in rows)
    title = f"{stage.capitalize()} metric"
    width = max(width, len(title))
    line = "-" * (width + 22)
    print(line)
    print(f"{title:<{width}}  {'Value':>18}")
    print(line)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>18.6g}")
    print(line)


# ---------------------------------------------------------------------- prediction
def run_predict(
    t: Trainer, dataloaders: Any, ckpt_path: Any, return_predictions: Optional[bool]
) -> Optional[list[Any]]:
    t._setup_run("predict")
    if ckpt_path is not None:
        from trainer_core.checkpointing import restore_checkpoint

        restore_checkpoint(t, ckpt_path, weights_only=True)
    module = t.lightning_module
    plugin = t.plugin
    hooks = t._hooks
    assert module is not None
    loaders = resolve_dataloaders(t, "predict", dataloaders)
    limits = [num_batches(dl, t.limit_predict_batches, "limit_predict_batches") for dl in loaders]
    t.predict_dataloaders, t.num_predict_batches = (loaders[0] if len(loaders) == 1 else loaders), limits
    keep = True if return_predictions is None else return_predictions
    move = _batch_mover(t)
    precision = plugin.precision
    multiple = len(loaders) > 1
    all_predictions: list[list[Any]] = []
    t._call_module_hook("on_predict_model_eval")
    t._call_hooks("on_predict_start")
    with torch.inference_mode() if t.inference_mode else torch.no_grad():
        t._call_hooks("on_predict_epoch_start")
        for dl_idx, loader in enumerate(loaders):
            extra = (dl_idx,) if multiple else ()
            predictions: list[Any] = []
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limits[dl_idx]:
                    break
                if move is not None:
                    batch = move(batch, dl_idx)
                if hooks.on_predict_batch_start:
                    t._run_hooks(
                        "on_predict_batch_start", hooks.on_predict_batch_start, batch, batch_idx, *extra
                    )
                t._current_fx = "predict_step"
                with precision.forward_context():
                    out = plugin.predict_step(batch, batch_idx, *extra)
                if hooks.on_predict_batch_end:
                    t._run_hooks(
                        "on_predict_batch_end", hooks.on_predict_batch_end, out, batch, batch_idx, *extra
                    )
                if keep:
                    predictions.append(out)
            all_predictions.append(predictions)
        t._call_hooks("on_predict_epoch_end")
    t._call_hooks("on_predict_end")
    t._teardown("predict")
    if not keep:
        return None
    return all_predictions if multiple else all_predictions[0]
