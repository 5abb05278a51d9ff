"""``Trainer``: Lightning's arguments and entry points over training-type plugins.

The Trainer owns the loops, the hooks and the checkpoint format; it never touches
``torch.distributed``: processes, devices, wrapping and collectives belong to the plugin.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
from collections.abc import Iterator, Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from torch import nn
from torch.optim import Optimizer

from trainer_core import signals
from trainer_core.callback_queries import (
    callback_overrides,
    check_state_keys,
    checkpoint_callbacks,
    has_timer,
    progress_bar_callback,
)
from trainer_core.checkpoint.restore import restore_module_and_callbacks
from trainer_core.checkpoint.save import dump_checkpoint
from trainer_core.config import TrainerConfig
from trainer_core.connectors import (
    configure_callbacks,
    configure_loggers,
    configure_torch_backends,
    merge_module_callbacks,
    select_plugin,
    split_plugins,
)
from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException, _TunerExitException
from trainer_core.hooks import BatchHooks, HookRunner
from trainer_core.loops import FitLoop, Progress, run_evaluation, run_predict
from trainer_core.loops.evaluation import PredictLoop
from trainer_core.metrics import Metrics
from trainer_core.module import LightningModule
from trainer_core.optim import LightningOptimizer, LRSchedulerConfig
from trainer_core.precision import Precision, precision_from
from trainer_core.profilers import Profiler, is_active, resolve_profiler
from trainer_core.run_state import CheckpointParts
from trainer_core.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from trainer_core.utilities import launcher_restart_count, rank_zero_info, rank_zero_only, rank_zero_warn
from trainer_core.utilities.compile import is_compiled, is_compiled_lightning_module, unwrap_compiled_module
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from trainer_core.callbacks import Callback

_logger = logging.getLogger("trainer_core")

STAGES = ("fit", "validate", "test", "predict")


class Trainer:
    """Runs a ``LightningModule``'s loops through a training-type plugin."""

    #: A pre-empted SLURM job's requeue request (``trainer_core.signals``), acted on once ``fit`` has torn
    #: the run down; ``None``: nothing to requeue.
    _requeue_on_exit: Optional[signals.Preempted] = None

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: Any = None,
        devices: Union[int, str, Sequence[int]] = "auto",
        num_nodes: int = 1,
        plugins: Any = None,
        precision: Union[str, int, Precision] = "32-true",
        logger: Any = None,
        callbacks: Optional[Union[Callback, list[Callback]]] = None,
        fast_dev_run: Union[bool, int] = False,
        max_epochs: Optional[int] = None,
        min_epochs: Optional[int] = None,
        max_steps: int = -1,
        min_steps: Optional[int] = None,
        max_time: Optional[Union[str, timedelta, dict[str, int]]] = None,
        limit_train_batches: Optional[Union[int, float]] = None,
        limit_val_batches: Optional[Union[int, float]] = None,
        limit_test_batches: Optional[Union[int, float]] = None,
        limit_predict_batches: Optional[Union[int, float]] = None,
        overfit_batches: Union[int, float] = 0.0,
        val_check_interval: Optional[Union[int, float]] = None,
        check_val_every_n_epoch: Optional[int] = 1,
        num_sanity_val_steps: Optional[int] = None,
        log_every_n_steps: Optional[int] = None,
        enable_checkpointing: Optional[bool] = None,
        enable_progress_bar: Optional[bool] = None,
        enable_model_summary: Optional[bool] = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: Optional[Union[int, float]] = None,
        gradient_clip_algorithm: Optional[str] = None,
        deterministic: Optional[bool] = None,
        benchmark: Optional[bool] = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        detect_anomaly: bool = False,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        default_root_dir: Optional[Union[str, os.PathLike]] = None,
        optimizer_in_backward: bool = False,
        profiler: Optional[Union[Profiler, str]] = None,
        barebones: bool = False,
    ) -> None:

        #: ``Trainer(barebones=True)``: every feature that costs speed is off, to measure the Trainer's own overhead.
        self.barebones = barebones
        if barebones:
            _refuse_with_barebones(
                enable_checkpointing=enable_checkpointing,
                logger=logger,
                enable_progress_bar=enable_progress_bar,
                log_every_n_steps=log_every_n_steps,
                enable_model_summary=enable_model_summary,
                num_sanity_val_steps=num_sanity_val_steps,
                fast_dev_run=fast_dev_run,
                detect_anomaly=detect_anomaly,
                profiler=profiler,
            )
            enable_checkpointing = enable_progress_bar = enable_model_summary = logger = False
            num_sanity_val_steps = 0
            log_every_n_steps = None  # set to 0 once the config is checked
        # Lightning's ``plugins=[...]``: a training-type plugin, a CheckpointIO, an environment and a
        # Precision, each put where it belongs; everything the user passed is checked before anything starts.
        parts = split_plugins(plugins, strategy, precision)
        self.plugin = select_plugin(accelerator, parts, devices, num_nodes)
        self.accelerator = accelerator
        self.num_nodes = num_nodes
        self.devices = devices
        self.plugin.precision = precision_from(parts.precision, self.plugin.root_device.type)
        self.plugin.precision.check_device(self.plugin.root_device)

        config = TrainerConfig(
            fast_dev_run=fast_dev_run,
            max_epochs=max_epochs,
            min_epochs=min_epochs,
            max_steps=max_steps,
            min_steps=min_steps,
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches,
            overfit_batches=overfit_batches,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            num_sanity_val_steps=num_sanity_val_steps,
            log_every_n_steps=log_every_n_steps,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            deterministic=deterministic,
            benchmark=benchmark,
            inference_mode=inference_mode,
            use_distributed_sampler=use_distributed_sampler,
            detect_anomaly=detect_anomaly,
            sync_batchnorm=sync_batchnorm,
            reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs,
            enable_model_summary=enable_model_summary,
            optimizer_in_backward=optimizer_in_backward,
            timed=max_time is not None or has_timer(callbacks),
        )
        # Plain attributes under Lightning's names (``trainer.max_steps``...), not properties: the loops
        # read several of them on every step, and the tuner and callbacks change some during a run.
        vars(self).update(config.attributes())
        if barebones:
            # Lightning's value: nothing reaches a logger (there is none, and ``self.log`` is off).
            self.log_every_n_steps = 0
        if self.optimizer_in_backward:
            self._check_optimizer_in_backward()

        self._default_root_dir = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()
        # ``fast_dev_run`` runs without loggers (Lightning's rule).
        self.loggers = configure_loggers(False if fast_dev_run else logger, self._default_root_dir)
        self.callbacks: list[Callback] = configure_callbacks(
            callbacks,
            enable_checkpointing=True if enable_checkpointing is None else enable_checkpointing,
            enable_progress_bar=True if enable_progress_bar is None else enable_progress_bar,
            enable_model_summary=self.enable_model_summary,
            max_time=max_time,
        )
        # ``Trainer(profiler=...)``; a PassThroughProfiler (records nothing) when not asked for, so that
        # ``trainer.profiler.profile("name")`` in user code always works.
        self.profiler: Profiler = resolve_profiler(profiler)
        # Torch's global switches change once every argument has been accepted.
        configure_torch_backends(self.deterministic, self.benchmark)

        # State of the run.
        self.state_stage: Optional[str] = None
        self._running = False  # inside an entry point (Lightning resets its stage after one)
        self._status = TrainerStatus.INITIALIZING
        self.sanity_checking = False
        self.validating_in_fit = False
        self.should_stop = False
        self.interrupted = False
        # Whether the last fit ended on a pre-emption signal (every rank saved and stopped).
        self.preempted = False
        self.num_training_batches: Union[int, float] = float("inf")
        self.num_val_batches: list[Union[int, float]] = []
        self.num_test_batches: list[Union[int, float]] = []
        self.num_predict_batches: list[Union[int, float]] = []
        self.val_check_batch: Union[int, float] = float("inf")
        self.train_dataloader: Any = None
        self.val_dataloaders: Any = None
        self.test_dataloaders: Any = None
        self.predict_dataloaders: Any = None
        self.datamodule: Optional[LightningDataModule] = None
        self.lightning_module: Optional[LightningModule] = None
        self.ckpt_path: Optional[str] = None
        # The running entry point's ``weights_only=False``: its ckpt_path may be unpickled whole.
        self._trusted_ckpt = False
        #: Why ``fit`` resumes although it was given no ``ckpt_path`` (a launcher's restart), for its messages.
        self.resume_reason = ""
        self.fit_loop: Optional[FitLoop] = None
        # The last ``predict``'s PredictLoop (trainer_core.loops.evaluation): what prediction writers read;
        # an empty one before the first (Lightning's has no indices, no predictions then).
        self.predict_loop: Any = PredictLoop()
        self.lightning_optimizers: list[LightningOptimizer] = []

        # The loop state (counters, positions, the resume plan), the way to the user's hooks, and
        # where logged values go: loops, checkpoint code, plugins and callbacks use these.
        self.progress = Progress()
        self.hook_runner = HookRunner(self)
        self.metrics = Metrics(self)

    # ------------------------------------------------------------------ entry points
    def fit(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Optional[LightningDataModule] = None,
        ckpt_path: Optional[Union[str, os.PathLike]] = None,
        weights_only: Optional[bool] = None,
    ) -> None:
        """Train ``model``; with ``ckpt_path`` (a path or ``"last"``), continue the run it saved.

        ``weights_only`` is Lightning's: how ``ckpt_path`` is unpickled. ``None`` (the default) and ``True``
        read it without running code from it (trainer-core's safe loading, which also takes Lightning's
        checkpoints and the classes registered with ``register_safe_globals``); a file whose
        hyper-parameters hold other objects (an ``nn.Module``, a ``functools.partial``) is refused with an
        error naming it. ``False`` unpickles the whole file, which runs any code it names: only for
        files you trust.
        """
        self._trusted_ckpt = weights_only is False
        model = _check_module(model, "fit")
        if isinstance(train_dataloaders, LightningDataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise MisconfigurationException("fit: pass either dataloaders or `datamodule=`, not both.")
        self.plugin.connect(model)
        self.preempted = False
        self.resume_reason = ""
        self.progress.start_fit()
        self.train_dataloader = None
        self.fit_loop = FitLoop(self, train_dataloaders, val_dataloaders, ckpt_path)
        self._run_stage("fit", model, datamodule, self.fit_loop.run)
        if self.preempted:
            # Every rank saved the same step and tore down cleanly: end the job, successfully (a SLURM job
            # whose requeue signal stopped it is requeued first).
            requeue, self._requeue_on_exit = self._requeue_on_exit, None
            signals.exit_preempted(requeue, self.is_global_zero)

    def validate(
        self,
        model: Optional[LightningModule] = None,
        dataloaders: Any = None,
        ckpt_path: Optional[Union[str, os.PathLike]] = None,
        verbose: bool = True,
        datamodule: Optional[LightningDataModule] = None,
        weights_only: Optional[bool] = None,
    ) -> list[dict[str, float]]:
        """Run the validation loop once; returns one dict of epoch metrics per dataloader.

        ``weights_only``: how ``ckpt_path`` is unpickled, as in :meth:`fit`.
        """
        self._trusted_ckpt = weights_only is False
        return self._evaluate("validate", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(
        self,
        model: Optional[LightningModule] = None,
        dataloaders: Any = None,
        ckpt_path: Optional[Union[str, os.PathLike]] = None,
        verbose: bool = True,
        datamodule: Optional[LightningDataModule] = None,
        weights_only: Optional[bool] = None,
    ) -> list[dict[str, float]]:
        """Run the test loop once; returns one dict of epoch metrics per dataloader.

        ``weights_only``: how ``ckpt_path`` is unpickled, as in :meth:`fit`.
        """
        self._trusted_ckpt = weights_only is False
        return self._evaluate("test", model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(
        self,
        model: Optional[LightningModule] = None,
        dataloaders: Any = None,
        datamodule: Optional[LightningDataModule] = None,
        return_predictions: Optional[bool] = None,
        ckpt_path: Optional[Union[str, os.PathLike]] = None,
        weights_only: Optional[bool] = None,
    ) -> Optional[list[Any]]:
        """Run ``predict_step`` over the data; returns the predictions (a list per dataloader if several).

        ``weights_only``: how ``ckpt_path`` is unpickled, as in :meth:`fit`.
        """
        self._trusted_ckpt = weights_only is False
        ckpt_path = self._default_ckpt_path("predict", model, ckpt_path)
        model = self._model_for("predict", model)
        if isinstance(dataloaders, LightningDataModule):
            datamodule, dataloaders = dataloaders, None
        self.plugin.connect(model)
        return self._run_stage(
            "predict",
            model,
            datamodule,
            partial(run_predict, self, dataloaders, ckpt_path, return_predictions),
        )

    def _evaluate(
        self,
        stage: str,
        model: Optional[LightningModule],
        dataloaders: Any,
        ckpt_path: Any,
        verbose: bool,
        datamodule: Optional[LightningDataModule],
    ) -> list[dict[str, float]]:
        ckpt_path = self._default_ckpt_path(stage, model, ckpt_path)
        model = self._model_for(stage, model)
        if isinstance(dataloaders, LightningDataModule):
            datamodule, dataloaders = dataloaders, None
        self.plugin.connect(model)
        return self._run_stage(
            stage,
            model,
            datamodule,
            partial(run_evaluation, self, stage, dataloaders, ckpt_path, verbose),
        )

    def _default_ckpt_path(self, stage: str, model: Optional[LightningModule], ckpt_path: Any) -> Any:
        """Lightning's rule: without a model, evaluate the best checkpoint of the previous ``fit``."""
        if ckpt_path is not None or model is not None or self.lightning_module is None:
            return ckpt_path
        callback = self.checkpoint_callback
        if callback is not None and getattr(callback, "best_model_path", ""):
            _logger.info(f"`trainer.{stage}()` without a model: using the best checkpoint of the last fit.")
            return "best"
        return None

    def _model_for(self, stage: str, model: Optional[LightningModule]) -> LightningModule:
        if model is None:
            if self.lightning_module is None:
                raise MisconfigurationException(
                    f"`trainer.{stage}()` needs a model: pass one, or call it after `trainer.fit(model)`."
                )
            return self.lightning_module
        return _check_module(model, stage)

    def _run_stage(
        self,
        stage: str,
        model: LightningModule,
        datamodule: Optional[LightningDataModule],
        body: Callable[[], Any],
    ) -> Any:
        unsupported = self.plugin.compiled_module_unsupported
        if unsupported and is_compiled_lightning_module(model):
            raise MisconfigurationException(
                f"`trainer.{stage}(torch.compile(model))` under {type(self.plugin).__name__}: {unsupported}."
            )
        check_state_keys(self.callbacks)
        if self.barebones:
            rank_zero_info(f"`trainer.{stage}` starts in barebones mode: no progress bar shows that it runs.")
        self.state_stage = stage
        self._running = True
        self._status = TrainerStatus.RUNNING
        self.should_stop = False
        self.interrupted = False
        self.lightning_module = model
        self.datamodule = datamodule
        if datamodule is not None:
            datamodule.trainer = self
        model.trainer = self
        # The plugin may start processes that each run ``body`` (spawn pickles it: no lambdas here).
        self.plugin.trainer = self
        return self.plugin.launch(self._guarded, stage, body)

    def _guarded(self, stage: str, body: Callable[[], Any]) -> Any:
        try:
            with signals.handle_preemption(stage, self) as preemption:
                if self.fit_loop is not None:
                    self.fit_loop.preemption = preemption
                self._setup_profiler(stage)
                self._setup_run(stage)
                result = body()
                self._teardown(stage)
                self._status = TrainerStatus.FINISHED
                return result
        except _TunerExitException:
            # A Tuner's search is done (trainer_core.tuner): the run ends here, torn down as a finished one.
            self._teardown(stage)
            self._status = TrainerStatus.FINISHED
            return None
        except signals.Preempted as exc:
            self._status = TrainerStatus.INTERRUPTED
            signals.finish_preempted(self, exc)
            self._requeue_on_exit = exc if exc.requeue is not None else None
            self._teardown(stage, finalize_loggers=False)  # finalised as pre-empted already
            return None
        except BaseException as exc:
            self.interrupted = isinstance(exc, KeyboardInterrupt)
            self._status = TrainerStatus.INTERRUPTED
            module = self.lightning_module
            for cb in self.callbacks:
                if callback_overrides(cb, "on_exception"):
                    cb.on_exception(self, module, exc)
            try:
                # Lightning's rule: after an error only the plugin is torn down, not the user's hooks.
                self.plugin.on_exception(exc)
                self.plugin.teardown()
            except Exception as cleanup_error:
                # The user needs the first error; one from the cleanup after it is only reported.
                rank_zero_warn(f"Cleaning up after `{stage}` failed also raised: {cleanup_error!r}")
            finally:
                self.metrics.results = None
                for lg in self.loggers:
                    lg.finalize("failed")
            raise
        finally:
            self._running = False
            self.sanity_checking = False
            if self.fit_loop is not None:
                self.fit_loop.preemption = None

    # ------------------------------------------------------------------ run setup and teardown
    def _setup_run(self, stage: str) -> None:
        """Hooks in Lightning's order: callbacks, data, setup, model, plugin (optimizers)."""
        module = self.lightning_module
        assert module is not None
        runner = self.hook_runner
        runner.current_fx = "configure_callbacks"
        extra = module.configure_callbacks()
        if extra:
            self.callbacks = merge_module_callbacks(self.callbacks, extra)
            check_state_keys(self.callbacks)
        self.plugin.setup_environment()
        fit_loop = self.fit_loop
        if stage == "fit" and fit_loop is not None and fit_loop.ckpt_path is None:
            self._resume_after_restart(fit_loop)
        if self.local_rank == 0:
            if self.datamodule is not None and is_overridden(
                "prepare_data", self.datamodule, LightningDataModule
            ):
                self.datamodule.prepare_data()
            runner.call_module("prepare_data")
        self.plugin.barrier("prepare_data")
        if self.datamodule is not None:
            self.datamodule.setup(stage=stage)
        runner.call_callbacks("setup", stage=stage)
        runner.call_module("setup", stage=stage)
        with self.plugin.configuring_model():
            runner.call_module("configure_model")
        if stage == "fit" and fit_loop is not None and fit_loop.ckpt_path is not None:
            fit_loop.pending_restore = None
            if not self.plugin.restore_checkpoint_after_setup:
                # Lightning's order: the module's and the callbacks' checkpoint hooks before configure_optimizers.
                fit_loop.pending_restore = restore_module_and_callbacks(
                    self.checkpoint_parts(), fit_loop.ckpt_path
                )
        # Each run starts with no metrics: after `test`, `callback_metrics` holds what the test logged (Lightning's rule).
        self.metrics.clear()
        self.plugin.setup(self)
        if stage == "fit":
            self.plugin.precision.setup(self.plugin.grad_scaler)
            self.plugin.precision.check_optimizers(self.plugin.optimizers)
        self.lightning_optimizers = [LightningOptimizer(opt, self.plugin) for opt in self.plugin.optimizers]
        if not module.automatic_optimization:
            for lopt in self.lightning_optimizers:
                lopt._on_step = self._count_manual_step
        if stage == "fit":
            self._check_optimization(module)
        runner.batch = BatchHooks(self, module, self.callbacks)
        if stage == "fit" and self.optimizer_in_backward:
            self._check_module_for_optimizer_in_backward(module)
            self.plugin.setup_optimizer_in_backward()
        runner.after_closure = runner.make_after_closure(module)
        self.metrics.train_results.plugin = self.plugin

    def _resume_after_restart(self, fit_loop: FitLoop) -> None:
        """A job its launcher restarted (torchrun after a failure, a requeued SLURM job) continues where the
        attempt before it stopped, from the newest complete checkpoint every rank sees (``"last"``).

        Each node's launcher counts its own restarts (under torchrun a node that joined counts 0), so the
        ranks agree first: one restarted rank means the job was restarted.
        """
        launcher, restarts = launcher_restart_count()
        if self.world_size > 1 and (
            "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_RESTART_COUNT" in os.environ
        ):
            launcher, restarts = max(
                self.plugin.all_gather_object((launcher, restarts)), key=lambda seen: seen[1]
            )
        if restarts:
            fit_loop.ckpt_path = "last"
            self.resume_reason = f"restart {restarts} of this job by {launcher}"

    def _count_manual_step(self) -> None:
        self.progress.global_step += 1

    def _check_optimization(self, module: LightningModule) -> None:
        step = inspect.unwrap(type(module).training_step)
        if "optimizer_idx" in inspect.getfullargspec(step).args:
            # Lightning 1.x's way to several optimizers, which Lightning 2 refuses too (a keyword-only one is not asked).
            raise MisconfigurationException(
                f"{type(module).__name__}.training_step takes `optimizer_idx`, Lightning 1.x's way to several "
                "optimizers, which no longer exists: remove the argument, set `self.automatic_optimization = False` "
                "and step each optimizer from `opt1, opt2 = self.optimizers()` in `training_step`."
            )
        if module.automatic_optimization and len(self.plugin.optimizers) > 1:
            raise MisconfigurationException(
                f"configure_optimizers returned {len(self.plugin.optimizers)} optimizers: several optimizers need "
                "manual optimization. Set `self.automatic_optimization = False` and step each in `training_step`."
            )
        if not module.automatic_optimization:
            if self.accumulate_grad_batches != 1:
                raise MisconfigurationException(
                    "Trainer(accumulate_grad_batches) does not apply under manual optimization; accumulate in "
                    "`training_step` by stepping the optimizer every N batches."
                )
            if self.gradient_clip_val:
                raise MisconfigurationException(
                    "Trainer(gradient_clip_val) does not apply under manual optimization; call "
                    "`self.clip_gradients(opt, gradient_clip_val=...)` in `training_step`."
                )
        if not self.plugin.defines_step("training_step"):
            raise MisconfigurationException(
                f"{type(module).__name__} does not define `training_step`; `Trainer.fit` needs it to compute the loss."
            )

    def _check_optimizer_in_backward(self) -> None:
        """Refuse, at construction, what cannot work when each parameter steps during backward."""
        reason = self.plugin.optimizer_in_backward_unsupported
        if reason:
            raise MisconfigurationException(
                f"Trainer(optimizer_in_backward=True) does not work with {type(self.plugin).__name__}: {reason}."
            )
        if self.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"Trainer(optimizer_in_backward=True) with accumulate_grad_batches={self.accumulate_grad_batches}: "
                "accumulation keeps gradients across batches, but stepping in backward consumes and frees each "
                "gradient as soon as it is computed. Use one or the other (a larger batch instead of accumulation)."
            )
        if self.gradient_clip_val:
            raise MisconfigurationException(
                "Trainer(optimizer_in_backward=True) with gradient_clip_val: clipping needs the gradients of the "
                "whole model at once (their total norm), which stepping in backward never holds. Drop "
                "gradient_clip_val or use optimizer_in_backward=False."
            )
        if self.plugin.precision.scales_loss:
            raise MisconfigurationException(
                f"Trainer(optimizer_in_backward=True) with precision={self.plugin.precision.name!r}: a loss "
                "scaler must check every gradient for inf/NaN before any parameter steps. Use 'bf16-mixed' or "
                "'32-true'."
            )

    def _check_module_for_optimizer_in_backward(self, module: LightningModule) -> None:
        def refuse(what: str, why: str) -> MisconfigurationException:
            return MisconfigurationException(f"Trainer(optimizer_in_backward=True): {what} {why}")

        if not module.automatic_optimization:
            raise refuse(
                f"{type(module).__name__} uses manual optimization, which steps its optimizers in training_step;",
                "stepping in backward steps them itself. Use automatic optimization or optimizer_in_backward=False.",
            )
        gradients_gone = "runs after backward, when stepping in backward has already consumed every gradient."
        for hook in ("optimizer_step", "on_before_optimizer_step", "configure_gradient_clipping"):
            if is_overridden(hook, module, LightningModule):
                raise refuse(f"{type(module).__name__}.{hook}", gradients_gone)
        for cb in self.callbacks:
            if callback_overrides(cb, "on_before_optimizer_step"):
                raise refuse(f"the callback {type(cb).__name__}.on_before_optimizer_step", gradients_gone)

    def _setup_profiler(self, stage: str) -> None:
        """Whether this run profiles, decided once: hooks and loop steps are wrapped only when it does."""
        runner = self.hook_runner
        runner.profiler = None
        profiler = self.profiler
        if not is_active(profiler):
            return
        # Several processes: each profiles its own work into its own file (the rank ends the name).
        rank = self.global_rank if self.world_size > 1 else None
        profiler._lightning_module = self.lightning_module  # PyTorchProfiler names the module's layers
        profiler.setup(stage=stage, local_rank=rank, log_dir=self.log_dir)
        runner.profiler = profiler

    def _teardown(self, stage: str, finalize_loggers: bool = True) -> None:
        runner = self.hook_runner
        runner.call_callbacks("teardown", stage=stage)
        if self.lightning_module is not None:
            runner.call_module("teardown", stage=stage)
        if self.datamodule is not None:
            self.datamodule.teardown(stage=stage)
        self.plugin.teardown()
        self.metrics.results = None
        runner.current_fx = None
        if finalize_loggers:
            # After every stage, as Lightning: a logger flushes and closes what it wrote for this one.
            for lg in self.loggers:
                lg.finalize("success")
        if runner.profiler is not None:
            # Lightning's place for the report: after the teardown hooks, on every rank (rank 0 prints).
            runner.profiler = None
            self.profiler.describe()

    # ------------------------------------------------------------------ metrics
    @property
    def callback_metrics(self) -> dict[str, Any]:
        """Every metric logged so far (latest step values and epoch aggregates), for callbacks."""
        metrics = self.metrics
        metrics.take_step_values()
        return metrics.callback

    @property
    def logged_metrics(self) -> dict[str, Any]:
        """The metrics last sent to the loggers."""
        return self.metrics.logged

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The metrics logged with ``prog_bar=True``, as numbers."""
        self.metrics.take_step_values()
        return self.metrics.progress_bar

    # ------------------------------------------------------------------ properties users read
    @property
    def current_epoch(self) -> int:
        """Epochs finished (inside an epoch: those before it)."""
        return self.progress.current_epoch

    @current_epoch.setter
    def current_epoch(self, value: int) -> None:
        self.progress.current_epoch = value

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.progress.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.progress.global_step = value

    @property
    def batch_idx(self) -> int:
        """The index of the training batch being processed in its epoch."""
        return self.progress.batch_idx

    @property
    def total_batch_idx(self) -> int:
        """Training batches processed in this run, over every epoch."""
        return self.progress.total_batch_idx

    @property
    def is_last_batch(self) -> bool:
        """Whether the training batch being processed is the last of its epoch (Lightning's name)."""
        return self.progress.is_last_batch

    @property
    def batches_that_stepped(self) -> int:
        """Training batches that ended in an optimizer step: the step loggers record metrics at."""
        return self.progress.batches_that_stepped

    @property
    def strategy(self) -> Any:
        """Lightning's name for the plugin."""
        return self.plugin

    @property
    def precision(self) -> str:
        return self.plugin.precision.name

    @property
    def precision_plugin(self) -> Precision:
        """Lightning's name for the run's precision object (``trainer.precision_plugin.scaler``)."""
        return self.plugin.precision

    @property
    def model(self) -> Optional[nn.Module]:
        return self.plugin.model

    @property
    def optimizers(self) -> list[Optimizer]:
        return self.plugin.optimizers

    @property
    def lr_scheduler_configs(self) -> list[LRSchedulerConfig]:
        return self.plugin.lr_scheduler_configs

    @property
    def global_rank(self) -> int:
        return self.plugin.global_rank

    @property
    def local_rank(self) -> int:
        return self.plugin.local_rank

    @property
    def node_rank(self) -> int:
        return self.plugin.node_rank

    @property
    def world_size(self) -> int:
        return self.plugin.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.plugin.is_global_zero

    @property
    def num_devices(self) -> int:
        return max(1, self.plugin.world_size // max(1, self.num_nodes))

    @property
    def default_root_dir(self) -> str:
        return self._default_root_dir

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> Optional[str]:
        if self.logger is not None:
            return getattr(self.logger, "log_dir", None) or self.logger.save_dir
        return self._default_root_dir

    @property
    def state(self) -> TrainerState:
        """Lightning's ``trainer.state``: the entry point (``fn``), what runs in it now (``stage``) and ``status``."""
        stage = None
        if self._running:
            if self.sanity_checking:
                stage = RunningStage.SANITY_CHECKING
            elif self.validating_in_fit:
                stage = RunningStage.VALIDATING
            else:
                stage = RunningStage("train" if self.state_stage == "fit" else self.state_stage)
        fn = TrainerFn(self.state_stage) if self.state_stage else None
        return TrainerState(status=self._status, fn=fn, stage=stage)

    @property
    def training(self) -> bool:
        """Whether training batches run now: in ``fit``, outside its sanity check and validation (Lightning's
        running stage: one of ``training``, ``sanity_checking``, ``validating`` holds at a time)."""
        fitting = self._running and self.state_stage == "fit"
        return fitting and not self.sanity_checking and not self.validating_in_fit

    @property
    def validating(self) -> bool:
        return self.validating_in_fit or (self._running and self.state_stage == "validate")

    @property
    def testing(self) -> bool:
        return self.state_stage == "test"

    @property
    def predicting(self) -> bool:
        return self.state_stage == "predict"

    @property
    def checkpoint_callbacks(self) -> list[Callback]:
        return checkpoint_callbacks(self.callbacks)

    @property
    def checkpoint_callback(self) -> Optional[Callback]:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def progress_bar_callback(self) -> Optional[Callback]:
        return progress_bar_callback(self.callbacks)

    @property
    def estimated_stepping_batches(self) -> Union[int, float]:
        """Optimizer steps the fit will take (for schedulers such as OneCycleLR)."""
        if self.train_dataloader is None and self.state_stage == "fit" and self.fit_loop is not None:
            self.fit_loop.setup_train_dataloader()
        if math.isinf(self.num_training_batches) or self.max_epochs == -1:
            by_epochs: Union[int, float] = float("inf")
        else:
            by_epochs = math.ceil(self.num_training_batches / self.accumulate_grad_batches) * self.max_epochs
        return by_epochs if self.max_steps == -1 else min(by_epochs, self.max_steps)

    @contextlib.contextmanager
    def init_module(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """Create the module inside this to build its tensors where the plugin wants them (Lightning's name).

        On this process's device, in the precision's dtype (``"bf16-true"``: bfloat16). With
        ``empty_init=True`` sharding plugins (``FSDPPlugin``, ``ModelParallelPlugin``) create them on the
        meta device, without memory; each rank then allocates and initialises (``reset_parameters``)
        only its own shards when the run starts.
        """
        with self.plugin.tensor_init_context(empty_init), self.plugin.precision.tensor_init_context():
            yield

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        filepath: Union[str, os.PathLike],
        weights_only: bool = False,
        storage_options: Optional[Any] = None,
    ) -> None:
        """Write a checkpoint of the run to ``filepath`` (every rank must call this)."""
        if self.lightning_module is None:
            raise MisconfigurationException(
                "save_checkpoint needs a model: call it during or after `trainer.fit(model)`."
            )
        unavailable = self.plugin.full_checkpoint_unavailable
        if unavailable and not weights_only:
            raise MisconfigurationException(
                f"trainer.save_checkpoint({os.fspath(filepath)!r}): {unavailable}."
            )
        checkpoint = dump_checkpoint(self.checkpoint_parts(), weights_only)
        self.plugin.save_checkpoint(checkpoint, os.fspath(filepath), storage_options=storage_options)
        self.plugin.barrier("save_checkpoint")

    def checkpoint_parts(self) -> CheckpointParts:
        """The run's stateful parts as the checkpoint code saves and restores them (it never sees the Trainer).

        Assembled when a checkpoint is written or read, so each part is the current one. Callbacks'
        ``on_save_checkpoint`` / ``on_load_checkpoint`` still receive the Trainer, through the hook runner.
        """
        return CheckpointParts(
            module=self.lightning_module,
            plugin=self.plugin,
            progress=self.progress,
            hooks=self.hook_runner,
            callbacks=self.callbacks,
            datamodule=self.datamodule,
            train_dataloader=self.fit_loop.train_loader if self.fit_loop is not None else None,
            accumulate_grad_batches=self.accumulate_grad_batches,
            callback_metrics=self._read_callback_metrics,
            checkpoint_callbacks=self.checkpoint_callbacks,
            resume_reason=self.resume_reason,
            restored_from=self._record_ckpt_path,
            trusted_checkpoint=self._trusted_ckpt,
        )

    def _read_callback_metrics(self) -> dict[str, Any]:
        return self.callback_metrics

    def _record_ckpt_path(self, path: str) -> None:
        self.ckpt_path = path

    @rank_zero_only
    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs)


class BarebonesConflict(MisconfigurationException, ValueError):
    """An argument that turns on a feature ``Trainer(barebones=True)`` turns off.

    A ``ValueError`` too, as Lightning raises, so code written for Lightning catches it the same way.
    """


def _given(value: Any) -> bool:
    return value is not None and value is not False and value != 0


# Each argument barebones mode refuses: the feature it turns on, and when a value asks for it (Lightning's rules).
_BAREBONES_OFF: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "enable_checkpointing": ("Checkpointing", bool),
    "logger": ("Logging", lambda value: value is not None and value is not False),
    "enable_progress_bar": ("The progress bar", bool),
    "log_every_n_steps": ("Logging", _given),
    "enable_model_summary": ("The model summary", bool),
    "num_sanity_val_steps": ("The sanity check", _given),
    "fast_dev_run": ("A development run", _given),
    "detect_anomaly": ("Anomaly detection", bool),
    "profiler": ("Profiling", lambda value: value is not None),
}


def _refuse_with_barebones(**given: Any) -> None:
    """Refuse, naming it, the first argument that asks for a feature barebones mode turns off."""
    for name, value in given.items():
        feature, asks_for_it = _BAREBONES_OFF[name]
        if asks_for_it(value):
            raise BarebonesConflict(
                f"Trainer(barebones=True, {name}={value!r}): {feature} costs speed, so barebones mode turns it "
                f"off. Leave `{name}` out, or drop barebones=True."
            )
    rank_zero_info(
        "Trainer(barebones=True): checkpointing, loggers and `self.log`, the progress bar, the model summary, "
        "the sanity check, fast_dev_run, anomaly detection and profiling are off, to measure the Trainer's "
        "own overhead."
    )


def _check_module(model: Any, stage: str) -> LightningModule:
    # `torch.compile(module)`: the module itself, its steps compiled (utilities/compile.py).
    model = unwrap_compiled_module(model)
    if not isinstance(model, LightningModule):
        if is_compiled(model):
            raise MisconfigurationException(
                f"`trainer.{stage}()` needs a trainer_core.LightningModule, got {type(model._orig_mod).__name__} "
                "compiled by torch.compile. Compile the LightningModule itself, or the submodule inside it."
            )
        raise MisconfigurationException(
            f"`trainer.{stage}()` needs a trainer_core.LightningModule, got {type(model).__name__}."
        )
    return model
