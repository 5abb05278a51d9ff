"""What ``self.log`` records and where the numbers end up.

A user reads logged values in three places: ``trainer.callback_metrics`` (what callbacks such
as ModelCheckpoint and EarlyStopping monitor), ``trainer.logged_metrics``/the logger's files,
and ``trainer.progress_bar_metrics``. These tests pin Lightning 2.x's rules with exact numbers:
``training_step`` logs per step by default and evaluation steps per epoch; ``on_step`` and
``on_epoch`` together give ``name_step``/``name_epoch``; ``reduce_fx="mean"`` weights each batch
by its size (a smaller last batch counts less), ``sum``/``max``/``min`` reduce the raw values;
CSVLogger's ``metrics.csv`` holds the training rows at the steps ``log_every_n_steps`` selects
and the epoch rows at Lightning's step numbers; a non-scalar tensor is refused.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from boring import fast_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule
from trainer_core.callbacks import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger

# 10 samples in batches of 4: sizes 4, 4, 2.
SIZES = [4, 4, 2]


def _loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    return random_loader(n, 3, batch_size=batch_size)


class LogModel(LightningModule):
    """``train_log``/``val_log`` are called with ``(module, batch_idx)`` from the matching step."""

    def __init__(
        self, train_log: Callable[..., None] | None = None, val_log: Callable[..., None] | None = None
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.train_log = train_log
        self.val_log = val_log
        self.snapshots: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        if self.train_log is not None:
            self.train_log(self, batch_idx)
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        if self.val_log is not None:
            self.val_log(self, batch_idx)

    def test_step(self, batch, batch_idx):
        if self.val_log is not None:
            self.val_log(self, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _weighted_mean(values: list[float], sizes: list[int]) -> float:
    return sum(v * s for v, s in zip(values, sizes)) / sum(sizes)


VALUES = [1.0, 2.0, 6.0]  # logged value of batch i is VALUES[i]


# ---------------------------------------------------------------------- defaults
def test_training_step_defaults_to_on_step_only():
    model = LogModel(train_log=lambda m, i: m.log("a", VALUES[i]))
    trainer = fast_trainer(limit_val_batches=0)
    trainer.fit(model, _loader())
    # per step: the last step's value, no epoch aggregate, no forked names
    assert _floats(trainer.callback_metrics) == {"a": 6.0}
    assert "a_epoch" not in trainer.callback_metrics and "a_step" not in trainer.callback_metrics


def test_validation_step_defaults_to_on_epoch_weighted_mean():
    model = LogModel(val_log=lambda m, i: m.log("v", VALUES[i]))
    trainer = fast_trainer()
    results = trainer.validate(model, _loader(), verbose=False)
    expected = _weighted_mean(VALUES, SIZES)  # (4*1 + 4*2 + 2*6) / 10 = 2.4
    assert expected == pytest.approx(2.4)
    assert results == [{"v": pytest.approx(expected)}]
    assert _floats(trainer.callback_metrics) == {"v": pytest.approx(expected)}


def test_both_flags_give_step_and_epoch_keys():
    def train_log(m, i):
        m.log("a", VALUES[i], on_step=True, on_epoch=True, prog_bar=True)

    model = LogModel(train_log=train_log)
    seen: list[dict[str, float]] = []

    class Probe(Callback):
        """What callbacks see right after each batch."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(_floats(trainer.callback_metrics))

    trainer = fast_trainer(limit_val_batches=0, callbacks=[Probe()])
    trainer.fit(model, _loader())
    epoch_value = _weighted_mean(VALUES, SIZES)
    # during the epoch: the step value under both `a` and `a_step`
    assert seen[1] == {"a": 2.0, "a_step": 2.0}
    # after the epoch: `a` is the epoch aggregate, and both forked names are present
    assert _floats(trainer.callback_metrics) == {
        "a": pytest.approx(epoch_value),
        "a_step": 6.0,
        "a_epoch": pytest.approx(epoch_value),
    }
    assert trainer.progress_bar_metrics == {"a_step": 6.0, "a_epoch": pytest.approx(epoch_value)}


def test_both_flags_in_validation_step_keep_step_values_out_of_callback_metrics():
    def val_log(m, i):
        m.log("v", VALUES[i], on_step=True, on_epoch=True)

    trainer = fast_trainer()
    trainer.validate(LogModel(val_log=val_log), _loader(), verbose=False)
    expected = _weighted_mean(VALUES, SIZES)
    assert _floats(trainer.callback_metrics) == {
        "v": pytest.approx(expected),
        "v_epoch": pytest.approx(expected),
    }


