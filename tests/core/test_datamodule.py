"""``LightningDataModule``: batch-transfer hooks, ``from_datasets``, ``load_from_checkpoint``, hyper-parameters.

Where Lightning defines the behaviour, the same data module and module run under
``pytorch_lightning.Trainer`` too, and the records (hooks called, batches seen, weights, saved
hyper-parameters) are compared with ours.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import fast_trainer, random_data
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from trainer_core.checkpoint.format import KEY_DATAMODULE, KEY_DATAMODULE_HPARAMS
from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException
from trainer_core.loops.data import batch_mover
from trainer_core.module import LightningModule

pl = pytest.importorskip("pytorch_lightning")


def _classes(module_base: type, data_base: type) -> tuple[type, type]:
    """A module and a data module written once, on either framework's base classes (same qualnames)."""

    class Data(data_base):
        def __init__(self, n: int = 12, batch_size: int = 4, scale: float = 2.0) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.record: list[Any] = []
            self.served = 0

        def train_dataloader(self) -> DataLoader:
            return DataLoader(random_data(self.hparams.n, 3), batch_size=self.hparams.batch_size)

        def val_dataloader(self) -> list[DataLoader]:
            return [DataLoader(random_data(4, 3, seed=s), batch_size=2) for s in (1, 2)]

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            self.record.append(("data.on_before_batch_transfer", dataloader_idx))
            x, y = batch
            return x * self.hparams.scale, y

        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            self.record.append(("data.transfer_batch_to_device", device.type, dataloader_idx))
            self.served += 1
            return [t.to(device) for t in batch]

        def state_dict(self) -> dict[str, Any]:
            return {"served": self.served}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.served = state_dict["served"]

    class Model(module_base):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 1)
            self.record: list[Any] = []

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            # Overridden in both: the data module's wins (Lightning warns), so this never runs.
            self.record.append(("model.on_before_batch_transfer", dataloader_idx))
            return batch

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            self.record.append(("model.on_after_batch_transfer", dataloader_idx))
            x, y = batch
            return x - 1.0, y

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.record.append(("training_step", round(float(x.sum()), 5)))
            return nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.record.append(("validation_step", dataloader_idx, round(float(batch[0].sum()), 5)))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model, Data


def _lightning_trainer(root: Path, **kwargs: Any) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kwargs,
    )


def _fit_both(tmp_path: Path) -> list[tuple[Any, Any, list[str]]]:
    """The test module and data module fitted by trainer-core, then by Lightning: (model, data, warnings) each."""
    results = []
    for module_base, data_base, make_trainer in (
        (LightningModule, LightningDataModule, lambda: fast_trainer(default_root_dir=tmp_path / "ours")),
        (pl.LightningModule, pl.LightningDataModule, lambda: _lightning_trainer(tmp_path / "pl")),
    ):
        model_class, data_class = _classes(module_base, data_base)
        torch.manual_seed(0)
        model, data = model_class(), data_class()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer().fit(model, datamodule=data)
        results.append((model, data, [str(w.message) for w in caught]))
    return results


def test_transfer_hooks_are_chosen_hook_by_hook_as_in_lightning(tmp_path: Path) -> None:
    (ours, our_data, our_warnings), (theirs, their_data, their_warnings) = _fit_both(tmp_path)

    # The data module's on_before_batch_transfer and transfer_batch_to_device, the module's
    # on_after_batch_transfer, for training and for each validation loader (dataloader_idx 0, 1).
    assert our_data.record == their_data.record
    assert our_data.record[:2] == [
        ("data.on_before_batch_transfer", 0),
        ("data.transfer_batch_to_device", "cpu", 0),
    ]
    assert ("data.on_before_batch_transfer", 1) in our_data.record
    assert ours.record == theirs.record
    assert not any(name == "model.on_before_batch_transfer" for name, *_ in ours.record)
    # Each step saw x * 2 - 1: both hooks ran, in order.
    first = next(entry for entry in ours.record if entry[0] == "training_step")
    x = random_data(12, 3).tensors[0][:4]
    assert first[1] == round(float((x * 2 - 1).sum()), 5)
    for ours_p, theirs_p in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(ours_p, theirs_p, rtol=0, atol=0)
    # Both warn that on_before_batch_transfer is defined twice.
    assert any("on_before_batch_transfer" in m and "both" in m for m in our_warnings)
    assert any("on_before_batch_transfer" in m and "both" in m for m in their_warnings)


