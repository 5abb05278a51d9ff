"""The Trainer computes exactly what a hand-written PyTorch loop computes, and runs as long as asked.

Each training test runs the same small model on the same seed and data twice: through
``Trainer.fit`` and through a plain PyTorch loop that spells out Lightning's semantics
(zero the gradients at the start of each accumulation cycle, divide the loss by
``accumulate_grad_batches``, also for a partial last cycle; clip after the backward, before the
step). Per-batch losses and final weights must agree to 1e-6. ``bf16-mixed`` must run the
forward under CPU autocast (a hidden activation is bfloat16) and give losses close to, but not
equal to, fp32. Manual optimization with two optimizers and a scheduler (GAN-style) must equal
its hand loop. The loop-length arguments (``max_steps``, ``max_epochs``, ``limit_train_batches``,
``val_check_interval``, ``check_val_every_n_epoch``, ``num_sanity_val_steps``, ``fast_dev_run``)
must give Lightning's counts of optimizer steps and validation runs.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from boring import fast_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks import Callback

N_SAMPLES = 10
BATCH = 3  # batches of 3, 3, 3, 1


def _loader(n: int = N_SAMPLES, batch_size: int = BATCH) -> DataLoader:
    return random_loader(n, 4, batch_size=batch_size)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _trainer(**kwargs: Any) -> Trainer:
    return fast_trainer(**{"max_epochs": 2, "limit_val_batches": 0, **kwargs})


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []
        self.hidden_dtypes: list[torch.dtype] = []

    def forward(self, x):
        hidden = self.net[0](x)
        self.hidden_dtypes.append(hidden.dtype)
        return self.net[2](self.net[1](hidden))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return _optimizer(self.parameters())


def _hand_loop(epochs: int = 2, accumulate: int = 1, clip: Optional[tuple[str, float]] = None):
    """Lightning's automatic optimization, written out."""
    net = _net()
    opt = _optimizer(net.parameters())
    losses: list[float] = []
    for _ in range(epochs):
        batches = list(_loader())
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(net(x), y)
            losses.append(loss.item())
            if i % accumulate == 0:
                opt.zero_grad()
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0 or i == len(batches) - 1:
                if clip is not None:
                    algorithm, value = clip
                    if algorithm == "norm":
                        nn.utils.clip_grad_norm_(net.parameters(), value)
                    else:
                        nn.utils.clip_grad_value_(net.parameters(), value)
                opt.step()
    return losses, net


def _fit(**kwargs: Any) -> tuple[Regressor, Trainer]:
    model = Regressor()
    trainer = _trainer(**kwargs)
    trainer.fit(model, _loader())
    return model, trainer


