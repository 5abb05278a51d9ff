"""``update_lr_schedulers`` (``trainer_core/loops/schedulers.py``) without a Trainer: Lightning's stepping rule.

The run is a ``SimpleNamespace`` with just what the function reads: the plugin's scheduler configs
(built by ``parse_optimizers`` from ``configure_optimizers``'s return forms), the loop ``progress``,
``callback_metrics`` and a hook runner whose ``call_module`` runs the ``LightningModule``'s own
``lr_scheduler_step``, so the schedulers really step. Checked: which schedulers step at which
interval and frequency, and ReduceLROnPlateau with its monitored metric. Learning rates across a
resume are ``test_schedulers.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from trainer_core import LightningModule
from trainer_core.errors import MisconfigurationException
from trainer_core.loops.progress import Progress
from trainer_core.loops.schedulers import update_lr_schedulers
from trainer_core.optim import parse_optimizers


class Hooks:
    """The hook runner's ``call_module``: records each call and runs the module's hook."""

    def __init__(self) -> None:
        self.module = LightningModule()
        self.calls: list[tuple[str, Any, Any]] = []

    def call_module(self, name: str, *args: Any) -> Any:
        self.calls.append((name, *args))
        return getattr(self.module, name)(*args)


def _optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def fake_run(returned: Any, metrics: dict[str, Any] | None = None) -> SimpleNamespace:
    """A run whose module's ``configure_optimizers`` returned ``returned``."""
    optimizers, configs = parse_optimizers(returned)
    for optimizer in optimizers:
        optimizer.step()  # a training step before any scheduler steps (torch warns otherwise)
    return SimpleNamespace(
        plugin=SimpleNamespace(lr_scheduler_configs=configs),
        progress=Progress(),
        callback_metrics=metrics if metrics is not None else {},
        hook_runner=Hooks(),
    )


def lr(scheduler: Any) -> float:
    return scheduler.optimizer.param_groups[0]["lr"]


def test_a_step_scheduler_steps_every_frequency_batches() -> None:
    opt = _optimizer()
    scheduler = StepLR(opt, step_size=1, gamma=0.5)
    run = fake_run(
        {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}
    )
    stepped_at = []
    for batch_idx in range(6):
        run.progress.batch_idx = batch_idx
        before = len(run.hook_runner.calls)
        update_lr_schedulers(run, "step", plateau=False)
        update_lr_schedulers(run, "epoch", plateau=False)  # not this scheduler's interval
        if len(run.hook_runner.calls) > before:
            stepped_at.append(batch_idx)
    # Lightning's rule: after batches 2, 4 and 6 (batch_idx + 1 divisible by the frequency).
    assert stepped_at == [1, 3, 5]
    assert lr(scheduler) == 0.5**3
    assert run.hook_runner.calls[0] == ("lr_scheduler_step", scheduler, None)


def test_an_epoch_scheduler_steps_every_frequency_epochs() -> None:
    opt = _optimizer()
    scheduler = StepLR(opt, step_size=1, gamma=0.1)
    run = fake_run(([opt], [{"scheduler": scheduler, "frequency": 3}]))
    lrs = []
    for epoch in range(6):
        run.progress.current_epoch = epoch
        update_lr_schedulers(run, "step", plateau=False)
        update_lr_schedulers(run, "epoch", plateau=False)
        lrs.append(lr(scheduler))
    assert lrs == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.1, 0.01])


def test_a_bare_scheduler_steps_once_an_epoch() -> None:
    opt = _optimizer()
    scheduler = StepLR(opt, step_size=1, gamma=0.5)
    run = fake_run(([opt], [scheduler]))
    update_lr_schedulers(run, "step", plateau=False)
    assert lr(scheduler) == 1.0
    update_lr_schedulers(run, "epoch", plateau=False)
    assert lr(scheduler) == 0.5


def test_plateau_schedulers_step_only_in_the_plateau_pass_with_the_monitored_value() -> None:
    opt = _optimizer()
    plateau = ReduceLROnPlateau(opt, patience=0, factor=0.5)
    run = fake_run(
        {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}},
        metrics={"val_loss": torch.tensor(1.0), "train_loss": torch.tensor(9.0)},
    )
    update_lr_schedulers(run, "epoch", plateau=False)
    assert run.hook_runner.calls == []
    update_lr_schedulers(run, "epoch", plateau=True)
    (call,) = run.hook_runner.calls
    assert call[1] is plateau and float(call[2]) == 1.0
    # No improvement on the next epoch: patience 0 halves the rate.
    update_lr_schedulers(run, "epoch", plateau=True)
    assert lr(plateau) == 0.5


def test_a_missing_monitored_metric_is_an_error_naming_the_logged_ones() -> None:
    opt = _optimizer()
    plateau = ReduceLROnPlateau(opt)
    run = fake_run(
        {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}},
        metrics={"train_loss": 1.0, "acc": 0.5},
    )
    with pytest.raises(MisconfigurationException) as raised:
        update_lr_schedulers(run, "epoch", plateau=True)
    assert str(raised.value) == (
        "ReduceLROnPlateau watches 'val_loss', which was not logged (logged metrics: acc, train_loss). "
        "Log it with self.log('val_loss', ...) or change `monitor`."
    )


def test_a_missing_metric_with_strict_false_warns_and_does_not_step() -> None:
    opt = _optimizer()
    plateau = ReduceLROnPlateau(opt)
    run = fake_run(
        {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss", "strict": False}}
    )
    with pytest.warns(
        UserWarning, match=r"ReduceLROnPlateau watches 'val_loss', which was not logged; the scheduler"
    ):
        update_lr_schedulers(run, "epoch", plateau=True)
    assert run.hook_runner.calls == []


def test_without_schedulers_nothing_is_read() -> None:
    run = SimpleNamespace(plugin=SimpleNamespace(lr_scheduler_configs=[]))
    # Neither progress, metrics nor hooks exist on this run: the function returns before reading them.
    update_lr_schedulers(run, "step", plateau=False)
    update_lr_schedulers(run, "epoch", plateau=True)


def test_several_schedulers_each_follow_their_own_config() -> None:
    first, second = _optimizer(), _optimizer()
    per_step = StepLR(first, step_size=1, gamma=0.5)
    per_epoch = StepLR(second, step_size=1, gamma=0.5)
    run = fake_run(
        [
            {"optimizer": first, "lr_scheduler": {"scheduler": per_step, "interval": "step"}},
            {"optimizer": second, "lr_scheduler": {"scheduler": per_epoch, "interval": "epoch"}},
        ]
    )
    for batch_idx in range(3):
        run.progress.batch_idx = batch_idx
        update_lr_schedulers(run, "step", plateau=False)
    update_lr_schedulers(run, "epoch", plateau=False)
    assert (lr(per_step), lr(per_epoch)) == (0.125, 0.5)