def test_without_transfer_hooks_batches_take_the_free_path() -> None:
    class Plain(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(random_data(4, 3), batch_size=2)

    model_class, _ = _classes(LightningModule, LightningDataModule)
    model = model_class()
    # Restore the hooks the test classes override: this module overrides none.
    del model_class.on_before_batch_transfer, model_class.on_after_batch_transfer
    trainer = fast_trainer()
    trainer.fit(model, datamodule=Plain())
    assert trainer.hook_runner.batch.batch_transfer is None
    assert batch_mover(trainer) is None  # on the CPU, a batch is not touched at all
    assert len([r for r in model.record if r[0] == "training_step"]) == 2


def test_from_datasets_builds_the_loaders_lightning_builds() -> None:
    train, val_a, val_b, test = (
        random_data(10, 3),
        random_data(4, 3, 1),
        random_data(6, 3, 2),
        random_data(5, 3),
    )
    ours = LightningDataModule.from_datasets(train, [val_a, val_b], test, batch_size=3)
    theirs = pl.LightningDataModule.from_datasets(train, [val_a, val_b], test, batch_size=3)
    for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
        a, b = getattr(ours, name)(), getattr(theirs, name)()
        a_list, b_list = (a, b) if isinstance(a, list) else ([a], [b])
        assert len(a_list) == len(b_list)
        for x, y in zip(a_list, b_list):
            assert x.dataset is y.dataset and x.batch_size == y.batch_size == 3
            assert type(x.sampler) is type(y.sampler)
    assert isinstance(ours.train_dataloader().sampler, RandomSampler)
    assert isinstance(ours.test_dataloader().sampler, SequentialSampler)
    with pytest.raises(NotImplementedError):
        ours.predict_dataloader()  # not given: the hook stays undefined

    class Sized(LightningDataModule):
        def __init__(self, batch_size: int, note: str) -> None:
            super().__init__()
            self.batch_size, self.note = batch_size, note

    dm = Sized.from_datasets(train, batch_size=5, num_workers=0, note="kept")
    assert (dm.batch_size, dm.note) == (
        5,
        "kept",
    )  # batch_size reaches __init__ by name; num_workers does not


def test_from_datasets_trains_as_the_same_loader_does() -> None:
    """Fitting on ``from_datasets`` equals fitting on the loader it describes (shuffled the same way)."""
    model_class, _ = _classes(LightningModule, LightningDataModule)
    del model_class.on_before_batch_transfer, model_class.on_after_batch_transfer
    weights = []
    torch.manual_seed(3)
    initial = torch.cat([p.detach().flatten() for p in model_class().parameters()])
    for use_datamodule in (True, False):
        torch.manual_seed(3)
        model = model_class()
        trainer = fast_trainer()
        if use_datamodule:
            trainer.fit(model, datamodule=LightningDataModule.from_datasets(random_data(12, 3), batch_size=4))
        else:
            trainer.fit(model, DataLoader(random_data(12, 3), batch_size=4, shuffle=True))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    assert not torch.equal(weights[0], initial)


def test_load_from_checkpoint_rebuilds_the_data_module(tmp_path: Path) -> None:
    model_class, data_class = _classes(LightningModule, LightningDataModule)
    data = data_class(n=8, batch_size=2, scale=3.0)
    trainer = fast_trainer(default_root_dir=tmp_path)
    trainer.fit(model_class(), datamodule=data)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved[KEY_DATAMODULE_HPARAMS] == {"n": 8, "batch_size": 2, "scale": 3.0}
    assert saved[KEY_DATAMODULE] == {"served": 8}  # 4 training + 2 x 2 validation batches went through it

    loaded = data_class.load_from_checkpoint(path)
    assert dict(loaded.hparams) == {"n": 8, "batch_size": 2, "scale": 3.0}
    assert loaded.served == 8
    assert (
        data_class.load_from_checkpoint(path, weights_only=True).served == 8
    )  # Lightning's keyword, accepted
    assert loaded.load_from_checkpoint(path, batch_size=6).hparams.batch_size == 6  # keywords win
    hparams_file = tmp_path / "hparams.yaml"
    hparams_file.write_text("scale: 0.5\n")
    from_file = data_class.load_from_checkpoint(path, hparams_file=hparams_file)
    assert (from_file.hparams.scale, from_file.hparams.n) == (0.5, 8)
    # A keyword __init__ does not take is left out, as Lightning does (tests/core/test_lightning_api_gaps.py).
    assert data_class.load_from_checkpoint(path, unknown=1).hparams == loaded.hparams


def test_load_from_checkpoint_passes_one_dict_argument_back_whole(tmp_path: Path) -> None:
    class DictData(LightningDataModule):
        def __init__(self, config: dict) -> None:
            super().__init__()
            self.save_hyperparameters(config)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(random_data(4, 3), batch_size=self.hparams.batch_size)

    model_class, _ = _classes(LightningModule, LightningDataModule)
    del model_class.on_before_batch_transfer, model_class.on_after_batch_transfer
    trainer = fast_trainer()
    trainer.fit(model_class(), datamodule=DictData({"batch_size": 2, "name": "x"}))
    trainer.save_checkpoint(tmp_path / "dict.ckpt")
    loaded = DictData.load_from_checkpoint(tmp_path / "dict.ckpt")
    assert dict(loaded.hparams) == {"batch_size": 2, "name": "x"}


def test_a_lightning_checkpoint_rebuilds_the_data_module(tmp_path: Path) -> None:
    """A ``.ckpt`` written by PyTorch Lightning: its data module's hyper-parameters and state load the same."""
    model_class, data_class = _classes(pl.LightningModule, pl.LightningDataModule)
    trainer = _lightning_trainer(tmp_path)
    trainer.fit(model_class(), datamodule=data_class(n=8, batch_size=2, scale=3.0))
    trainer.save_checkpoint(tmp_path / "pl.ckpt")
    _, our_data_class = _classes(LightningModule, LightningDataModule)
    ours = our_data_class.load_from_checkpoint(tmp_path / "pl.ckpt")
    theirs = data_class.load_from_checkpoint(tmp_path / "pl.ckpt", weights_only=True)
    assert dict(ours.hparams) == dict(theirs.hparams) == {"n": 8, "batch_size": 2, "scale": 3.0}
    assert ours.served == theirs.served == 8  # 4 training + 2 x 2 validation batches


def test_hyperparameters_follow_lightnings_rules() -> None:
    class Base(LightningDataModule):
        def __init__(self, a: int = 1, shared: list | None = None, net: nn.Module | None = None) -> None:
            super().__init__()
            self.save_hyperparameters(ignore="net")

    class Child(Base):
        def __init__(self, b: int = 2, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.save_hyperparameters(ignore="a")  # a later call adds, and can drop what the parent stored

    child = Child(b=3, shared=[1])
    assert dict(child.hparams) == {"b": 3, "shared": [1]}
    child.hparams.shared.append(2)
    assert child.hparams_initial == {"b": 3, "shared": [1]}  # a deep copy, as in Lightning
    child.hparams_initial.shared.append(5)
    assert child.hparams_initial.shared == [1]  # every read is a copy

    class WithNet(LightningDataModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.warns(UserWarning, match="nn.Module"):
        WithNet(nn.Linear(1, 1))
    assert dict(Base(net=nn.Linear(1, 1)).hparams) == {"a": 1, "shared": None}


def test_the_loggers_get_the_module_and_data_hyperparameters(tmp_path: Path) -> None:
    from trainer_core.loggers import CSVLogger

    class HModel(LightningModule):
        def __init__(self, lr: float = 0.1, batch_size: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    class HData(LightningDataModule):
        def __init__(self, batch_size: int = 4, root: str = "data") -> None:
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self) -> DataLoader:
            return DataLoader(random_data(4, 3), batch_size=self.hparams.batch_size)

    logger = CSVLogger(tmp_path)
    fast_trainer(logger=logger).fit(HModel(), datamodule=HData())
    import yaml

    logged = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert logged == {"lr": 0.1, "batch_size": 4, "root": "data"}
    with pytest.raises(MisconfigurationException, match="batch_size"):
        fast_trainer(logger=CSVLogger(tmp_path)).fit(HModel(), datamodule=HData(batch_size=8))


def test_a_saved_hparams_name_counts_only_for_a_named_argument() -> None:
    """Lightning writes ``hparams_name: "kwargs"`` when every argument was saved: that is not one dict argument."""
    from trainer_core.module import hparams_argument

    class Open(LightningDataModule):
        def __init__(self, config: dict | None = None, *args: Any, **kwargs: Any) -> None:
            super().__init__()

    assert hparams_argument(Open, "config") == "config"
    assert hparams_argument(Open, "kwargs") is None and hparams_argument(Open, "args") is None
    assert hparams_argument(Open, "missing") is None and hparams_argument(Open, None) is None
