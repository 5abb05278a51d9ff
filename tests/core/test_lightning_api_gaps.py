"""Lightning names programs call that trainer-core lacked, each run side by side with Lightning 2.6.6.

``LightningDataModule.load_from_checkpoint`` (``weights_only``, hyper-parameters ``__init__`` no longer
takes), ``CSVLogger.experiment`` and ``Logger.group_separator``, ``utilities.seed.isolate_rng``,
``utilities.rank_zero`` and ``WriteInterval``: every test does the same thing with both frameworks and
compares what a program reads (values, files, random draws, the writer's calls).
"""

from __future__ import annotations

import csv
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from boring import random_data
from torch import nn
from torch.utils.data import DataLoader

import trainer_core
from trainer_core.errors import CheckpointError, MisconfigurationException

pl = pytest.importorskip("pytorch_lightning")

FRAMEWORKS = [pytest.param(trainer_core, id="trainer_core"), pytest.param(pl, id="lightning")]


class Recipe:
    """A hyper-parameter no allow-list names: only ``weights_only=False`` unpickles it."""

    def __init__(self, size: int) -> None:
        self.size = size


def _trainer(framework: Any, root: Path, **kwargs: Any) -> Any:
    kwargs = {
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "default_root_dir": root,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return framework.Trainer(**kwargs)


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _module_class(framework: Any) -> type:
    class Regression(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self.net(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regression


def _datamodule_classes(framework: Any) -> dict[str, type]:
    """The class that saves, and three that load: fewer arguments, ``**kwargs``, the same class."""

    class SavedData(framework.LightningDataModule):
        def __init__(self, batch_size: int = 2, seed: int = 0, recipe: Any = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.batch_size = batch_size
            self.served = 0

        def train_dataloader(self) -> DataLoader:
            self.served += 1
            return DataLoader(random_data(8, 3), batch_size=self.batch_size)

        def state_dict(self) -> dict[str, Any]:
            return {"served": self.served}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.served = state_dict["served"]

    class FewerArguments(framework.LightningDataModule):
        def __init__(self, batch_size: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()

    class AnyArguments(framework.LightningDataModule):
        def __init__(self, batch_size: int = 2, **kwargs: Any) -> None:
            super().__init__()
            self.save_hyperparameters()

    return {"saved": SavedData, "fewer": FewerArguments, "any": AnyArguments}


def _datamodule_checkpoint(framework: Any, root: Path, **hparams: Any) -> Path:
    classes = _datamodule_classes(framework)
    trainer = _trainer(framework, root, max_steps=1)
    _quietly(trainer.fit, _module_class(framework)(), datamodule=classes["saved"](**hparams))
    path = root / "dm.ckpt"
    trainer.save_checkpoint(path)
    return path


def _loaded(framework: Any, path: Path, **kwargs: Any) -> dict[str, Any]:
    """What each loading class gets from the checkpoint at ``path``: its hyper-parameters (and state)."""
    classes = _datamodule_classes(framework)
    loaded = {}
    for key, cls in classes.items():
        dm = _quietly(cls.load_from_checkpoint, path, **kwargs)
        loaded[key] = dict(dm.hparams)
    loaded["served"] = _quietly(classes["saved"].load_from_checkpoint, path, **kwargs).served
    return loaded


def test_datamodule_load_passes_only_the_hyper_parameters_init_takes(tmp_path: Path) -> None:
    """Lightning's rule (and our LightningModule's): a saved ``seed`` that ``__init__`` lost is left out."""
    ours = _datamodule_checkpoint(trainer_core, tmp_path / "ours", batch_size=4, seed=1)
    theirs = _datamodule_checkpoint(pl, tmp_path / "lightning", batch_size=4, seed=1)
    expected = _loaded(pl, theirs)
    assert expected == {
        "saved": {"batch_size": 4, "seed": 1, "recipe": None},
        "fewer": {"batch_size": 4},
        "any": {"batch_size": 4, "seed": 1, "recipe": None},
        "served": 1,
    }
    assert _loaded(trainer_core, ours) == expected
    assert _loaded(trainer_core, theirs) == expected  # Lightning's own file
    overridden = _loaded(pl, theirs, batch_size=8, unknown=3)
    assert overridden["fewer"] == {"batch_size": 8}
    assert _loaded(trainer_core, ours, batch_size=8, unknown=3) == overridden


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_datamodule_load_with_weights_only_false_unpickles_a_trusted_file(
    framework: Any, tmp_path: Path
) -> None:
    """A file Lightning wrote with an object among the hyper-parameters (trainer-core's save leaves such out)."""
    path = _datamodule_checkpoint(pl, tmp_path, batch_size=4, recipe=Recipe(3))
    saved = _datamodule_classes(framework)["saved"]
    dm = _quietly(saved.load_from_checkpoint, path, weights_only=False)
    assert (dm.hparams.batch_size, type(dm.hparams.recipe), dm.hparams.recipe.size, dm.served) == (
        4,
        Recipe,
        3,
        1,
    )
    # By default neither runs code from the file: an unknown class in it is refused.
    refused = CheckpointError if framework is trainer_core else Exception
    with pytest.raises(refused, match="Recipe"):
        _quietly(saved.load_from_checkpoint, path)


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _use_the_experiment(framework: Any, root: Path) -> dict[str, Any]:
    """A program's direct use of ``logger.experiment``, mixed with the logger's own calls."""
    logger = framework.loggers.CSVLogger(root, name="run")
    experiment = logger.experiment
    experiment.log_metrics({"a": 1.0}, step=0)
    experiment.log_metrics({"b": torch.tensor(2.5)})  # no step: its number among the unsaved rows
    buffered = [dict(row) for row in experiment.metrics]
    experiment.log_hparams({"lr": 0.1})
    experiment.log_hparams({"layers": [4, 2]})
    experiment.save()
    logger.log_metrics({"a": 3.0}, step=5)
    logger.save()
    prefixed = framework.loggers.CSVLogger(root, name="prefixed", prefix="train")
    prefixed.log_metrics({"loss": 0.5}, step=0)
    prefixed.save()
    return {
        "log_dir": Path(experiment.log_dir).relative_to(root),
        "metrics_file_path": Path(experiment.metrics_file_path).relative_to(root),
        "buffered": buffered,
        "left": experiment.metrics,
        "rows": _csv_rows(Path(experiment.metrics_file_path)),
        "hparams": yaml.safe_load((Path(experiment.log_dir) / "hparams.yaml").read_text()),
        "prefixed": _csv_rows(Path(prefixed.log_dir) / "metrics.csv"),
        "same_object": logger.experiment is experiment,
        "group_separator": logger.group_separator,
    }


def test_csv_logger_experiment_writes_what_lightnings_writes(tmp_path: Path) -> None:
    expected = _use_the_experiment(pl, tmp_path / "lightning")
    assert expected["rows"] == [
        {"a": "1.0", "b": "", "step": "0"},
        {"a": "", "b": "2.5", "step": "1"},
        {"a": "3.0", "b": "", "step": "5"},
    ]
    assert expected["prefixed"] == [{"train-loss": "0.5", "step": "0"}]
    assert _use_the_experiment(trainer_core, tmp_path / "ours") == expected


def _experiment_logging_module(framework: Any) -> Any:
    class Logging(_module_class(framework)):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.logger.experiment.log_metrics({"custom": float(batch_idx)}, step=self.global_step)
            return super().training_step(batch, batch_idx)

    return Logging()


@pytest.mark.parametrize("flush", [1, 100])
def test_a_module_logging_through_the_experiment_gets_lightnings_file(flush: int, tmp_path: Path) -> None:
    rows = {}
    for framework in (trainer_core, pl):
        root = tmp_path / framework.__name__
        logger = framework.loggers.CSVLogger(root, flush_logs_every_n_steps=flush)
        trainer = _trainer(framework, root, logger=logger, max_epochs=1, log_every_n_steps=1)
        torch.manual_seed(0)
        _quietly(
            trainer.fit, _experiment_logging_module(framework), DataLoader(random_data(8, 3), batch_size=2)
        )
        rows[framework] = _csv_rows(Path(logger.log_dir) / "metrics.csv")
    assert [row["custom"] for row in rows[pl] if row["custom"]] == ["0.0", "1.0", "2.0", "3.0"]
    assert rows[trainer_core] == rows[pl]


def _draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


@pytest.mark.parametrize("include_cuda", [True, False])
def test_isolate_rng_leaves_the_generators_as_lightnings_does(include_cuda: bool) -> None:
    from pytorch_lightning.utilities.seed import isolate_rng as lightning_isolate_rng

    from trainer_core.utilities.seed import isolate_rng, seed_everything

    results = []
    for isolate in (lightning_isolate_rng, isolate_rng):
        seed_everything(7, verbose=False)
        with isolate(include_cuda=include_cuda):
            inside = _draws()
        results.append((inside, _draws()))
    assert results[0] == results[1]
    assert results[0][0] == results[0][1]  # the draws after the block repeat those in it


def test_isolate_rng_restores_the_generators_when_the_block_raises() -> None:
    """Lightning's leaves them advanced (its context manager restores only on a normal exit)."""
    from trainer_core.utilities.seed import isolate_rng

    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError), isolate_rng():
        torch.rand(5)
        raise RuntimeError("inside")
    assert torch.equal(torch.rand(1), expected)


def test_the_rank_zero_module_has_lightnings_names_and_rank() -> None:
    import pytorch_lightning.utilities.rank_zero as lightning_rank_zero

    import trainer_core.utilities as utilities
    import trainer_core.utilities.rank_zero as rank_zero

    names = ["rank_zero_only", "rank_zero_info", "rank_zero_warn", "rank_zero_debug", "rank_zero_deprecation"]
    assert all(callable(getattr(rank_zero, name)) for name in names)
    assert rank_zero.rank_zero_only is utilities.rank_zero_only
    calls = []
    for module in (lightning_rank_zero, rank_zero):
        saved = module.rank_zero_only.rank
        try:
            for rank in (0, 1):
                module.rank_zero_only.rank = rank
                calls.append(module.rank_zero_only(lambda r=rank: r)())
        finally:
            module.rank_zero_only.rank = saved
    assert calls == [0, None, 0, None]
    for module in (lightning_rank_zero, rank_zero):
        with pytest.warns(UserWarning, match="^careful$"):
            module.rank_zero_warn("careful")


def _writer_calls(framework: Any, interval: Any, root: Path) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    class Writer(framework.callbacks.BasePredictionWriter):
        def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, *args: Any) -> None:
            calls.append(("batch", round(prediction.sum().item(), 5), list(args[0])))

        def write_on_epoch_end(
            self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any
        ) -> None:
            calls.append(("epoch", len(predictions), batch_indices))

    writer = Writer(write_interval=interval)
    calls.append((type(writer.interval).__name__, writer.interval == interval, writer.interval.value))
    trainer = _trainer(framework, root, callbacks=[writer])
    torch.manual_seed(0)
    module = _module_class(framework)()
    _quietly(trainer.predict, module, DataLoader(random_data(4, 3), batch_size=2), return_predictions=False)
    return calls


@pytest.mark.parametrize("value", ["batch", "epoch", "batch_and_epoch"])
def test_write_interval_enum_and_string_write_as_in_lightning(value: str, tmp_path: Path) -> None:
    from pytorch_lightning.callbacks.prediction_writer import WriteInterval as LightningWriteInterval

    from trainer_core.callbacks.prediction_writer import WriteInterval

    assert [(m.name, m.value) for m in WriteInterval] == [(m.name, m.value) for m in LightningWriteInterval]
    ours, theirs = WriteInterval(value), LightningWriteInterval(value)
    assert (ours == value, ours.on_batch, ours.on_epoch) == (
        theirs == value,
        theirs.on_batch,
        theirs.on_epoch,
    )
    expected = _writer_calls(pl, theirs, tmp_path / "lightning")
    for given in (ours, value, theirs):  # the enum, the string, and Lightning's enum
        assert _writer_calls(trainer_core, given, tmp_path / "ours") == expected


def test_an_unknown_write_interval_is_refused_by_both() -> None:
    from pytorch_lightning.utilities.exceptions import MisconfigurationException as LightningError

    with pytest.raises(LightningError, match="write_interval"):
        pl.callbacks.BasePredictionWriter(write_interval="hourly")
    with pytest.raises(MisconfigurationException, match="write_interval='hourly'"):
        trainer_core.callbacks.BasePredictionWriter(write_interval="hourly")