# ---------------------------------------------------------------------- reductions
@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [
        ("mean", _weighted_mean(VALUES, SIZES)),
        (torch.mean, _weighted_mean(VALUES, SIZES)),
        ("sum", sum(VALUES)),
        (torch.sum, sum(VALUES)),
        ("max", max(VALUES)),
        (torch.max, max(VALUES)),
        ("min", min(VALUES)),
        (torch.min, min(VALUES)),
    ],
    ids=["mean", "torch.mean", "sum", "torch.sum", "max", "torch.max", "min", "torch.min"],
)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_reduce_fx_gives_the_exact_number(reduce_fx, expected, as_tensor):
    def val_log(m, i):
        value = torch.tensor(VALUES[i]) if as_tensor else VALUES[i]
        m.log("v", value, reduce_fx=reduce_fx)

    trainer = fast_trainer()
    (results,) = trainer.validate(LogModel(val_log=val_log), _loader(), verbose=False)
    assert results["v"] == pytest.approx(expected, abs=1e-6)


def test_mean_in_training_step_weights_the_smaller_last_batch():
    model = LogModel(train_log=lambda m, i: m.log("a", torch.tensor(VALUES[i]), on_step=False, on_epoch=True))
    trainer = fast_trainer(limit_val_batches=0)
    trainer.fit(model, _loader())
    assert float(trainer.callback_metrics["a"]) == pytest.approx(2.4)
    # a plain mean would be 3.0: the last batch (2 samples) weighs half as much as the others
    assert float(trainer.callback_metrics["a"]) != pytest.approx(sum(VALUES) / 3)


def test_explicit_batch_size_overrides_the_batch():
    def val_log(m, i):
        m.log("v", VALUES[i], batch_size=[1, 1, 8][i])

    trainer = fast_trainer()
    (results,) = trainer.validate(LogModel(val_log=val_log), _loader(), verbose=False)
    assert results["v"] == pytest.approx((1 * 1.0 + 1 * 2.0 + 8 * 6.0) / 10)


