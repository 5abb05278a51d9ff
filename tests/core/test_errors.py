"""Misuse gives one clear error that names what the user controls.

A user who forgets ``training_step``, returns junk from ``configure_optimizers`` or
``training_step``, names a plugin that does not exist, passes an out-of-range Trainer argument,
hands ``fit`` a plain ``nn.Module`` or asks a single-device plugin for two devices must get a
``MisconfigurationException`` (raised before any training where the argument allows it) whose
message names the hook or the argument, and, where there is a fixed set, the allowed values.
"""

from __future__ import annotations

import pytest
import torch
from boring import fast_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import SingleDevicePlugin


def _loader() -> DataLoader:
    return random_loader(8, 3, batch_size=4)


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# ---------------------------------------------------------------------- the module's hooks
def test_missing_training_step_names_the_hook():
    class NoStep(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = NoStep()
    before = model.layer.weight.detach().clone()
    with pytest.raises(MisconfigurationException, match=r"NoStep does not define `training_step`"):
        fast_trainer().fit(model, _loader())
    assert torch.equal(model.layer.weight, before)


def test_missing_configure_optimizers_names_the_hook():
    class NoOptim(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

    with pytest.raises(MisconfigurationException, match=r"NoOptim does not define `configure_optimizers`"):
        fast_trainer().fit(NoOptim(), _loader())


@pytest.mark.parametrize("junk", ["adam", 1.0, [1, 2], {"lr": 0.1}], ids=["str", "float", "list", "dict"])
def test_configure_optimizers_junk_names_the_hook(junk):
    class Junk(Model):
        def configure_optimizers(self):
            return junk

    with pytest.raises(MisconfigurationException, match=r"configure_optimizers"):
        fast_trainer().fit(Junk(), _loader())


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ("a string", r"training_step returned a str"),
        (3, r"training_step returned a int"),
        ({"not_loss": 1}, r"training_step returned a dict without a tensor under 'loss'"),
        ({"loss": 1.0}, r"training_step returned a dict without a tensor under 'loss'"),
    ],
    ids=["str", "int", "dict-without-loss", "dict-with-float-loss"],
)
def test_training_step_junk_names_the_hook(returned, match):
    class Junk(Model):
        def training_step(self, batch, batch_idx):
            return returned

    with pytest.raises(MisconfigurationException, match=match):
        fast_trainer().fit(Junk(), _loader())


def test_training_step_returning_none_skips_the_batch():
    """Not an error: Lightning skips the optimizer step for a batch whose training_step returns None."""

    class Skip(Model):
        def training_step(self, batch, batch_idx):
            return None

    model = Skip()
    before = model.layer.weight.detach().clone()
    fast_trainer().fit(model, _loader())
    assert torch.equal(model.layer.weight, before)


def test_several_optimizers_under_automatic_optimization():
    class Two(Model):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(
        MisconfigurationException, match=r"configure_optimizers returned 2 optimizers.*automatic_optimization"
    ):
        fast_trainer().fit(Two(), _loader())


def test_validate_without_validation_step_names_the_hook():
    with pytest.raises(MisconfigurationException, match=r"Model\.validation_step"):
        fast_trainer().validate(Model(), _loader(), verbose=False)


def test_test_without_test_step_names_the_hook():
    with pytest.raises(MisconfigurationException, match=r"Model\.test_step"):
        fast_trainer().test(Model(), _loader(), verbose=False)


def test_fit_without_data_names_the_hook_and_argument():
    with pytest.raises(MisconfigurationException, match=r"train_dataloaders=.*train_dataloader"):
        fast_trainer().fit(Model())


def test_dataloader_hook_returning_junk_names_the_hook():
    class Junk(Model):
        def train_dataloader(self):
            return 42

    with pytest.raises(MisconfigurationException, match=r"`train_dataloader` returned a int"):
        fast_trainer().fit(Junk())


def test_manual_optimization_with_accumulation_names_the_argument():
    class Manual(Model):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches"):
        fast_trainer(accumulate_grad_batches=2).fit(Manual(), _loader())


def test_manual_backward_under_automatic_optimization_names_the_setting():
    class Wrong(Model):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            return loss

    with pytest.raises(MisconfigurationException, match=r"manual_backward.*automatic_optimization = False"):
        fast_trainer().fit(Wrong(), _loader())


# ---------------------------------------------------------------------- what fit receives
@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_non_lightning_module_names_the_entry_point(stage):
    with pytest.raises(
        MisconfigurationException, match=rf"trainer\.{stage}\(\).*LightningModule, got Linear"
    ):
        getattr(fast_trainer(), stage)(nn.Linear(3, 1), _loader())