def _assert_same_run(model: Regressor, losses: list[float], net: nn.Module) -> None:
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(losses), rtol=0, atol=1e-6)
    for (name, got), want in zip(model.net.named_parameters(), net.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- numbers
def test_plain_training_equals_hand_loop():
    model, trainer = _fit()
    losses, net = _hand_loop()
    _assert_same_run(model, losses, net)
    assert model.losses == losses  # same ops in the same order: bit-for-bit
    assert trainer.global_step == 8


def test_accumulate_grad_batches_equals_hand_loop_with_partial_last_cycle():
    """4 batches per epoch, accumulate 3: a full cycle (batches 0-2) and a partial one (batch 3)."""
    model, trainer = _fit(accumulate_grad_batches=3)
    losses, net = _hand_loop(accumulate=3)
    _assert_same_run(model, losses, net)
    assert trainer.global_step == 4  # two optimizer steps per epoch
    plain_losses, _ = _hand_loop()
    assert model.losses[4:] != pytest.approx(plain_losses[4:], abs=1e-6)  # accumulation changed the numbers


@pytest.mark.parametrize(("algorithm", "value"), [("norm", 0.05), ("value", 0.01)])
def test_gradient_clipping_equals_hand_loop(algorithm, value):
    model, _ = _fit(gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    losses, net = _hand_loop(clip=(algorithm, value))
    _assert_same_run(model, losses, net)
    unclipped, _ = _hand_loop()
    assert losses[1:] != pytest.approx(unclipped[1:], abs=1e-4)  # the clip value actually bites


def test_gradient_clip_algorithm_defaults_to_norm():
    model, _ = _fit(gradient_clip_val=0.05)
    losses, net = _hand_loop(clip=("norm", 0.05))
    _assert_same_run(model, losses, net)


def test_accumulation_and_clipping_together():
    model, _ = _fit(accumulate_grad_batches=2, gradient_clip_val=0.05)
    losses, net = _hand_loop(accumulate=2, clip=("norm", 0.05))
    _assert_same_run(model, losses, net)


def test_bf16_mixed_runs_under_cpu_autocast():
    model, trainer = _fit(precision="bf16-mixed")
    assert trainer.precision == "bf16-mixed"
    assert model.hidden_dtypes and set(model.hidden_dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    fp32_losses, _ = _hand_loop()
    assert model.losses != fp32_losses
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(fp32_losses), rtol=5e-2, atol=5e-2)


def test_fp32_forward_is_not_autocast():
    model, _ = _fit()
    assert set(model.hidden_dtypes) == {torch.float32}


def test_bf16_mixed_validation_also_runs_under_autocast():
    class Val(Regressor):
        def validation_step(self, batch, batch_idx):
            self(batch[0])

    model = Val()
    _trainer(precision="bf16-mixed", limit_val_batches=None).validate(model, _loader(), verbose=False)
    assert set(model.hidden_dtypes) == {torch.bfloat16}


# ---------------------------------------------------------------------- manual optimization
def _gan_parts():
    torch.manual_seed(0)
    gen = nn.Linear(4, 4)
    disc = nn.Linear(4, 1)
    return gen, disc


def _gan_losses(gen: nn.Module, disc: nn.Module, x: torch.Tensor):
    z = x.flip(1)  # deterministic "noise" so both runs see the same inputs
    fake = gen(z)
    d_loss = nn.functional.softplus(-disc(x)).mean() + nn.functional.softplus(disc(fake.detach())).mean()
    return d_loss, fake


class GAN(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = _gan_parts()
        self.losses: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        sched_g = self.lr_schedulers()
        x, _ = batch
        d_loss, fake = _gan_losses(self.gen, self.disc, x)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        g_loss = nn.functional.softplus(-self.disc(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        sched_g.step()
        self.losses.append((d_loss.item(), g_loss.item()))

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.gen.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(self.disc.parameters(), lr=0.05)
        sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
        return [opt_g, opt_d], [sched_g]


def _gan_hand_loop(epochs: int = 2):
    gen, disc = _gan_parts()
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.05)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
    losses = []
    for _ in range(epochs):
        for x, _ in _loader():
            d_loss, fake = _gan_losses(gen, disc, x)
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = nn.functional.softplus(-disc(fake)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            sched_g.step()
            losses.append((d_loss.item(), g_loss.item()))
    return losses, gen, disc, opt_g


def test_manual_optimization_two_optimizers_equals_hand_loop():
    model = GAN()
    trainer = _trainer()
    trainer.fit(model, _loader())
    losses, gen, disc, opt_g = _gan_hand_loop()
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(losses), rtol=0, atol=1e-6)
    torch.testing.assert_close(model.gen.weight.detach(), gen.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(model.disc.weight.detach(), disc.weight.detach(), rtol=0, atol=1e-6)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(opt_g.param_groups[0]["lr"])


def test_manual_optimization_global_step_counts_optimizer_steps():
    """Lightning counts every ``optimizer.step()`` under manual optimization: 2 per batch here."""
    model = GAN()
    trainer = _trainer()
    trainer.fit(model, _loader())
    assert trainer.global_step == 2 * 4 * 2


def test_manual_optimization_respects_max_steps():
    model = GAN()
    trainer = _trainer(max_epochs=5, max_steps=6)
    trainer.fit(model, _loader())
    assert len(model.losses) == 3  # 3 batches x 2 optimizer steps = max_steps


# ---------------------------------------------------------------------- loop lengths
class Counter(Callback):
    def __init__(self) -> None:
        self.train_batches = 0
        self.train_epochs = 0
        self.val_runs = 0
        self.sanity_val_batches = 0
        self.val_batches = 0
        self.val_at: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_batches += 1

    def on_train_epoch_start(self, trainer, pl_module):
        self.train_epochs += 1

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val_runs += 1
            self.val_at.append((trainer.current_epoch, trainer.global_step))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            self.sanity_val_batches += 1
        else:
            self.val_batches += 1


class ValRegressor(Regressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))


def _count(
    n_train: int = 8, batch_size: int = 2, extra_callbacks: tuple[Callback, ...] = (), **kwargs: Any
) -> tuple[Counter, Trainer]:
    """Train on ``n_train`` samples in batches of ``batch_size``; validate on 3 batches."""
    counter = Counter()
    args: dict[str, Any] = dict(
        max_epochs=2, limit_val_batches=None, num_sanity_val_steps=None, callbacks=[counter, *extra_callbacks]
    )
    args.update(kwargs)
    trainer = _trainer(**args)
    trainer.fit(ValRegressor(), _loader(n_train, batch_size), _loader(6, 2))
    return counter, trainer


def test_max_epochs_counts():
    counter, trainer = _count(max_epochs=3)
    assert (trainer.global_step, counter.train_batches, counter.train_epochs) == (12, 12, 3)
    assert trainer.current_epoch == 3
    assert counter.val_runs == 3 and counter.val_batches == 9
    assert counter.sanity_val_batches == 2  # the default num_sanity_val_steps=2


def test_max_steps_stops_mid_epoch():
    counter, trainer = _count(max_epochs=10, max_steps=6)
    assert (trainer.global_step, counter.train_batches, counter.train_epochs) == (6, 6, 2)
    # Validation runs at the end of epoch 0 only: epoch 1 stopped before its last batch.
    assert counter.val_at == [(0, 4)]


def test_max_steps_alone_runs_past_the_default_max_epochs_rule():
    """max_steps set and max_epochs unset: epochs are unlimited (Lightning sets max_epochs=-1)."""
    counter, trainer = _count(max_epochs=None, max_steps=10, n_train=4)
    assert trainer.global_step == 10 and counter.train_epochs == 5


def test_max_steps_counts_optimizer_steps_under_accumulation():
    counter, trainer = _count(max_epochs=10, max_steps=3, accumulate_grad_batches=2)
    assert trainer.global_step == 3 and counter.train_batches == 6


@pytest.mark.parametrize(("limit", "per_epoch"), [(2, 2), (0.5, 2), (0.3, 1), (1.0, 4), (10, 4)])
def test_limit_train_batches(limit, per_epoch):
    counter, trainer = _count(limit_train_batches=limit)
    assert trainer.num_training_batches == per_epoch
    assert counter.train_batches == 2 * per_epoch and trainer.global_step == 2 * per_epoch


def test_limit_train_batches_zero_trains_nothing():
    with pytest.warns(UserWarning, match="nothing to train"):
        counter, trainer = _count(limit_train_batches=0, num_sanity_val_steps=0)
    assert counter.train_batches == 0 and trainer.global_step == 0


@pytest.mark.parametrize(("limit", "batches"), [(1, 1), (0.5, 1), (2, 2), (1.0, 3)])
def test_limit_val_batches(limit, batches):
    counter, _ = _count(limit_val_batches=limit, max_epochs=1, num_sanity_val_steps=0)
    assert counter.val_runs == 1 and counter.val_batches == batches


def test_val_check_interval_float():
    """0.5 of 4 batches: validate after batches 2 and 4 of each epoch."""
    counter, _ = _count(val_check_interval=0.5)
    assert counter.val_at == [(0, 2), (0, 4), (1, 6), (1, 8)]


def test_val_check_interval_int_within_epoch():
    """Every 3 batches counted within each epoch of 4: once per epoch, after batch 3."""
    counter, _ = _count(val_check_interval=3)
    assert counter.val_at == [(0, 3), (1, 7)]


def test_val_check_interval_int_across_epochs():
    """check_val_every_n_epoch=None: every 3 batches counted across epochs (batches 3 and 6 of 8)."""
    counter, _ = _count(val_check_interval=3, check_val_every_n_epoch=None)
    assert counter.val_at == [(0, 3), (1, 6)]


def test_check_val_every_n_epoch():
    counter, _ = _count(max_epochs=5, check_val_every_n_epoch=2)
    assert [epoch for epoch, _ in counter.val_at] == [1, 3]


@pytest.mark.parametrize(("steps", "sanity"), [(0, 0), (1, 1), (2, 2), (-1, 3), (10, 3)])
def test_num_sanity_val_steps(steps, sanity):
    counter, trainer = _count(num_sanity_val_steps=steps, max_epochs=1)
    assert counter.sanity_val_batches == sanity
    assert counter.val_runs == 1 and counter.val_batches == 3
    assert "val_loss" in trainer.callback_metrics


def test_sanity_check_metrics_do_not_leak():
    """What the sanity check logs is dropped: with no training-time validation nothing remains."""
    with pytest.warns(UserWarning, match="nothing to train"):
        counter, trainer = _count(num_sanity_val_steps=2, max_epochs=1, limit_train_batches=0)
    assert counter.sanity_val_batches == 2
    assert "val_loss" not in trainer.callback_metrics


def test_on_train_batch_start_returning_minus_one_skips_the_rest_of_the_epoch():
    class Skipper(ValRegressor):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 1 else None

    counter = Counter()
    trainer = _trainer(callbacks=[counter])
    model = Skipper()
    trainer.fit(model, _loader(8, 2))
    assert trainer.global_step == 2 and len(model.losses) == 2  # batch 0 of each of the 2 epochs
    assert counter.train_epochs == 2


def test_should_stop_stops_after_the_batch_and_validates():
    class Stopper(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                trainer.should_stop = True

    counter, trainer = _count(max_epochs=5, extra_callbacks=(Stopper(),))
    assert trainer.global_step == 2 and counter.train_epochs == 1
    assert counter.val_at == [(0, 2)]


@pytest.mark.parametrize(("fast_dev_run", "n"), [(True, 1), (3, 3)])
def test_fast_dev_run(fast_dev_run, n):
    counter, trainer = _count(fast_dev_run=fast_dev_run, max_epochs=10)
    assert (trainer.global_step, counter.train_batches, counter.train_epochs) == (n, n, 1)
    assert counter.sanity_val_batches == 0
    assert counter.val_runs == 1 and counter.val_batches == n


def test_fast_dev_run_also_limits_validate_test_predict():
    trainer = _trainer(fast_dev_run=2)
    model = ValRegressor()
    counter = Counter()
    trainer.callbacks.append(counter)
    trainer.validate(model, _loader(), verbose=False)
    assert counter.val_batches == 2
    predictions = trainer.predict(model, _loader())
    assert len(predictions) == 2


def test_global_step_and_current_epoch_are_visible_to_the_module():
    seen: list[tuple[int, int]] = []

    class Probe(Regressor):
        def training_step(self, batch, batch_idx):
            seen.append((self.current_epoch, self.global_step))
            return super().training_step(batch, batch_idx)

    model = Probe()
    _trainer().fit(model, _loader())
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (1, 6), (1, 7)]
