"""BaseFinetuning and BackboneFinetuning: what trains when, at which rate, and an exact resume.

What a user relies on: the backbone stays frozen (its weights unchanged) until the unfreeze epoch,
then joins the optimizer as a new parameter group at the documented rate, which grows by
``lambda_func`` each epoch up to the head's rate; the numbers equal Lightning's own callback on the
same module and data; and a run resumed from a checkpoint written after the unfreeze (mid-epoch
included) rebuilds the groups, loads the optimizer state into them and ends with bit-identical weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import Optimizer
from weight_averaging_job import SaveAt, loader, trainer_for

from trainer_core import LightningModule, seed_everything
from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from trainer_core.errors import MisconfigurationException


class Transfer(LightningModule):
    """A backbone (Linear, BatchNorm) and a head; the optimizer gets the trainable parameters only."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        params = filter(lambda p: p.requires_grad, self.parameters())
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=0.1)
        return torch.optim.SGD(params, lr=0.1)


class Watch(Callback):
    """Per epoch (after the finetuning callback ran at its start): groups, their rates, what trains."""

    def __init__(self) -> None:
        self.groups: list[list[float]] = []
        self.backbone_trains: list[bool] = []

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.groups.append([g["lr"] for g in trainer.optimizers[0].param_groups])
        self.backbone_trains.append(pl_module.backbone[0].weight.requires_grad)


def _lightning_twin(module: Transfer) -> Any:
    import pytorch_lightning as pl

    class Twin(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = copy.deepcopy(module.backbone)
            self.head = copy.deepcopy(module.head)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)

    return Twin()


def test_backbone_unfreezes_at_its_epoch_with_the_scheduled_rates_as_lightning() -> None:
    seed_everything(0)
    model = Transfer()
    twin = _lightning_twin(model)
    initial = model.backbone[0].weight.detach().clone()
    watch = Watch()
    kwargs = dict(unfreeze_backbone_at_epoch=2, lambda_func=lambda epoch: 1.5, backbone_initial_ratio_lr=0.1)
    frozen_after: list[torch.Tensor] = []

    class Snap(Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            frozen_after.append(pl_module.backbone[0].weight.detach().clone())

    callback = BackboneFinetuning(**kwargs)
    trainer_for(max_epochs=6, callbacks=[callback, watch, Snap()]).fit(model, loader())

    # Epochs 0 and 1: one group, the backbone frozen and unchanged. Epoch 2: the backbone joins at
    # 0.1 * 0.1; then 1.5x per epoch: 0.015, 0.0225, 0.03375 (below the head's 0.1, so not aligned).
    assert watch.backbone_trains == [False, False, True, True, True, True]
    assert watch.groups[:2] == [[0.1], [0.1]]
    assert [g[1] for g in watch.groups[2:]] == pytest.approx([0.01, 0.015, 0.0225, 0.03375])
    assert torch.equal(frozen_after[0], initial) and torch.equal(frozen_after[1], initial)
    assert not torch.equal(frozen_after[2], initial)
    # train_bn=True: the BatchNorm layer trained from the start (in the first group), the Linear joins.
    metadata = callback.state_dict()["internal_optimizer_metadata"][0]
    assert metadata[0]["params"] == ["backbone.1.weight", "backbone.1.bias", "head.weight", "head.bias"]
    assert metadata[1]["params"] == ["backbone.0.weight", "backbone.0.bias"]

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BackboneFinetuning as LightningBackboneFinetuning

    pl.Trainer(
        max_epochs=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[LightningBackboneFinetuning(**kwargs)],
    ).fit(twin, loader())
    for (name, ours), theirs in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.allclose(ours.float(), theirs.float(), atol=1e-6, rtol=0), name


def test_should_align_caps_the_backbone_rate_at_the_heads() -> None:
    seed_everything(1)
    watch = Watch()
    callback = BackboneFinetuning(
        unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 10.0, backbone_initial_lr=0.05
    )
    trainer_for(max_epochs=3, callbacks=[callback, watch]).fit(Transfer(), loader())
    assert [g[1] for g in watch.groups[1:]] == pytest.approx([0.05, 0.1])


class HeadLater(BaseFinetuning):
    """A custom finetuning: the head frozen, unfrozen at epoch 1 at the first group's rate / 10, BatchNorm kept frozen."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone[1], train_bn=False)
        self.freeze(pl_module.head)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(
                [pl_module.head, pl_module.backbone[1]], optimizer, train_bn=False, initial_denom_lr=4.0
            )


def test_base_finetuning_adds_the_unfrozen_parameters_as_a_group() -> None:
    seed_everything(2)
    model = Transfer()
    watch = Watch()
    trainer = trainer_for(max_epochs=2, callbacks=[HeadLater(), watch])
    trainer.fit(model, loader())
    assert watch.groups == [[0.1], [0.1, 0.025]]
    groups = trainer.optimizers[0].param_groups
    assert [id(p) for p in groups[1]["params"]] == [id(model.head.weight), id(model.head.bias)]
    # train_bn=False: the BatchNorm layer's parameters join no group (Lightning's make_trainable still
    # sets their requires_grad), so they never change.
    held = {id(p) for g in groups for p in g["params"]}
    assert id(model.backbone[1].weight) not in held and torch.equal(model.backbone[1].weight, torch.ones(8))


def test_parameters_with_equal_values_are_still_added() -> None:
    """Lightning compares values (torch.equal): a new parameter equal to one held would be dropped."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    layer = nn.Linear(3, 3)
    nn.init.zeros_(layer.bias)
    BaseFinetuning.freeze(layer)
    BaseFinetuning.unfreeze_and_add_param_group(layer, optimizer, lr=0.5)
    assert len(optimizer.param_groups[1]["params"]) == 2 and optimizer.param_groups[1]["lr"] == 0.5


def test_backbone_finetuning_needs_a_backbone() -> None:
    class NoBackbone(Transfer):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = self.backbone
            del self.backbone

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.trunk(x)), y)

    with pytest.raises(MisconfigurationException, match="`backbone` attribute"):
        trainer_for(max_epochs=1, callbacks=[BackboneFinetuning()]).fit(NoBackbone(), loader())


@pytest.mark.parametrize("step", [9, 16], ids=["mid-unfreeze-epoch", "mid-later-epoch"])
def test_resume_after_the_unfreeze_is_exact(tmp_path: Path, step: int) -> None:
    """Adam keeps per-group state: the resumed optimizer must have the backbone group before it loads."""
    path = str(tmp_path / "mid.ckpt")

    def callback() -> BackboneFinetuning:
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5)

    seed_everything(3)
    straight = Transfer(optimizer="adam")
    watch = Watch()
    trainer_for(max_epochs=4, callbacks=[callback(), watch, SaveAt(path, step=step)]).fit(
        straight, loader(shuffle=True)
    )

    seed_everything(42)  # everything comes from the checkpoint
    resumed = Transfer(optimizer="adam")
    resumed_watch = Watch()
    trainer = trainer_for(max_epochs=4, callbacks=[callback(), resumed_watch])
    trainer.fit(resumed, loader(shuffle=True), ckpt_path=path)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    # The rates of the epochs after the resume are the uninterrupted run's (not raised twice).
    assert resumed_watch.groups == watch.groups[-len(resumed_watch.groups) :]
    assert resumed.backbone[0].weight.requires_grad
