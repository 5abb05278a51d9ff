"""What a Lightning program meets first: the step signatures, the results of ``validate``/``test``,
the resume order and the import paths, each run side by side with Lightning itself.

Every test builds one module class twice, once on trainer-core's base classes and once on
Lightning's (``pytorch_lightning`` is installed with the test extras), runs both with the same
seed and data, and compares what a user reads: losses, weights, returned metrics, the order of
hooks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import random_data
from torch import nn
from torch.utils.data import DataLoader

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
