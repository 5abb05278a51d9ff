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


def test_a_users_subclasses_of_the_default_callbacks_count_as_those_defaults():
    """The Trainer asks whether a callback is a checkpoint, a bar or a summary without importing those modules
    first; a user's subclass, defined in the user's own module, is still found (its module loaded theirs)."""
    from trainer_core.callbacks import ModelCheckpoint, ModelSummary, TQDMProgressBar

    class MyCheckpoint(ModelCheckpoint):
        pass

    class MyBar(TQDMProgressBar):
        pass

    class MySummary(ModelSummary):
        pass

    with pytest.raises(MisconfigurationException, match=r"enable_checkpointing=False"):
        Trainer(enable_checkpointing=False, callbacks=[MyCheckpoint()])
    with pytest.raises(MisconfigurationException, match=r"enable_progress_bar=False"):
        Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[MyBar()])
    bar, summary = MyBar(), MySummary()
    trainer = Trainer(logger=False, enable_checkpointing=False, callbacks=[bar, summary])
    assert trainer.callbacks == [bar, summary]


# ---------------------------------------------------------------------- checkpoint values of the wrong kind
def _nan_epoch(checkpoint: dict) -> None:
    checkpoint["epoch"] = float("nan")


WRONG_VALUES = [
    # (edit of a trainer-core checkpoint, the key the error names)
    (lambda c: c.update(epoch="1"), "'epoch': a str"),
    (_nan_epoch, "'epoch': float nan"),
    (lambda c: c.update(global_step=-1), "'global_step': int -1"),
    (lambda c: c.update(global_step=True), "'global_step': bool True"),
    (lambda c: c.update(state_dict=[1, 2]), "'state_dict': a list"),
    (
        lambda c: c.update(state_dict={**c["state_dict"], 3: torch.ones(1)}),
        "'state_dict': a dict with the key int 3",
    ),
    (lambda c: c.update(optimizer_states={"state": {}}), "'optimizer_states': a dict"),
    (lambda c: c.update(optimizer_states=[1]), "'optimizer_states': a list with an item of type int"),
    (lambda c: c.update(lr_schedulers="StepLR"), "'lr_schedulers': a str"),
    (lambda c: c.update(loops=[0]), "'loops': a list"),
    (lambda c: c["loops"].update(epoch=-2), "'loops.epoch': int -2"),
    (lambda c: c["loops"].update(epoch_finished="no"), "'loops.epoch_finished': a str"),
    (lambda c: c["loops"].update(batches_that_stepped=1.5), "'loops.batches_that_stepped': float 1.5"),
    (lambda c: c.update(callbacks=["ModelCheckpoint"]), "'callbacks': a list"),
    (lambda c: c.update(rng_states=3), "'rng_states': int 3"),
    (lambda c: c.update(precision=[1.0]), "'precision': a list"),
    (lambda c: c.update(hyper_parameters=[1, 2]), "'hyper_parameters': a list"),
    (lambda c: c.update(hparams_name=["hparams"]), "'hparams_name': a list"),
    (lambda c: c["optimizer_states"][0].update(state=[1]), "'optimizer_states[0]': its 'state' is a list"),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(params=5),
        "'optimizer_states[0]': 'param_groups[0].params' is int 5",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr="0.1"),
        "'optimizer_states[0]': 'param_groups[0].lr' is a str",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(momentum="0.9"),
        "'optimizer_states[0]': 'param_groups[0].momentum' is a str",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(betas=1.5),
        "'optimizer_states[0]': 'param_groups[0].betas' is float 1.5",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(betas=(0.9, 1.5)),
        "'optimizer_states[0]': 'param_groups[0].betas' is a tuple",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr=float("inf")),
        "'optimizer_states[0]': 'param_groups[0].lr' is float inf",
    ),
    (
        lambda c: c["optimizer_states"][0]["state"].update({"layer.weight": {"step": torch.tensor(-1e30)}}),
        "'optimizer_states[0]': 'state['layer.weight'].step' is a Tensor",
    ),
    (
        lambda c: c["optimizer_states"][0]["state"].update({"layer.weight": {"step": torch.ones(3)}}),
        "'optimizer_states[0]': 'state['layer.weight'].step' is a Tensor",
    ),
    (
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(nesterov=1),
        "'optimizer_states[0]': 'param_groups[0].nesterov' is int 1",
    ),
    (
        lambda c: c["optimizer_states"][0]["state"].update({"layer.weight": {"momentum_buffer": {}}}),
        "'optimizer_states[0]': 'state['layer.weight'].momentum_buffer' is a dict",
    ),
    (lambda c: c["loops"].update(per_rank=2), "'loops.per_rank': int 2"),
    (lambda c: c["rng_states"].update(torch=5), "'rng_states': the random generators do not take it"),
    (lambda c: c["rng_states"].update(python=(3,)), "'rng_states': the random generators do not take it"),
    (lambda c: c.update(rng_states_per_rank=4), "'rng_states_per_rank': int 4"),
]


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict:
    trainer = fast_trainer(max_steps=2)
    trainer.fit(Model(), _loader())
    path = tmp_path_factory.mktemp("saved") / "model.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(
    ("edit", "match"), WRONG_VALUES, ids=[case[1].split(":")[0] for case in WRONG_VALUES]
)
def test_a_checkpoint_value_of_the_wrong_kind_names_the_file_and_key(saved_checkpoint, tmp_path, edit, match):
    """Each is one CheckpointError before anything loads: the model and the optimizer stay as they were."""
    import copy
    import re

    from trainer_core.errors import CheckpointError

    checkpoint = copy.deepcopy(saved_checkpoint)
    edit(checkpoint)
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    model = Model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = fast_trainer(max_steps=4)

    with pytest.raises(CheckpointError, match=re.escape(str(path)) + " has an invalid " + re.escape(match)):
        trainer.fit(model, _loader(), ckpt_path=str(path))
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert trainer.global_step == 0 and all(opt.state_dict()["state"] == {} for opt in trainer.optimizers)