def test_epoch_metrics_reset_between_epochs():
    model = LogModel(
        train_log=lambda m, i: m.log(
            "e", float(m.current_epoch * 10 + i), on_step=False, on_epoch=True, reduce_fx="sum"
        )
    )
    seen: list[float] = []

    class Probe(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append(float(trainer.callback_metrics["e"]))

    trainer = fast_trainer(max_epochs=2, limit_val_batches=0, callbacks=[Probe()])
    trainer.fit(model, _loader())
    assert seen == [0 + 1 + 2, 10 + 11 + 12]


# ---------------------------------------------------------------------- where metrics go
def test_metrics_dicts_contents(tmp_path: Path):
    def train_log(m, i):
        m.log("loss_bar", VALUES[i], prog_bar=True)
        m.log("hidden", VALUES[i], logger=False)
        m.log("plain", VALUES[i])

    def val_log(m, i):
        m.log("val_loss", VALUES[i], prog_bar=True)

    model = LogModel(train_log=train_log, val_log=val_log)
    logger = CSVLogger(save_dir=tmp_path, name="run", version=0)
    trainer = fast_trainer(logger=logger, log_every_n_steps=1)
    trainer.fit(model, _loader(), _loader())
    val_epoch = _weighted_mean(VALUES, SIZES)

    assert _floats(trainer.callback_metrics) == {
        "loss_bar": 6.0,
        "hidden": 6.0,
        "plain": 6.0,
        "val_loss": pytest.approx(val_epoch),
    }
    assert trainer.progress_bar_metrics == {"loss_bar": 6.0, "val_loss": pytest.approx(val_epoch)}
    logged = _floats(trainer.logged_metrics)
    assert "hidden" not in logged
    assert logged["loss_bar"] == 6.0 and logged["plain"] == 6.0
    assert logged["val_loss"] == pytest.approx(val_epoch)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_rows_at_log_every_n_steps(tmp_path: Path):
    """6 batches, log_every_n_steps=2: training rows at steps 1, 3, 5 (Lightning logs when
    ``(batches_that_stepped + 1) % n == 0``, at step ``batches_that_stepped``); the epoch
    aggregate and the validation epoch metric land on the last step of the epoch (5)."""

    def train_log(m, i):
        m.log("loss", float(i))
        m.log("agg", float(i), on_step=False, on_epoch=True, reduce_fx="sum")

    def val_log(m, i):
        m.log("val_loss", 7.0)

    model = LogModel(train_log=train_log, val_log=val_log)
    logger = CSVLogger(save_dir=tmp_path, name="run", version=0)
    trainer = fast_trainer(logger=logger, log_every_n_steps=2, limit_val_batches=1)
    trainer.fit(model, _loader(n=12, batch_size=2), _loader(n=2, batch_size=2))

    path = tmp_path / "run" / "version_0" / "metrics.csv"
    rows = _read_csv(path)
    loss_rows = [(int(r["step"]), float(r["loss"])) for r in rows if r.get("loss")]
    assert loss_rows == [(1, 1.0), (3, 3.0), (5, 5.0)]
    agg_rows = [(int(r["step"]), float(r["agg"])) for r in rows if r.get("agg")]
    assert agg_rows == [(5, 0 + 1 + 2 + 3 + 4 + 5)]
    val_rows = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    assert val_rows == [(5, 7.0)]
    assert all(r["epoch"] == "0" for r in rows)


def test_csv_logger_step_rows_count_optimizer_steps_under_accumulation(tmp_path: Path):
    """With accumulate_grad_batches=2 the step counter advances per optimizer step, and a
    row is written only on batches that step (Lightning's ``_batches_that_stepped``)."""
    model = LogModel(train_log=lambda m, i: m.log("loss", float(i)))
    logger = CSVLogger(save_dir=tmp_path, name="run", version=0)
    trainer = fast_trainer(logger=logger, log_every_n_steps=1, limit_val_batches=0, accumulate_grad_batches=2)
    trainer.fit(model, _loader(n=12, batch_size=2))
    rows = _read_csv(tmp_path / "run" / "version_0" / "metrics.csv")
    assert [(int(r["step"]), float(r["loss"])) for r in rows if r.get("loss")] == [
        (0, 1.0),
        (1, 3.0),
        (2, 5.0),
    ]


def test_test_metrics_are_returned_and_logged(tmp_path: Path):
    logger = CSVLogger(save_dir=tmp_path, name="run", version=0)
    trainer = fast_trainer(logger=logger)
    (results,) = trainer.test(
        LogModel(val_log=lambda m, i: m.log("t", VALUES[i], reduce_fx="max")), _loader(), verbose=False
    )
    assert results == {"t": 6.0}
    rows = _read_csv(tmp_path / "run" / "version_0" / "metrics.csv")
    assert [float(r["t"]) for r in rows if r.get("t")] == [6.0]


def test_callback_metrics_kept_after_fit_survive_a_test_as_in_lightning(tmp_path: Path):
    """A program that keeps ``trainer.callback_metrics`` after ``fit`` (the lightning-hydra-template merges it
    with the test's) still reads fit's values after ``test``: each run starts with new dicts, as in Lightning."""
    import pytorch_lightning as pl

    from trainer_core import Trainer

    kept = {}
    for name, base, trainer_cls in (
        ("lightning", pl.LightningModule, pl.Trainer),
        ("trainer_core", LightningModule, Trainer),
    ):

        class Net(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                super().__init__()
                self.layer = nn.Linear(3, 1)

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                loss = self.layer(batch[0]).sum()
                self.log("fit_loss", loss)
                return loss

            def test_step(self, batch: Any, batch_idx: int) -> None:
                self.log("test_loss", self.layer(batch[0]).sum())

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer = trainer_cls(
            max_epochs=1,
            limit_train_batches=2,
            limit_test_batches=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path / name,
        )
        model = Net()
        trainer.fit(model, _loader())
        after_fit = trainer.callback_metrics
        trainer.test(model, _loader(), verbose=False)
        kept[name] = (sorted(after_fit), sorted(trainer.callback_metrics))
    assert kept["trainer_core"] == kept["lightning"] == (["fit_loss"], ["test_loss"])


# ---------------------------------------------------------------------- refusals
def test_non_scalar_tensor_raises_naming_the_metric():
    model = LogModel(train_log=lambda m, i: m.log("vec", torch.ones(3)))
    with pytest.raises(MisconfigurationException, match=r"self\.log\('vec'.*shape \(3,\).*scalar"):
        fast_trainer(limit_val_batches=0).fit(model, _loader())


@pytest.mark.parametrize("value", ["text", None, [1.0]], ids=["str", "none", "list"])
def test_non_number_raises_naming_the_metric(value):
    model = LogModel(train_log=lambda m, i: m.log("bad", value))
    with pytest.raises(MisconfigurationException, match=r"self\.log\('bad'"):
        fast_trainer(limit_val_batches=0).fit(model, _loader())


def test_unknown_reduce_fx_raises():
    model = LogModel(val_log=lambda m, i: m.log("v", 1.0, reduce_fx="median"))
    with pytest.raises(MisconfigurationException, match=r"reduce_fx='median'"):
        fast_trainer().validate(model, _loader(), verbose=False)


def test_neither_step_nor_epoch_raises():
    model = LogModel(train_log=lambda m, i: m.log("x", 1.0, on_step=False, on_epoch=False))
    with pytest.raises(MisconfigurationException, match=r"on_step=False, on_epoch=False"):
        fast_trainer(limit_val_batches=0).fit(model, _loader())


def test_callback_metrics_are_tensors_even_for_python_numbers():
    """Lightning stores every logged value as a tensor, so ``trainer.callback_metrics["x"].item()``
    and tensor comparisons in callbacks work whether the module logged a float or a tensor."""
    model = LogModel(
        train_log=lambda m, i: m.log("a", float(i), on_epoch=True),
        val_log=lambda m, i: m.log("v", VALUES[i]),
    )
    trainer = fast_trainer(limit_val_batches=1)
    trainer.fit(model, _loader(), _loader())
    for name in ("a", "a_step", "a_epoch", "v"):
        value = trainer.callback_metrics[name]
        assert isinstance(value, torch.Tensor) and value.ndim == 0, name
    assert trainer.callback_metrics["v"].item() == 1.0
