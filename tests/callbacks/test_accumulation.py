"""GradientAccumulationScheduler on real runs: the weights a plain loop with the same schedule gets,
an exact resume in the middle of an accumulation cycle, and the combinations it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from boring import BoringModel, quiet_trainer, random_data
from resume_job import ResumeModule, SaveAt, dataloader, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, GradientAccumulationScheduler
from trainer_core.errors import MisconfigurationException

SCHEDULE = {1: 2, 2: 3}


class Plain(BoringModel):
    """Plain SGD: the optimizer the reference loop below repeats by hand."""

    def __init__(self) -> None:
        super().__init__(optimizer=torch.optim.SGD, lr=0.1)


class StepsPerEpoch(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.steps.append(trainer.global_step)


def _data() -> TensorDataset:
    return random_data(10, 4)


def test_trains_like_a_plain_loop_with_the_same_schedule() -> None:
    seed_everything(0)
    model = Plain()
    reference = Plain()
    reference.load_state_dict(model.state_dict())
    record = StepsPerEpoch()
    trainer = quiet_trainer(max_epochs=4, callbacks=[GradientAccumulationScheduler(dict(SCHEDULE)), record])
    trainer.fit(model, DataLoader(_data(), batch_size=2))
    # 5 batches per epoch: 5 steps, then ceil(5 / 2) = 3, then ceil(5 / 3) = 2 twice.
    assert record.steps == [5, 8, 10, 12]
    assert trainer.accumulate_grad_batches == 1  # the Trainer's own setting again after fit

    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = list(DataLoader(_data(), batch_size=2))
    for epoch in range(4):
        factor = 3 if epoch >= 2 else 2 if epoch == 1 else 1
        for i, (x, y) in enumerate(batches):
            (nn.functional.mse_loss(reference.net(x), y) / factor).backward()
            if (i + 1) % factor == 0 or i + 1 == len(batches):
                opt.step()
                opt.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-6)


def test_resume_in_the_middle_of_a_cycle_is_exact(tmp_path: Path) -> None:
    def run(callbacks: list[Any], ckpt_path: Any = None, seed: int = 0) -> ResumeModule:
        seed_everything(seed)
        model = ResumeModule()
        trainer = Trainer(**trainer_kwargs(max_epochs=3), callbacks=callbacks)
        trainer.fit(model, dataloader(), dataloader(shuffle=False), ckpt_path=ckpt_path)
        return model

    full = run([GradientAccumulationScheduler({1: 3})])
    path = str(tmp_path / "mid.ckpt")
    # 13 batches per epoch: the 18th batch overall is batch 4 of epoch 1, two batches into a cycle of 3.
    first = run([GradientAccumulationScheduler({1: 3}), SaveAt(path, batch_idx=17)])
    assert torch.load(path, weights_only=True)["loops"]["accumulated_grads"]  # saved between two steps
    resumed = run([GradientAccumulationScheduler({1: 3})], ckpt_path=path, seed=777)
    assert first.losses == full.losses
    assert resumed.losses == full.losses[18:]
    for name, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


class Manual(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def test_refuses_what_lightning_refuses() -> None:
    def fit(model: LightningModule, **kwargs: Any) -> Trainer:
        trainer = quiet_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler({0: 2})], **kwargs)
        trainer.fit(model, DataLoader(_data(), batch_size=2))
        return trainer

    with pytest.raises(MisconfigurationException, match="automatic optimization"):
        fit(Manual())
    with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches=2.*remove one"):
        fit(Plain(), accumulate_grad_batches=2)
    with pytest.raises(TypeError, match="non-empty dict"):
        GradientAccumulationScheduler({})
    with pytest.raises(MisconfigurationException, match="epochs must be integers >= 0"):
        GradientAccumulationScheduler({-1: 2})
    with pytest.raises(MisconfigurationException, match="factors must be integers >= 1"):
        GradientAccumulationScheduler({0: 0})


def test_warns_when_the_module_overrides_optimizer_step() -> None:
    class CustomStep(Plain):
        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            super().optimizer_step(*args, **kwargs)

    trainer = quiet_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler({0: 2})])
    with pytest.warns(UserWarning, match="once per optimizer step"):
        trainer.fit(CustomStep(), DataLoader(_data(), batch_size=2))
    assert trainer.global_step == 3