def test_evaluate_without_model_before_fit():
    with pytest.raises(MisconfigurationException, match=r"trainer\.validate\(\)` needs a model"):
        fast_trainer().validate()


def test_datamodule_and_dataloaders_together():
    from trainer_core import LightningDataModule

    with pytest.raises(MisconfigurationException, match=r"datamodule"):
        fast_trainer().fit(Model(), _loader(), datamodule=LightningDataModule())


# ---------------------------------------------------------------------- plugins and devices
def test_unknown_plugin_name_lists_the_known_names():
    with pytest.raises(MisconfigurationException, match=r"plugins='nope'.*Known names:.*single_device"):
        Trainer(plugins="nope")


def test_unknown_strategy_name_lists_the_known_names():
    with pytest.raises(MisconfigurationException, match=r"'nope'.*Known names:.*single_device"):
        Trainer(strategy="nope")


def test_plugin_of_wrong_type():
    with pytest.raises(MisconfigurationException, match=r"plugins=.*TrainingTypePlugin"):
        Trainer(plugins=object())


def test_two_plugins():
    with pytest.raises(MisconfigurationException, match=r"2 training-type plugins.*exactly one"):
        Trainer(plugins=[SingleDevicePlugin(), "single_device"])


@pytest.mark.parametrize("plugin", ["single_device", SingleDevicePlugin()], ids=["name", "instance"])
def test_two_devices_with_the_single_device_plugin(plugin):
    with pytest.raises(MisconfigurationException, match=r"devices=2.*'single_device'.*distributed plugin"):
        Trainer(devices=2, plugins=plugin)


@pytest.mark.parametrize("devices", [0, -2, "two", 1.5])
def test_bad_devices(devices):
    with pytest.raises(MisconfigurationException, match=r"Trainer\(devices="):
        Trainer(devices=devices)


def test_bad_accelerator():
    with pytest.raises(MisconfigurationException, match=r"accelerator='tpu'.*cpu"):
        Trainer(accelerator="tpu")


def test_bad_num_nodes():
    with pytest.raises(MisconfigurationException, match=r"num_nodes=0"):
        Trainer(num_nodes=0)


# ---------------------------------------------------------------------- Trainer arguments
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_steps": -5}, r"max_steps=-5"),
        ({"max_steps": 2.5}, r"max_steps=2\.5"),
        ({"limit_train_batches": 1.5}, r"limit_train_batches=1\.5"),
        ({"limit_val_batches": -0.1}, r"limit_val_batches=-0\.1"),
        ({"limit_test_batches": -1}, r"limit_test_batches=-1"),
        ({"limit_predict_batches": "all"}, r"limit_predict_batches='all'"),
        ({"val_check_interval": 2.0}, r"val_check_interval=2\.0"),
        ({"precision": "bf17"}, r"precision='bf17'.*'32-true'.*'bf16-mixed'"),
        ({"precision": 8}, r"precision=8"),
        ({"gradient_clip_algorithm": "l2"}, r"gradient_clip_algorithm='l2'.*'norm' or 'value'"),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val=-1\.0"),
        ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches=0"),
        ({"log_every_n_steps": 0}, r"log_every_n_steps=0"),
        ({"check_val_every_n_epoch": 0}, r"check_val_every_n_epoch=0"),
        ({"num_sanity_val_steps": -2}, r"num_sanity_val_steps=-2"),
        ({"fast_dev_run": -1}, r"fast_dev_run=-1"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={val}" for k, val in v.items()),
)
def test_bad_trainer_argument_names_it(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        Trainer(**kwargs)


def test_val_check_interval_longer_than_the_epoch():
    class WithVal(Model):
        def validation_step(self, batch, batch_idx):
            self.log("v", 1.0)

    with pytest.raises(
        MisconfigurationException, match=r"val_check_interval=10.*check_val_every_n_epoch=None"
    ):
        fast_trainer(val_check_interval=10).fit(WithVal(), _loader(), _loader())


def test_callbacks_of_the_wrong_type():
    with pytest.raises(
        MisconfigurationException, match=r"callbacks=.*Linear is not a trainer_core\.callbacks\.Callback"
    ):
        Trainer(callbacks=[nn.Linear(1, 1)])


def test_checkpoint_callback_with_checkpointing_disabled():
    from trainer_core.callbacks import ModelCheckpoint

    with pytest.raises(MisconfigurationException, match=r"enable_checkpointing=False"):
        Trainer(enable_checkpointing=False, callbacks=[ModelCheckpoint()])