def test_a_weight_that_is_not_a_tensor_is_named(saved_checkpoint, tmp_path):
    import copy
    import re

    from trainer_core.errors import CheckpointError

    checkpoint = copy.deepcopy(saved_checkpoint)
    checkpoint["state_dict"]["layer.weight"] = "0.5"
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    model = Model()
    before = model.layer.weight.detach().clone()

    with pytest.raises(
        CheckpointError, match=r"(?s)" + re.escape(str(path)) + r".*not a tensor.*layer\.weight: str"
    ):
        fast_trainer(max_steps=4).fit(model, _loader(), ckpt_path=str(path))
    with pytest.raises(
        CheckpointError, match=r"(?s)" + re.escape(str(path)) + r".*not a tensor.*layer\.weight: str"
    ):
        Model.load_from_checkpoint(path)
    assert torch.equal(model.layer.weight, before)


def test_optimizer_state_of_another_shape_is_refused_before_the_weights_load(saved_checkpoint, tmp_path):
    """It would load without complaint and fail the first step, after the weights had loaded."""
    import copy
    import re

    from trainer_core.errors import CheckpointError

    checkpoint = copy.deepcopy(saved_checkpoint)
    checkpoint["optimizer_states"][0]["state"]["layer.weight"] = {"momentum_buffer": torch.zeros(7)}
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    model = Model()
    before = model.layer.weight.detach().clone()

    with pytest.raises(
        CheckpointError,
        match=re.escape(str(path)) + r".*layer\.weight: momentum_buffer \(7,\) vs parameter \(1, 3\)",
    ):
        fast_trainer(max_steps=4).fit(model, _loader(), ckpt_path=str(path))
    assert torch.equal(model.layer.weight, before)
