"""Every return form of ``configure_optimizers``, and when its schedulers step.

A Lightning 2.x module may return an optimizer, a list of optimizers, ``(optimizers,
schedulers)``, a dict with ``lr_scheduler`` (a scheduler or a config dict with ``interval``,
``frequency``, ``monitor``), a list of such dicts (manual optimization), or ``None`` (manual
optimization without optimizers). Each form must train (the parameters change by exactly the
SGD update) and each scheduler must step at its interval and frequency: the learning rate seen
by ``training_step`` is checked batch by batch against the value Lightning's rule gives
(step schedulers at ``(batch_idx + 1) % frequency == 0``, epoch schedulers on the last batch of
epochs with ``(epoch + 1) % frequency == 0``, plateau schedulers after the epoch). A form that
is not valid raises ``MisconfigurationException`` naming ``configure_optimizers`` or the key.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from boring import fast_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer
from trainer_core.errors import MisconfigurationException

BATCHES_PER_EPOCH = 4
LR = 0.1


def _loader() -> DataLoader:
    return random_loader(2 * BATCHES_PER_EPOCH, 3, batch_size=2, seed=1)


class Model(LightningModule):
    """Records the learning rate ``training_step`` sees; ``configure_optimizers`` comes from a factory."""

    def __init__(self, make: Callable[[LightningModule], Any], val_loss: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        self._make = make
        self.lrs: list[float] = []
        self._val_loss = val_loss

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        if self._val_loss is not None:
            self.log("val_loss", self._val_loss(self.current_epoch))

    def configure_optimizers(self):
        return self._make(self)


def _sgd(module: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(module.parameters(), lr=LR)


def _fit(
    make: Callable[[LightningModule], Any],
    epochs: int = 1,
    val: bool = False,
    val_loss: Any = None,
    **kwargs: Any,
) -> tuple[Model, Trainer]:
    model = Model(make, val_loss=val_loss)
    trainer = fast_trainer(max_epochs=epochs, limit_val_batches=(1 if val else 0), **kwargs)
    trainer.fit(model, _loader(), _loader() if val else None)
    return model, trainer


def _expected_sgd_weights(epochs: int, lr_at: Callable[[int], float]) -> torch.Tensor:
    """The weights a plain SGD loop reaches, with ``lr_at(global batch index)`` as the learning rate."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    i = 0
    for _ in range(epochs):
        for x, y in _loader():
            for group in opt.param_groups:
                group["lr"] = lr_at(i)
            opt.zero_grad()
            nn.functional.mse_loss(layer(x), y).backward()
            opt.step()
            i += 1
    return layer.weight.detach()


# ---------------------------------------------------------------------- forms without schedulers
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: _sgd(m), id="optimizer"),
        pytest.param(lambda m: [_sgd(m)], id="list-of-one"),
        pytest.param(lambda m: (_sgd(m),), id="tuple-of-one"),
        pytest.param(lambda m: {"optimizer": _sgd(m)}, id="dict-without-scheduler"),
    ],
)
def test_optimizer_forms_train_like_plain_sgd(make):
    model, trainer = _fit(make, epochs=2)
    assert trainer.global_step == 2 * BATCHES_PER_EPOCH
    assert model.lrs == [LR] * (2 * BATCHES_PER_EPOCH)
    torch.testing.assert_close(model.layer.weight.detach(), _expected_sgd_weights(2, lambda i: LR))
    assert len(trainer.optimizers) == 1 and trainer.lr_scheduler_configs == []


# ---------------------------------------------------------------------- schedulers
def _halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _pair(m):
    opt = _sgd(m)
    return [opt], [_halving(opt)]


def _dict_plain(m):
    opt = _sgd(m)
    return {"optimizer": opt, "lr_scheduler": _halving(opt)}


def _dict_config(interval: str, frequency: int):
    def make(m):
        opt = _sgd(m)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": _halving(opt), "interval": interval, "frequency": frequency},
        }

    return make


