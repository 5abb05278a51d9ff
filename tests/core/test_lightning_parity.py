"""What a Lightning program meets first: the step signatures, the results of ``validate``/``test``,
the resume order and the import paths, ``weights_only``, when ``last.ckpt`` is written, what
``hparams.yaml`` holds and the random generators at every hook, each run side by side with
Lightning itself.

Every test builds one module class twice, once on trainer-core's base classes and once on
Lightning's (``pytorch_lightning`` is installed with the test extras), runs both with the same
seed and data, and compares what a user reads: losses, weights, returned metrics, the order of
hooks.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pickle
import random
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from boring import random_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainer_core
from trainer_core.errors import MisconfigurationException

pl = pytest.importorskip("pytorch_lightning")

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def _trainer(framework: Any, **kwargs: Any) -> Any:
    kwargs = {**QUIET, "max_epochs": 2, "num_sanity_val_steps": 0, **kwargs}
    if framework is pl:
        kwargs.update(accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return framework.Trainer(**kwargs)


def _loader(n: int = 24, batch_size: int = 4) -> DataLoader:
    return DataLoader(random_data(n, 3), batch_size=batch_size)


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------- steps without batch_idx
def _module_without_batch_idx(framework: Any) -> Any:
    class NoBatchIdx(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.losses: list[float] = []
            self.seen: list[tuple[str, int]] = []

        def training_step(self, batch):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def test_step(self, batch, batch_idx):
            self.seen.append(("test", batch_idx))

        def predict_step(self, batch):
            return self.net(batch[0])

        def on_train_batch_start(self, batch, batch_idx):
            self.seen.append(("train", batch_idx))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return NoBatchIdx


def test_steps_without_batch_idx_run_as_in_lightning() -> None:
    """``training_step(self, batch)`` and friends get only what they declare; batch hooks still get the index."""
    runs = {}
    for framework in (trainer_core, pl):
        torch.manual_seed(0)
        model = _module_without_batch_idx(framework)()
        trainer = _trainer(framework)
        _quietly(trainer.fit, model, _loader(), _loader(8))
        val = _quietly(trainer.validate, model, _loader(8), verbose=False)
        _quietly(trainer.test, model, _loader(8), verbose=False)
        predictions = _quietly(trainer.predict, model, _loader(8))
        runs[framework.__name__] = (model, val, torch.cat(predictions))
    ours, theirs = runs["trainer_core"], runs["pytorch_lightning"]
    assert len(ours[0].losses) == 12
    assert ours[0].losses == theirs[0].losses
    assert ours[0].seen == theirs[0].seen
    for a, b in zip(ours[0].parameters(), theirs[0].parameters()):
        assert torch.equal(a, b)
    assert ours[1] == theirs[1]
    assert torch.equal(ours[2], theirs[2])


class _TwoLoaders(trainer_core.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def validation_step(self, batch, batch_idx):
        self.log("v", self.net(batch[0]).mean())


def test_several_loaders_need_a_dataloader_idx_parameter() -> None:
    trainer = _trainer(trainer_core)
    with pytest.raises(
        MisconfigurationException, match=r"2 dataloaders.*`validation_step`.*dataloader_idx=0"
    ):
        trainer.validate(_TwoLoaders(), [_loader(8), _loader(8)], verbose=False)

    class Required(_TwoLoaders):
        def validation_step(self, batch, batch_idx, dataloader_idx):
            self.log("v", self.net(batch[0]).mean())

    with pytest.raises(MisconfigurationException, match=r"One dataloader.*requires `dataloader_idx`"):
        _trainer(trainer_core).validate(Required(), _loader(8), verbose=False)
    # Both loaders, with the index: runs, a dict per loader.
    results = _trainer(trainer_core).validate(Required(), [_loader(8), _loader(8, 2)], verbose=False)
    assert [list(r) for r in results] == [["v/dataloader_idx_0"], ["v/dataloader_idx_1"]]


# ---------------------------------------------------------------------- validate/test results
def _logging_module(framework: Any) -> Any:
    class Logs(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)

        def _log_all(self, stage: str, batch: Any) -> None:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log(f"{stage}_both", loss, on_step=True, on_epoch=True)
            self.log(f"{stage}_epoch_only", loss * 2)
            self.log(f"{stage}_bar_only", loss * 3, prog_bar=True, logger=False)
            self.log(f"{stage}_step_only", loss * 4, on_step=True, on_epoch=False)
            self.log(f"{stage}_sum", loss, reduce_fx="sum", on_step=True, on_epoch=True, prog_bar=True)

        def validation_step(self, batch, batch_idx):
            self._log_all("val", batch)

        def test_step(self, batch, batch_idx):
            self._log_all("test", batch)

        def on_validation_epoch_end(self) -> None:
            self.log("val_at_end", torch.tensor(7.0))

    return Logs


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_results_have_lightning_names_and_values(stage: str) -> None:
    """Only the logged names come back, ``_epoch`` for a metric logged per step and per epoch."""
    results = {}
    for framework in (trainer_core, pl):
        torch.manual_seed(0)
        model = _logging_module(framework)()
        trainer = _trainer(framework)
        out = _quietly(getattr(trainer, stage), model, _loader(12, 5), verbose=False)
        results[framework.__name__] = (
            out,
            dict(trainer.callback_metrics),
            dict(trainer.progress_bar_metrics),
        )
    (ours, our_cb, our_bar), (theirs, their_cb, their_bar) = (
        results["trainer_core"],
        results["pytorch_lightning"],
    )
    assert [sorted(r) for r in ours] == [sorted(r) for r in theirs]
    prefix = "val" if stage == "validate" else "test"
    assert f"{prefix}_both_epoch" in ours[0] and f"{prefix}_both" not in ours[0]
    for key, value in theirs[0].items():
        assert ours[0][key] == pytest.approx(value, rel=1e-6), key
    # The callbacks see both names, as in Lightning; the bar shows the epoch names (Lightning's, read after
    # the run, also keeps the last step value of a metric logged on both).
    assert sorted(our_cb) == sorted(their_cb)
    assert set(our_bar) <= set(their_bar) and f"{prefix}_bar_only" in our_bar


# ---------------------------------------------------------------------- resume order
def _resume_module(framework: Any, calls: list[str]) -> Any:
    class Grows(framework.LightningModule):
        """A model whose ``on_load_checkpoint`` adds the layer the checkpoint says it had (a common pattern)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.extra = None

        def configure_model(self) -> None:
            calls.append("module.configure_model")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.net(x)
            return out if self.extra is None else out + self.extra(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["has_extra"] = self.extra is not None

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            calls.append("module.on_load_checkpoint")
            if checkpoint["has_extra"] and self.extra is None:
                self.extra = nn.Linear(3, 1)

        def configure_optimizers(self):
            calls.append("module.configure_optimizers")
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def on_fit_start(self) -> None:
            calls.append("module.on_fit_start")

        def on_train_start(self) -> None:
            calls.append(f"module.on_train_start step={self.trainer.global_step}")

    class Recorder(framework.Callback):
        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            calls.append("callback.on_load_checkpoint")

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            calls.append("callback.load_state_dict")

        def state_dict(self) -> dict[str, Any]:
            return {"kept": 1}

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            calls.append("callback.on_fit_start")

    return Grows, Recorder


def test_resume_calls_the_checkpoint_hooks_before_configure_optimizers(tmp_path: Path) -> None:
    """``on_load_checkpoint`` may change the model; the optimizer made after it covers the change."""
    recorded = {}
    weights = {}
    for framework in (trainer_core, pl):
        calls: list[str] = []
        grows, recorder = _resume_module(framework, calls)
        torch.manual_seed(0)
        model = grows()
        model.extra = nn.Linear(3, 1)
        trainer = _trainer(framework, max_epochs=1, callbacks=[recorder()])
        _quietly(trainer.fit, model, _loader())
        path = tmp_path / f"{framework.__name__}.ckpt"
        trainer.save_checkpoint(path)

        calls.clear()
        torch.manual_seed(1)
        resumed = grows()  # without the extra layer: on_load_checkpoint adds it
        trainer = _trainer(framework, max_epochs=2, callbacks=[recorder()])
        _quietly(trainer.fit, resumed, _loader(), ckpt_path=path)
        recorded[framework.__name__] = calls
        weights[framework.__name__] = [p.detach().clone() for p in resumed.parameters()]
    assert recorded["trainer_core"] == recorded["pytorch_lightning"]
    assert recorded["trainer_core"] == [
        "module.configure_model",
        "module.on_load_checkpoint",
        "callback.on_load_checkpoint",
        "callback.load_state_dict",
        "module.configure_optimizers",
        "callback.on_fit_start",
        "module.on_fit_start",
        "module.on_train_start step=6",
    ]
    for ours, theirs in zip(weights["trainer_core"], weights["pytorch_lightning"]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_on_load_checkpoint_may_rename_weights(tmp_path: Path) -> None:
    """A checkpoint saved under old layer names loads once the module's hook renames them (checked after it)."""
    from boring import BoringModel

    torch.manual_seed(0)
    model = BoringModel(features=3)
    trainer = trainer_core.Trainer(**QUIET, max_epochs=1)
    trainer.fit(model, _loader())
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"] = {k.replace("net.", "body."): v for k, v in checkpoint["state_dict"].items()}
    for state in checkpoint["optimizer_states"]:
        state["state"] = {k.replace("net.", "body."): v for k, v in state["state"].items()}
        for group in state["param_groups"]:
            group["params"] = [n.replace("net.", "body.") for n in group["params"]]
    torch.save(checkpoint, path)

    class Renames(BoringModel):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["state_dict"] = {
                k.replace("body.", "net."): v for k, v in checkpoint["state_dict"].items()
            }
            for state in checkpoint["optimizer_states"]:
                state["state"] = {k.replace("body.", "net."): v for k, v in state["state"].items()}
                for group in state["param_groups"]:
                    group["params"] = [n.replace("body.", "net.") for n in group["params"]]

    torch.manual_seed(1)
    resumed = Renames(features=3)
    trainer_core.Trainer(**QUIET, max_epochs=1).fit(resumed, _loader(), ckpt_path=path)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

    # Without the hook the names do not fit: one clear error, and the model as it was.
    torch.manual_seed(1)
    plain = BoringModel(features=3)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.raises(trainer_core.errors.CheckpointError, match=r"(?s)old\.ckpt.*body\.0\.weight"):
        trainer_core.Trainer(**QUIET, max_epochs=2).fit(plain, _loader(), ckpt_path=path)
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())


# ---------------------------------------------------------------------- import paths
def test_lightning_import_paths() -> None:
    from trainer_core import Callback
    from trainer_core.callbacks import Callback as CallbackFromPackage
    from trainer_core.core import LightningDataModule, LightningModule
    from trainer_core.core.optimizer import LightningOptimizer

    assert Callback is CallbackFromPackage
    assert LightningModule is trainer_core.LightningModule
    assert LightningDataModule is trainer_core.LightningDataModule

    class Manual(trainer_core.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = nn.Linear(3, 1)
            self.kinds: list[type] = []

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.kinds.append(type(opt))
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Manual()
    _trainer(trainer_core, max_epochs=1).fit(model, _loader(8))
    assert model.kinds == [LightningOptimizer, LightningOptimizer]


# ---------------------------------------------------------------------- weights_only (how ckpt_path is unpickled)
#: A hyper-parameter no allow-list names: Lightning pickles it into the checkpoint.
_CLAMP = functools.partial(torch.clamp, min=-1.0, max=1.0)


def _partial_module(framework: Any) -> Any:
    class WithPartial(framework.LightningModule):
        def __init__(self, activation: Any = _CLAMP) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.hparams.activation(self.net(x)), y)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def test_step(self, batch, batch_idx):
            self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return WithPartial


def _all_entry_points(framework: Any, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """fit (resumed to a second epoch), validate, test and predict, each from the checkpoint at ``path``."""
    module = _partial_module(framework)
    torch.manual_seed(1)
    model = module()
    _quietly(
        _trainer(framework).fit, model, _loader(8), _loader(8), ckpt_path=path, weights_only=weights_only
    )
    evaluated = {
        stage: _quietly(
            getattr(_trainer(framework), stage),
            module(),
            _loader(8),
            ckpt_path=path,
            weights_only=weights_only,
        )
        for stage in ("validate", "test")
    }
    predicted = _quietly(
        _trainer(framework).predict, module(), _loader(8), ckpt_path=path, weights_only=weights_only
    )
    return {"weights": [p.detach() for p in model.parameters()], **evaluated, "predict": torch.cat(predicted)}


def test_weights_only_false_loads_a_checkpoint_whose_hparams_hold_a_partial(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = _trainer(pl, max_epochs=1)
    _quietly(trainer.fit, _partial_module(pl)(), _loader(8), _loader(8))
    path = tmp_path / "partial.ckpt"
    trainer.save_checkpoint(path)

    theirs = _all_entry_points(pl, path, weights_only=False)
    ours = _all_entry_points(trainer_core, path, weights_only=False)
    for a, b in zip(ours["weights"], theirs["weights"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert ours["validate"] == theirs["validate"] and ours["test"] == theirs["test"]
    torch.testing.assert_close(ours["predict"], theirs["predict"], rtol=0, atol=1e-6)

    # The default loads nothing that runs code, under both: Lightning's torch error, our error naming the file.
    with pytest.raises(pickle.UnpicklingError):
        _quietly(_trainer(pl).validate, _partial_module(pl)(), _loader(8), ckpt_path=path)
    for stage in ("fit", "validate", "test", "predict"):
        with pytest.raises(trainer_core.errors.CheckpointError) as error:
            _quietly(
                getattr(_trainer(trainer_core), stage),
                _partial_module(trainer_core)(),
                _loader(8),
                ckpt_path=path,
            )
        assert str(path) in str(error.value) and "functools.partial" in str(error.value)
        assert "weights_only=False" in str(error.value)


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_weights_only_is_the_last_argument_with_lightnings_default(stage: str) -> None:
    ours = inspect.signature(getattr(trainer_core.Trainer, stage)).parameters
    theirs = inspect.signature(getattr(pl.Trainer, stage)).parameters
    assert list(ours) == list(theirs)
    assert ours["weights_only"].default is theirs["weights_only"].default is None
    assert "weights_only" in getattr(trainer_core.Trainer, stage).__doc__


# ---------------------------------------------------------------------- ModelCheckpoint(save_last=...)
#: A validation loss that worsens in some epochs: the last epoch saves no top-k checkpoint.
_VAL_LOSSES = [3.0, 2.0, 2.5, 1.0, 4.0, 5.0]


def _monitored_module(framework: Any) -> Any:
    class Monitored(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.start_epoch = -1

        def on_train_start(self) -> None:
            self.start_epoch = self.current_epoch

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.tensor(_VAL_LOSSES[self.current_epoch % len(_VAL_LOSSES)]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Monitored


def _checkpoint_files(
    framework: Any, folder: Path, callback_kwargs: dict[str, Any], **fit_kwargs: Any
) -> Any:
    """What ``ModelCheckpoint(**callback_kwargs)`` leaves in ``folder``: names, (epoch, step) inside, links."""
    callbacks = pl.callbacks if framework is pl else trainer_core.callbacks
    model = _monitored_module(framework)()
    trainer = _trainer(
        framework,
        max_epochs=6,
        enable_checkpointing=True,
        callbacks=[callbacks.ModelCheckpoint(dirpath=folder, **callback_kwargs)],
    )
    _quietly(trainer.fit, model, _loader(8), _loader(8), **fit_kwargs)
    inside = {}
    for file in sorted(folder.iterdir()):
        checkpoint = torch.load(file, map_location="cpu", weights_only=False)
        inside[file.name] = (checkpoint["epoch"], checkpoint["global_step"])
    links = {f.name: os.readlink(f) for f in folder.iterdir() if f.is_symlink()}
    return inside, links, model.start_epoch


@pytest.mark.parametrize(
    "callback_kwargs",
    [
        {"monitor": "val_loss", "save_top_k": 1, "mode": "min", "save_last": True},
        {"monitor": "val_loss", "save_top_k": 1, "mode": "min", "save_last": True, "every_n_epochs": 2},
        {"monitor": "val_loss", "save_top_k": 1, "mode": "min", "save_last": "link"},
        {"save_last": True, "save_top_k": 0},
        {"monitor": "val_loss", "save_last": True, "every_n_train_steps": 5},
    ],
    ids=["monitored", "every-2-epochs", "link", "no-top-k", "every-5-steps"],
)
def test_save_last_writes_last_ckpt_when_lightning_does(
    tmp_path: Path, callback_kwargs: dict[str, Any]
) -> None:
    found = {
        framework.__name__: _checkpoint_files(framework, tmp_path / framework.__name__, callback_kwargs)
        for framework in (pl, trainer_core)
    }
    assert found["trainer_core"] == found["pytorch_lightning"]
    assert "last.ckpt" in found["trainer_core"][0]


def test_resuming_from_last_ckpt_starts_at_lightnings_epoch(tmp_path: Path) -> None:
    callback_kwargs = {"monitor": "val_loss", "save_top_k": 1, "mode": "min", "save_last": True}
    start = {}
    for framework in (pl, trainer_core):
        folder = tmp_path / framework.__name__
        inside, _, _ = _checkpoint_files(framework, folder, callback_kwargs)
        assert inside["last.ckpt"] == (3, 8)  # the best epoch's, not the last epoch's
        resumed = tmp_path / f"{framework.__name__}-resumed"
        _, _, start[framework.__name__] = _checkpoint_files(
            framework, resumed, callback_kwargs, ckpt_path=folder / "last.ckpt"
        )
    assert start["trainer_core"] == start["pytorch_lightning"] == 4


# ---------------------------------------------------------------------- hparams.yaml
_NESTED_HPARAMS = {
    "model_hparams": {"c_hidden": [16, 32], "act": "relu", "blocks": {"kernel": (3, 3), "norm": None}},
    "optimizer_name": "Adam",
    "optimizer_hparams": {"lr": 1e-3, "betas": (0.9, 0.99)},
    "seed": 42,
    "note": "a: b",
    "act_fn": nn.GELU,
}


def _nested_module(framework: Any) -> Any:
    class Nested(framework.LightningModule):
        def __init__(self, model_hparams, optimizer_name, optimizer_hparams, seed, note, act_fn) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.optimizer_hparams["lr"])

    return Nested


@pytest.mark.parametrize("logger", ["CSVLogger", "TensorBoardLogger"])
def test_hparams_yaml_is_lightnings_and_loads_back_as_saved(tmp_path: Path, logger: str) -> None:
    yaml = pytest.importorskip("yaml")
    if logger == "TensorBoardLogger":
        pytest.importorskip("tensorboard")
    texts, loaded = {}, {}
    for framework in (pl, trainer_core):
        loggers = pl.loggers if framework is pl else trainer_core.loggers
        run_logger = getattr(loggers, logger)(tmp_path / framework.__name__)
        trainer = _trainer(framework, max_epochs=1, logger=run_logger)
        _quietly(trainer.fit, _nested_module(framework)(**_NESTED_HPARAMS), _loader(8))
        path = tmp_path / f"{framework.__name__}.ckpt"
        _quietly(trainer.save_checkpoint, path)
        hparams_file = Path(run_logger.log_dir) / "hparams.yaml"
        texts[framework.__name__] = hparams_file.read_text()
        # Lightning's own reader (yaml.full_load) takes its tuples: ours must read them too.
        loaded[framework.__name__] = _quietly(
            _nested_module(framework).load_from_checkpoint,
            path,
            hparams_file=hparams_file,
            weights_only=False,
        ).hparams
    assert texts["trainer_core"] == texts["pytorch_lightning"]
    assert yaml.load(texts["trainer_core"], Loader=yaml.FullLoader) == _NESTED_HPARAMS
    assert dict(loaded["trainer_core"]) == dict(loaded["pytorch_lightning"]) == _NESTED_HPARAMS


# ---------------------------------------------------------------------- the generators at every hook
_RNG_HOOKS = (
    "setup",
    "on_fit_start",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_save_checkpoint",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
)
#: (seed_everything's seed or None, its ``workers``, the DataLoaders' ``num_workers``)
_RNG_SETTINGS = {"plain": (None, False, 0), "seeded": (7, False, 0), "workers": (7, True, 2)}


def _generator_states() -> dict[str, str]:
    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:12]

    return {
        "python": digest(pickle.dumps(random.getstate())),
        "numpy": digest(pickle.dumps(np.random.get_state())),
        "torch": digest(torch.get_rng_state().numpy().tobytes()),
    }


def _state_recorder(framework: Any) -> Any:
    base = pl.Callback if framework is pl else trainer_core.callbacks.Callback

    def record(hook: str) -> Any:
        def hook_fn(self: Any, *args: Any, **kwargs: Any) -> None:
            self.seen.append((hook, _generator_states()))

        return hook_fn

    return type("StateRecorder", (base,), {hook: record(hook) for hook in _RNG_HOOKS})


class _RandomShuffle(torch.utils.data.Sampler):
    """A sampler of the kind third-party programs write: it shuffles with Python's ``random``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


def _seen_batches_module(framework: Any) -> Any:
    class SeenBatches(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.batches: list[list[int]] = []

        def training_step(self, batch, batch_idx):
            x, index = batch
            self.batches.append(index.tolist())
            return self.net(x).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.net(batch[0]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return SeenBatches


def _states_at_hooks(framework: Any, root: Path, setting: str) -> dict[str, Any]:
    """A fit under the default logger, a ModelCheckpoint and the default (rich) model summary."""
    seed, workers, num_workers = _RNG_SETTINGS[setting]
    data = TensorDataset(torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), torch.arange(8))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    if seed is not None:
        framework.seed_everything(seed, workers=workers, verbose=False)
    callbacks = pl.callbacks if framework is pl else trainer_core.callbacks
    recorder = _state_recorder(framework)()
    recorder.seen = []
    kwargs: dict[str, Any] = {
        "max_epochs": 2,
        "enable_progress_bar": False,
        "default_root_dir": root,
        "callbacks": [callbacks.ModelCheckpoint(monitor="val_loss"), recorder],
    }
    if framework is pl:
        kwargs.update(accelerator="cpu", devices=1)
    model = _seen_batches_module(framework)()
    train = DataLoader(data, batch_size=4, sampler=_RandomShuffle(8), num_workers=num_workers)
    val = DataLoader(data, batch_size=4, num_workers=num_workers)
    _quietly(lambda: framework.Trainer(**kwargs).fit(model, train, val))
    return {"hooks": recorder.seen, "batches": model.batches}


@pytest.fixture(scope="module")
def generator_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per setting and framework, the generators' states at every hook and the batches trained on.

    ``pytorch_lightning`` imported ``rich`` with itself; trainer-core imports it during its first
    fit, and rich's import draws from Python's ``random``: that run sees rich as not imported yet.
    """
    root = tmp_path_factory.mktemp("generators")
    found: dict[str, dict[str, Any]] = {}
    for setting in _RNG_SETTINGS:
        found[setting] = {"pytorch_lightning": _states_at_hooks(pl, root / f"pl-{setting}", setting)}
        rich = {
            name: module for name, module in sys.modules.items() if name == "rich" or name.startswith("rich.")
        }
        for name in rich:
            del sys.modules[name]
        try:
            found[setting]["trainer_core"] = _states_at_hooks(trainer_core, root / f"tc-{setting}", setting)
        finally:
            sys.modules.update(rich)
    return found


def _sequence(found: dict[str, Any], generator: str) -> list[tuple[str, str]]:
    return [(hook, states[generator]) for hook, states in found["hooks"]]


@pytest.mark.parametrize("setting", ["plain", "seeded"])
def test_python_and_numpy_generators_at_every_hook_as_in_lightning(
    generator_states: dict[str, dict[str, Any]], setting: str
) -> None:
    ours, theirs = generator_states[setting]["trainer_core"], generator_states[setting]["pytorch_lightning"]
    assert [hook for hook, _ in ours["hooks"]] == [hook for hook, _ in theirs["hooks"]]
    for generator in ("python", "numpy"):
        assert _sequence(ours, generator) == _sequence(theirs, generator), generator


@pytest.mark.parametrize("setting", list(_RNG_SETTINGS))
def test_a_random_shuffle_sampler_trains_on_lightnings_batches(
    generator_states: dict[str, dict[str, Any]], setting: str
) -> None:
    ours, theirs = generator_states[setting]["trainer_core"], generator_states[setting]["pytorch_lightning"]
    assert ours["batches"] == theirs["batches"]
    assert len(ours["batches"]) == 4


@pytest.mark.parametrize("setting", list(_RNG_SETTINGS))
def test_torch_generator_at_every_hook_as_in_lightning(
    generator_states: dict[str, dict[str, Any]], setting: str
) -> None:
    ours, theirs = generator_states[setting]["trainer_core"], generator_states[setting]["pytorch_lightning"]
    assert _sequence(ours, "torch") == _sequence(theirs, "torch")


def test_python_generator_with_workers_at_every_hook_as_in_lightning(
    generator_states: dict[str, dict[str, Any]],
) -> None:
    ours, theirs = (
        generator_states["workers"]["trainer_core"],
        generator_states["workers"]["pytorch_lightning"],
    )
    assert _sequence(ours, "python") == _sequence(theirs, "python")


def test_save_on_exception_saves_what_lightning_saves(tmp_path: Path) -> None:
    found = {}
    for framework in (pl, trainer_core):
        base = _monitored_module(framework)

        class FailsAtStep5(base):
            def training_step(self, batch, batch_idx):
                if self.global_step == 5:
                    raise RuntimeError("step 5")
                return super().training_step(batch, batch_idx)

        callbacks = pl.callbacks if framework is pl else trainer_core.callbacks
        folder = tmp_path / framework.__name__
        checkpoint = callbacks.ModelCheckpoint(
            dirpath=folder, monitor="val_loss", save_last=True, save_on_exception=True
        )
        trainer = _trainer(framework, max_epochs=6, enable_checkpointing=True, callbacks=[checkpoint])
        with pytest.raises(RuntimeError, match="step 5"):
            _quietly(trainer.fit, FailsAtStep5(), _loader(8), _loader(8))
        found[framework.__name__] = {
            file.name: torch.load(file, weights_only=False)["global_step"]
            for file in sorted(folder.iterdir())
        }
    assert found["trainer_core"] == found["pytorch_lightning"]
    assert found["trainer_core"]["last.ckpt"] == 5


# ---------------------------------------------------------------------- evaluation entry points' generators
def _evaluation_states(framework: Any, stage: str) -> dict[str, Any]:
    """Torch's generator at each hook of ``stage`` over two shuffled loaders, and the batches each step saw."""
    prefix = {"validate": "validation", "test": "test", "predict": "predict"}[stage]
    hooks = [f"on_{prefix}_{name}" for name in ("start", "epoch_start", "batch_start", "batch_end", "end")]
    base = pl.Callback if framework is pl else trainer_core.callbacks.Callback

    def record(hook: str) -> Any:
        def hook_fn(self: Any, *args: Any, **kwargs: Any) -> None:
            self.seen.append((hook, _generator_states()["torch"]))

        return hook_fn

    recorder = type("TorchRecorder", (base,), {hook: record(hook) for hook in hooks})()
    recorder.seen = []
    seen: list[list[int]] = []

    class Steps(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)

        def _step(self, batch, batch_idx, dataloader_idx=0):
            seen.append(batch[1].tolist())
            return self.net(batch[0]).sum()

        validation_step = test_step = predict_step = _step

    data = TensorDataset(torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), torch.arange(8))
    loaders = [DataLoader(data, batch_size=4, shuffle=True) for _ in range(2)]
    torch.manual_seed(0)
    trainer = _trainer(framework, callbacks=[recorder])
    _quietly(getattr(trainer, stage), Steps(), loaders)
    return {"hooks": recorder.seen, "batches": seen}


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_torch_generator_at_evaluation_hooks_as_in_lightning(stage: str) -> None:
    ours, theirs = _evaluation_states(trainer_core, stage), _evaluation_states(pl, stage)
    assert ours == theirs
    assert len(ours["batches"]) == 4


class _EpochRecorder(torch.utils.data.SequentialSampler):
    def __init__(self, data: Any) -> None:
        super().__init__(data)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_validation_samplers_get_the_training_epoch_as_in_lightning() -> None:
    found = {}
    for framework in (pl, trainer_core):
        data = random_data(8, 3)
        sampler = _EpochRecorder(data)
        model = _monitored_module(framework)()
        trainer = _trainer(framework, max_epochs=3, num_sanity_val_steps=1)
        _quietly(trainer.fit, model, _loader(8), DataLoader(data, batch_size=4, sampler=sampler))
        found[framework.__name__] = sampler.epochs
    assert found["trainer_core"] == found["pytorch_lightning"] == [0, 0, 1, 2]


def test_predict_loop_before_the_first_predict_is_lightnings() -> None:
    found = {}
    for framework in (pl, trainer_core):
        loop = _trainer(framework).predict_loop
        found[framework.__name__] = (
            loop.current_batch_indices,
            loop.epoch_batch_indices,
            loop.predictions,
            loop.return_predictions,
        )
    assert found["trainer_core"] == found["pytorch_lightning"] == ([], [], [], False)


class _Stream(torch.utils.data.IterableDataset):
    """Unsized data whose pass draws from torch's generator when it begins."""

    def __iter__(self):
        offset = int(torch.randint(0, 100, (1,)))
        for i in range(8):
            yield torch.ones(3) * i, torch.tensor(i + offset)


def test_an_unsized_loader_without_validation_data_sees_lightnings_generators(tmp_path: Path) -> None:
    """Lightning reads an unsized loader's first batch before ``on_train_start``, and without validation
    data runs no sanity check (though the module has a ``validation_step``)."""
    found = {}
    for framework in (pl, trainer_core):
        torch.manual_seed(0)
        recorder = _state_recorder(framework)()
        recorder.seen = []
        model = _seen_batches_module(framework)()
        trainer = _trainer(framework, num_sanity_val_steps=2, callbacks=[recorder])
        _quietly(trainer.fit, model, DataLoader(_Stream(), batch_size=4))
        found[framework.__name__] = (
            [(hook, states["torch"]) for hook, states in recorder.seen],
            model.batches,
        )
    assert found["trainer_core"] == found["pytorch_lightning"]
    assert "on_sanity_check_start" not in dict(found["trainer_core"][0])
