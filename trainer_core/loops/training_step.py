"""One training batch: the hot path, as a small class with one method per way of stepping.

Everything that can be decided once per epoch is decided in ``__init__``: hooks nobody overrides
are skipped by a truth test on an empty tuple, the default ``optimizer_step``/``optimizer_zero_grad``
are called directly, and no dict is built per step except the ``{"loss": ...}`` that
``on_train_batch_end`` receives. Hook order, loss normalisation under accumulation and scheduler
stepping follow Lightning.

``run(batch, batch_idx, is_last)`` is bound to :meth:`manual` or :meth:`automatic`; an automatic
step updates the parameters through one of :meth:`_update_direct` (torch's optimizer, no closure
machinery), :meth:`_update_in_backward` (parameters step inside backward),
:meth:`_update_custom` (the module's ``optimizer_step``) or :meth:`_update_by_plugin`; the
forward and backward run in :meth:`_closure`, or the plugin's schedule in :meth:`_plugin_closure`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor

from trainer_core.errors import MisconfigurationException
from trainer_core.hooks import step_caller
from trainer_core.loops.schedulers import update_lr_schedulers
from trainer_core.module import LightningModule
from trainer_core.profilers.base import Profiler, profiled
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from trainer_core.run_state import RunState


class TrainingStep:
    """The per-batch training function of one epoch."""

    __slots__ = (
        "acc",
        "backward",
        "batch",
        "batch_idx",
        "closure",
        "custom_zero_grad",
        "epoch_schedulers",
        "forward_backward",
        "in_backward",
        "lightning_optimizer",
        "module",
        "needs_context",
        "no_sync",
        "optimizer",
        "output",
        "plain_backward",
        "plugin",
        "plugin_backward",
        "plugin_optimizer_step",
        "precision",
        "progress",
        "run",
        "runner",
        "step_schedulers",
        "trainer",
        "training_step",
        "update",
        "votes",
        "want_outputs",
        "zero_grad_hooks",
    )

    def __init__(self, trainer: RunState) -> None:
        from trainer_core.plugins import TrainingTypePlugin

        module = trainer.lightning_module
        assert module is not None
        plugin = trainer.plugin
        self.trainer = trainer
        self.module = module
        self.progress = trainer.progress
        self.runner = trainer.hook_runner
        self.precision = precision = plugin.precision
        self.needs_context = precision.forward_context_needed
        self.training_step = step_caller(trainer, "training_step", plugin.training_step)
        self.batch: Any = None
        self.batch_idx = 0
        self.output: Any = None
        if not module.automatic_optimization:
            self.run = self.manual
            if self.runner.profiler is not None:
                self._profile(self.runner.profiler, plugin)
            return

        hooks = self.runner.batch
        assert hooks is not None
        self.optimizer = optimizer = plugin.optimizers[0]
        self.lightning_optimizer = trainer.lightning_optimizers[0]
        self.acc = trainer.accumulate_grad_batches
        self.zero_grad_hooks = hooks.on_before_zero_grad
        self.custom_zero_grad = hooks.optimizer_zero_grad
        self.want_outputs = bool(hooks.on_train_batch_end)
        self.no_sync = plugin.no_backward_sync
        self.plugin = plugin
        self.votes = plugin.votes_on_steps
        configs = plugin.lr_scheduler_configs
        self.step_schedulers = any(c.interval == "step" and not c.reduce_on_plateau for c in configs)
        self.epoch_schedulers = any(c.interval == "epoch" and not c.reduce_on_plateau for c in configs)

        # Each layer below is skipped when it would do nothing, so the default step costs about what
        # a hand-written loop does: the module's own training_step, loss.backward(), optimizer.step().
        if type(plugin).training_step is TrainingTypePlugin.training_step:
            self.training_step = step_caller(trainer, "training_step", module.training_step)
        self.plain_backward = (
            type(plugin).backward is TrainingTypePlugin.backward
            and not precision.scales_loss
            and not precision.custom_backward
            and not hooks.on_before_backward
            and not hooks.on_after_backward
            and not is_overridden("backward", module, LightningModule)
        )
        self.backward = self.plugin_backward = plugin.backward
        # Torch's built-in optimizers give the same result whether they call the closure or we call
        # it first; calling it ourselves saves the closure machinery. LBFGS re-evaluates it, so it keeps it.
        direct = (
            not hooks.optimizer_step
            and type(plugin).optimizer_step is TrainingTypePlugin.optimizer_step
            and not precision.scales_loss
            and not precision.custom_optimizer_step
            and type(optimizer).__module__.startswith("torch.optim.")
            and not isinstance(optimizer, torch.optim.LBFGS)
        )
        # Under optimizer_in_backward the parameters step inside backward, from their gradient hooks,
        # with the hyper-parameters the optimizer holds then (a scheduler's, or set in training_step).
        self.in_backward = plugin.in_backward_optimizer
        if self.in_backward is not None:
            direct = self.plain_backward = False
            self.backward = self._synced_backward
        self.plugin_optimizer_step = plugin.optimizer_step
        # The plugin may run forward and backward together (a pipeline schedule over micro-batches).
        self.forward_backward = plugin.forward_backward()
        self.closure: Callable[[], Optional[Tensor]] = (
            self._closure if self.forward_backward is None else self._plugin_closure
        )
        if direct:
            self.update = self._update_direct
        elif self.in_backward is not None:
            self.update = self._update_in_backward
        elif hooks.optimizer_step:
            self.update = self._update_custom
        else:
            self.update = self._update_by_plugin
        self.run = self.automatic
        if self.runner.profiler is not None:
            self._profile(self.runner.profiler, plugin)

    def _profile(self, profiler: Profiler, plugin: Any) -> None:
        """With a profiler on (decided per epoch): the step's parts recorded under Lightning's names.

        ``optimizer_step`` holds the whole update (the closure's forward and backward included), as in
        Lightning. The backward goes through the plugin's ``backward`` to be recorded: the same
        arithmetic as the direct ``loss.backward()`` it replaces.
        """
        strategy = f"[Strategy]{type(plugin).__name__}"
        self.training_step = profiled(profiler, f"{strategy}.training_step", self.training_step)
        if not self.module.automatic_optimization:
            return
        self.plain_backward = False
        self.backward = profiled(profiler, f"{strategy}.backward", self.backward)
        self.update = profiled(
            profiler, f"[LightningModule]{type(self.module).__name__}.optimizer_step", self.update
        )

    # ------------------------------------------------------------------ manual optimization
    def manual(self, batch: Any, batch_idx: int, is_last: bool) -> Any:
        """The user steps the optimizers in ``training_step``; only its output is shaped here."""
        self.runner.current_fx = "training_step"
        if self.needs_context:
            with self.precision.forward_context():
                out = self.training_step(batch, batch_idx)
        else:
            out = self.training_step(batch, batch_idx)
        if isinstance(out, Tensor):
            return {"loss": out.detach()}
        return out if out is not None else {}

    # ------------------------------------------------------------------ automatic optimization
    def automatic(self, batch: Any, batch_idx: int, is_last: bool) -> Any:
        """Forward and backward; at the end of an accumulation cycle, the update and the schedulers."""
        self.batch = batch
        self.batch_idx = batch_idx
        acc = self.acc
        if acc == 1 or is_last or (batch_idx + 1) % acc == 0:
            self.update()
            if self.votes and not self.plugin.step_committed:
                return (
                    self.output
                )  # voted down (a replica group failed): not a step, for the schedulers neither
            self.progress.global_step += 1
            if self.step_schedulers:
                update_lr_schedulers(self.trainer, "step", plateau=False)
            if is_last and self.epoch_schedulers:
                update_lr_schedulers(self.trainer, "epoch", plateau=False)
        else:
            with self.no_sync():
                self.closure()
        return self.output

    def _update_direct(self) -> None:
        self.closure()
        after = self.runner.after_closure
        if after is not None:
            after(self.optimizer)
        self.optimizer.step()

    def _update_in_backward(self) -> None:
        self.closure()

    def _update_custom(self) -> None:
        self.runner.current_fx = "optimizer_step"
        self.module.optimizer_step(
            self.progress.current_epoch, self.batch_idx, self.lightning_optimizer, self.closure
        )

    def _update_by_plugin(self) -> None:
        self.plugin_optimizer_step(self.optimizer, self.closure)

    def _zero_grad(self, batch_idx: int) -> None:
        """At the first batch of an accumulation cycle: the hooks, then the module's zero_grad or the optimizer's."""
        if self.zero_grad_hooks:
            self.runner.run("on_before_zero_grad", self.zero_grad_hooks, self.optimizer)
        if self.custom_zero_grad:
            self.runner.current_fx = "optimizer_zero_grad"
            self.module.optimizer_zero_grad(self.progress.current_epoch, batch_idx, self.optimizer)
        else:
            self.optimizer.zero_grad()

    def _synced_backward(self, loss: Tensor, optimizer: Optimizer) -> Tensor:
        self.in_backward.sync()
        return self.plugin_backward(loss, optimizer)

    def _closure(self) -> Optional[Tensor]:
        batch_idx = self.batch_idx
        self.runner.current_fx = "training_step"
        if self.needs_context:
            with self.precision.forward_context():
                out = self.training_step(self.batch, batch_idx)
        else:
            out = self.training_step(self.batch, batch_idx)
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
        acc = self.acc
        if acc == 1 or batch_idx % acc == 0:
            self._zero_grad(batch_idx)
        if loss is None:
            self.output = None
            return None
        if acc > 1:
            loss = loss / acc
        if self.plain_backward:
            loss.backward()
        else:
            self.backward(loss, self.optimizer)
        if self.want_outputs:
            self.output = {"loss": loss.detach()} if extra is None else {**extra, "loss": loss.detach()}
        return loss

    def _plugin_closure(self) -> Optional[Tensor]:
        batch_idx = self.batch_idx
        acc = self.acc
        if acc == 1 or batch_idx % acc == 0:
            self._zero_grad(batch_idx)
        self.runner.current_fx = "training_step"
        forward_backward = self.forward_backward
        if self.needs_context:
            with self.precision.forward_context():
                loss = forward_backward(self.batch, batch_idx)
        else:
            loss = forward_backward(self.batch, batch_idx)
        if self.want_outputs:
            self.output = {"loss": loss}
        return loss