@pytest.mark.parametrize(
    "make", [_pair, _dict_plain, _dict_config("epoch", 1)], ids=["tuple", "dict", "dict-config"]
)
def test_epoch_scheduler_steps_once_per_epoch(make):
    model, trainer = _fit(make, epochs=3)
    per_epoch = [LR, LR / 2, LR / 4]
    assert model.lrs == pytest.approx([lr for lr in per_epoch for _ in range(BATCHES_PER_EPOCH)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 8)
    assert trainer.lr_scheduler_configs[0].interval == "epoch"
    torch.testing.assert_close(
        model.layer.weight.detach(), _expected_sgd_weights(3, lambda i: per_epoch[i // BATCHES_PER_EPOCH])
    )


def test_epoch_scheduler_with_frequency_two():
    model, trainer = _fit(_dict_config("epoch", 2), epochs=4)
    per_epoch = [LR, LR, LR / 2, LR / 2]
    assert model.lrs == pytest.approx([lr for lr in per_epoch for _ in range(BATCHES_PER_EPOCH)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 4)


def test_step_scheduler_steps_after_every_optimizer_step():
    model, trainer = _fit(_dict_config("step", 1), epochs=2)
    assert model.lrs == pytest.approx([LR / 2**i for i in range(2 * BATCHES_PER_EPOCH)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 2 ** (2 * BATCHES_PER_EPOCH))
    torch.testing.assert_close(model.layer.weight.detach(), _expected_sgd_weights(2, lambda i: LR / 2**i))


def test_step_scheduler_with_frequency_two():
    """frequency=2 with interval='step': a step after batches 1 and 3 of each epoch (batch_idx + 1 even)."""
    model, trainer = _fit(_dict_config("step", 2), epochs=2)
    assert model.lrs == pytest.approx([LR, LR, LR / 2, LR / 2, LR / 4, LR / 4, LR / 8, LR / 8])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 16)


def test_step_scheduler_under_accumulation_steps_with_the_optimizer():
    """With accumulate_grad_batches=2 the scheduler steps only when the optimizer does."""
    model, trainer = _fit(_dict_config("step", 1), epochs=1, accumulate_grad_batches=2)
    assert trainer.global_step == BATCHES_PER_EPOCH // 2
    assert model.lrs == pytest.approx([LR, LR, LR / 2, LR / 2])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 4)


def test_scheduler_config_defaults():
    _, trainer = _fit(_dict_plain, epochs=1)
    (config,) = trainer.lr_scheduler_configs
    assert (config.interval, config.frequency, config.reduce_on_plateau, config.monitor) == (
        "epoch",
        1,
        False,
        None,
    )


def _plateau_config(m):
    opt = _sgd(m)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}


def _plateau_top_level_monitor(m):
    opt = _sgd(m)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    return {"optimizer": opt, "lr_scheduler": sched, "monitor": "val_loss"}


@pytest.mark.parametrize(
    "make", [_plateau_config, _plateau_top_level_monitor], ids=["monitor-in-config", "monitor-top-level"]
)
def test_reduce_on_plateau_reads_the_monitored_metric(make):
    """val_loss is flat (1.0) for two epochs then improves: the lr halves after epoch 1 only."""
    losses = {0: 1.0, 1: 1.0, 2: 0.5, 3: 0.25}
    model, trainer = _fit(make, epochs=4, val=True, val_loss=lambda epoch: losses[epoch])
    (config,) = trainer.lr_scheduler_configs
    assert config.reduce_on_plateau and config.monitor == "val_loss"
    per_epoch = [LR, LR, LR / 2, LR / 2]
    assert model.lrs == pytest.approx([lr for lr in per_epoch for _ in range(BATCHES_PER_EPOCH)])


# ---------------------------------------------------------------------- manual optimization forms
class ManualModel(LightningModule):
    """Two optimizers from a list of dicts; one scheduler the module steps itself at epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.a = nn.Linear(3, 1)
        self.b = nn.Linear(3, 1)
        self.seen: dict[str, Any] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        sched = self.lr_schedulers()
        self.seen["optimizers"] = (opt_a.optimizer, opt_b.optimizer)
        self.seen["scheduler"] = sched
        for opt, layer in ((opt_a, self.a), (opt_b, self.b)):
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(layer(x), y))
            opt.step()

    def on_train_epoch_end(self):
        self.lr_schedulers().step()

    def configure_optimizers(self):
        opt_a = torch.optim.SGD(self.a.parameters(), lr=LR)
        opt_b = torch.optim.SGD(self.b.parameters(), lr=LR)
        return [{"optimizer": opt_a, "lr_scheduler": _halving(opt_a)}, {"optimizer": opt_b}]


def test_list_of_dicts_under_manual_optimization():
    model = ManualModel()
    before_a, before_b = model.a.weight.detach().clone(), model.b.weight.detach().clone()
    trainer = fast_trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(model, _loader())

    opt_a, opt_b = trainer.optimizers
    assert model.seen["optimizers"] == (opt_a, opt_b)
    assert model.seen["scheduler"] is trainer.lr_scheduler_configs[0].scheduler
    assert not torch.equal(model.a.weight, before_a) and not torch.equal(model.b.weight, before_b)
    # The Trainer never steps a scheduler under manual optimization: only the module's two calls count.
    assert opt_a.param_groups[0]["lr"] == pytest.approx(LR / 4)
    assert opt_b.param_groups[0]["lr"] == pytest.approx(LR)
    # Each layer matches plain SGD from the same initialisation, halving its lr where the module did.
    torch.manual_seed(0)
    ref_a, ref_b = nn.Linear(3, 1), nn.Linear(3, 1)
    ref_opts = [torch.optim.SGD(ref_a.parameters(), lr=LR), torch.optim.SGD(ref_b.parameters(), lr=LR)]
    for _ in range(2):
        for x, y in _loader():
            for opt, layer in zip(ref_opts, (ref_a, ref_b)):
                opt.zero_grad()
                nn.functional.mse_loss(layer(x), y).backward()
                opt.step()
        ref_opts[0].param_groups[0]["lr"] *= 0.5
    torch.testing.assert_close(model.a.weight.detach(), ref_a.weight.detach())
    torch.testing.assert_close(model.b.weight.detach(), ref_b.weight.detach())


def test_none_under_manual_optimization_trains_with_a_hand_update():
    class NoOptimizer(LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.layer(x), y))
            with torch.no_grad():
                for p in self.parameters():
                    p -= LR * p.grad

        def configure_optimizers(self):
            return None

    model = NoOptimizer()
    trainer = fast_trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(model, _loader())
    assert trainer.optimizers == []
    torch.testing.assert_close(model.layer.weight.detach(), _expected_sgd_weights(2, lambda i: LR))


def test_none_under_automatic_optimization_names_the_hook():
    with pytest.raises(MisconfigurationException, match=r"configure_optimizers.*automatic_optimization"):
        _fit(lambda m: None)


# ---------------------------------------------------------------------- junk returns
def _bad_interval(m):
    opt = _sgd(m)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": _halving(opt), "interval": "batch"}}


def _bad_frequency(m):
    opt = _sgd(m)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": _halving(opt), "frequency": 0}}


def _plateau_without_monitor(m):
    opt = _sgd(m)
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}


def _config_without_scheduler(m):
    return {"optimizer": _sgd(m), "lr_scheduler": {"interval": "step"}}


def _unknown_config_key(m):
    opt = _sgd(m)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": _halving(opt), "intervall": "step"}}


def _foreign_scheduler(m):
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    return [_sgd(m)], [_halving(other)]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        pytest.param(lambda m: "sgd", r"configure_optimizers returned a str", id="string"),
        pytest.param(lambda m: 3, r"configure_optimizers returned a int", id="int"),
        pytest.param(lambda m: [1, 2], r"configure_optimizers returned a list", id="list-of-ints"),
        pytest.param(
            lambda m: {"lr_scheduler": None},
            r"configure_optimizers.*'optimizer'",
            id="dict-without-optimizer",
        ),
        pytest.param(
            lambda m: {"optimizer": "sgd"}, r"configure_optimizers.*optimizer", id="dict-with-str-optimizer"
        ),
        pytest.param(
            _bad_interval, r"configure_optimizers.*interval='batch'.*'step' or 'epoch'", id="bad-interval"
        ),
        pytest.param(_bad_frequency, r"configure_optimizers.*frequency=0", id="bad-frequency"),
        pytest.param(
            _plateau_without_monitor,
            r"configure_optimizers.*ReduceLROnPlateau.*monitor",
            id="plateau-no-monitor",
        ),
        pytest.param(
            _config_without_scheduler, r"configure_optimizers.*'scheduler'", id="config-without-scheduler"
        ),
        pytest.param(_unknown_config_key, r"configure_optimizers.*intervall", id="unknown-config-key"),
        pytest.param(
            _foreign_scheduler,
            r"configure_optimizers.*StepLR.*did not return",
            id="scheduler-of-other-optimizer",
        ),
    ],
)
def test_junk_returns_raise_naming_the_hook(make, match):
    with pytest.raises(MisconfigurationException, match=match):
        _fit(make)


def test_plateau_monitor_never_logged_names_the_metric():
    def make(m):
        opt = _sgd(m)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_acc"}}

    with pytest.raises(MisconfigurationException, match=r"'val_acc'.*not logged.*val_loss.*monitor"):
        _fit(make, epochs=1, val=True, val_loss=lambda epoch: 1.0)


def test_plateau_monitor_never_logged_non_strict_warns_and_skips():
    def make(m):
        opt = _sgd(m)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_acc", "strict": False}}

    with pytest.warns(UserWarning, match="val_acc"):
        _, trainer = _fit(make, epochs=2)
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR


def test_several_optimizers_under_automatic_optimization_name_the_setting():
    with pytest.raises(MisconfigurationException, match=r"automatic_optimization = False"):
        _fit(lambda m: [_sgd(m), _sgd(m)])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, 2 * BATCHES_PER_EPOCH),
        ({"accumulate_grad_batches": 3}, 2 * 2),  # ceil(4 / 3) optimizer steps per epoch
        ({"limit_train_batches": 2}, 2 * 2),
        ({"max_steps": 100}, 2 * BATCHES_PER_EPOCH),  # the epochs end first: min(8, 100)
        ({"max_steps": 5}, 5),
    ],
    ids=["plain", "accumulate", "limit", "max_steps-after-epochs", "max_steps-first"],
)
def test_estimated_stepping_batches_in_configure_optimizers(kwargs, expected):
    """What a OneCycleLR's ``total_steps`` is built from: Lightning's
    ``min(ceil(batches / accumulate) * max_epochs, max_steps)``."""
    seen: list[Any] = []

    def make(m):
        seen.append(m.trainer.estimated_stepping_batches)
        return _sgd(m)

    _fit(make, epochs=2, **kwargs)
    assert seen == [expected]
