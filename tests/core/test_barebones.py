"""``Trainer(barebones=True)`` side by side with Lightning's: what it turns off, what it refuses, ``self.log``.

Each test builds one module on each framework's base class, runs it with the same seed and data, and
compares what a user reads: the weights, the Trainer's attributes, the files in ``default_root_dir``,
and the errors and warnings.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import random_loader
from torch import nn

import trainer_core as tc

pl = pytest.importorskip("pytorch_lightning")


def _module(framework: Any, log: bool = False) -> Any:
    class Regression(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if log:
                self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if log:
                self.log("val_loss", loss)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if log:
                self.log("test_loss", loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    return Regression()


def _trainer(framework: Any, root: Path, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return framework.Trainer(
            accelerator="cpu", devices=1, default_root_dir=root, barebones=True, max_epochs=2, **kwargs
        )


def _fit(framework: Any, root: Path, log: bool = False) -> tuple[Any, Any]:
    trainer = _trainer(framework, root)
    module = _module(framework, log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, random_loader(16, 3, batch_size=4), random_loader(8, 3, batch_size=4))
    return trainer, module


def _what_is_off(trainer: Any) -> dict[str, Any]:
    return {
        "barebones": trainer.barebones,
        "logger": trainer.logger,
        "loggers": list(trainer.loggers),
        "checkpoint_callback": trainer.checkpoint_callback,
        "progress_bar_callback": trainer.progress_bar_callback,
        "log_every_n_steps": trainer.log_every_n_steps,
        "num_sanity_val_steps": trainer.num_sanity_val_steps,
        "callbacks": [type(cb).__name__ for cb in trainer.callbacks],
        "log_dir": os.fspath(trainer.log_dir),
        "callback_metrics": dict(trainer.callback_metrics),
    }


def test_barebones_fit_trains_the_same_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "pl").mkdir()
    (tmp_path / "tc").mkdir()
    pl_trainer, pl_module = _fit(pl, tmp_path / "pl")
    tc_trainer, tc_module = _fit(tc, tmp_path / "tc")

    for name, value in pl_module.state_dict().items():
        assert torch.equal(tc_module.state_dict()[name], value), name
    assert tc_trainer.global_step == pl_trainer.global_step == 8
    assert tc_trainer.current_epoch == pl_trainer.current_epoch == 2
    # Only the folder name differs: each framework ran in its own.
    pl_off, tc_off = _what_is_off(pl_trainer), _what_is_off(tc_trainer)
    assert Path(pl_off.pop("log_dir")).name == "pl"
    assert Path(tc_off.pop("log_dir")).name == "tc"
    assert tc_off == pl_off
    assert pl_off["logger"] is None and pl_off["checkpoint_callback"] is None and pl_off["callbacks"] == []
    assert list((tmp_path / "pl").iterdir()) == list((tmp_path / "tc").iterdir()) == []


def test_self_log_under_barebones_warns_and_records_nothing(tmp_path: Path) -> None:
    (tmp_path / "pl").mkdir()
    (tmp_path / "tc").mkdir()
    seen = {}
    for framework, root in ((pl, tmp_path / "pl"), (tc, tmp_path / "tc")):
        trainer = _trainer(framework, root)
        module = _module(framework, log=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, random_loader(8, 3, batch_size=4))
        messages = [str(w.message) for w in caught if "barebones" in str(w.message)]
        # One warning per call, each naming self.log and barebones mode, none an error.
        assert len(messages) == 4 and all("self.log" in m for m in messages), messages
        seen[framework.__name__] = (dict(trainer.callback_metrics), dict(trainer.logged_metrics))
    assert seen["trainer_core"] == seen["pytorch_lightning"] == ({}, {})


CONFLICTS = [
    {"enable_checkpointing": True},
    {"logger": True},
    {"enable_progress_bar": True},
    {"log_every_n_steps": 1},
    {"enable_model_summary": True},
    {"num_sanity_val_steps": 2},
    {"fast_dev_run": True},
    {"detect_anomaly": True},
    {"profiler": "simple"},
]


@pytest.mark.parametrize("argument", CONFLICTS, ids=lambda a: next(iter(a)))
def test_each_conflicting_argument_is_refused_as_lightning_does(
    argument: dict[str, Any], tmp_path: Path
) -> None:
    (name,) = argument
    with pytest.raises(ValueError, match=rf"barebones=True, {name}=") as pl_error:
        pl.Trainer(barebones=True, default_root_dir=tmp_path, **argument)
    with pytest.raises(ValueError, match=rf"barebones=True, {name}=") as tc_error:
        tc.Trainer(barebones=True, default_root_dir=tmp_path, **argument)
    assert isinstance(tc_error.value, tc.errors.MisconfigurationException)
    # Both name the argument and its value the same way, then say why it is off.
    given = f"{name}={next(iter(argument.values()))!r}"
    assert given in str(pl_error.value) and given in str(tc_error.value)
    assert "speed" in str(pl_error.value) and "speed" in str(tc_error.value)


@pytest.mark.parametrize(
    "argument",
    [
        {"enable_checkpointing": False},
        {"logger": False},
        {"log_every_n_steps": 0},
        {"num_sanity_val_steps": 0},
    ],
    ids=lambda a: next(iter(a)),
)
def test_the_values_barebones_sets_itself_are_accepted(argument: dict[str, Any], tmp_path: Path) -> None:
    assert _trainer(pl, tmp_path, **argument).barebones
    assert _trainer(tc, tmp_path, **argument).barebones


def test_validate_and_test_return_no_metrics_under_both(tmp_path: Path) -> None:
    results = {}
    for framework in (pl, tc):
        trainer = _trainer(framework, tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validated = trainer.validate(_module(framework, log=True), random_loader(8, 3, batch_size=4))
            tested = trainer.test(_module(framework, log=True), random_loader(8, 3, batch_size=4))
        results[framework.__name__] = (validated, tested)
    assert results["trainer_core"] == results["pytorch_lightning"] == ([{}], [{}])


@pytest.mark.parametrize(
    ("callback", "arguments"),
    [("LearningRateMonitor", {}), ("DeviceStatsMonitor", {}), ("EarlyStopping", {"monitor": "val_loss"})],
)
def test_callbacks_that_need_logging_fail_as_in_lightning(
    callback: str, arguments: dict[str, Any], tmp_path: Path
) -> None:
    import pytorch_lightning.callbacks as pl_callbacks

    import trainer_core.callbacks as tc_callbacks

    errors = {}
    for framework, callbacks in ((pl, pl_callbacks), (tc, tc_callbacks)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = framework.Trainer(
                accelerator="cpu",
                devices=1,
                default_root_dir=tmp_path,
                barebones=True,
                max_epochs=1,
                callbacks=[getattr(callbacks, callback)(**arguments)],
            )
            with pytest.raises(Exception) as error:
                trainer.fit(
                    _module(framework, log=True),
                    random_loader(8, 3, batch_size=4),
                    random_loader(8, 3, batch_size=4),
                )
        errors[framework.__name__] = error
    # The same kind of error (Lightning's MisconfigurationException or RuntimeError) for the same reason.
    assert type(errors["trainer_core"].value).__name__ == type(errors["pytorch_lightning"].value).__name__
    word = "metric" if callback == "EarlyStopping" else "logger"
    assert word in str(errors["trainer_core"].value) and word in str(errors["pytorch_lightning"].value)
