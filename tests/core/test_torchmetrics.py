"""``self.log(name, metric)`` with a torchmetrics ``Metric``: computed over the epoch by the metric, then reset.

The epoch value of a logged ``Metric`` is ``metric.compute()`` over every batch the epoch fed it, not
the mean of its batch values: the tests log a macro-averaged accuracy (which is no weighted mean of
batch values) and check it against torchmetrics' functional form over the epoch's predictions,
collected by hand. The step value is what ``metric(preds, target)`` returned. Each epoch starts the
metric afresh; ``validate()`` returns the computed value; the same module under
``pytorch_lightning.Trainer`` gives the same numbers; two DDP ranks give the value over the whole
dataset, synced by the metric itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import fast_trainer, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule
from trainer_core.callbacks import Callback
from trainer_core.errors import MisconfigurationException

torchmetrics = pytest.importorskip(
    "torchmetrics", reason="self.log with a Metric needs torchmetrics (extra 'test')"
)
from launch import JOBS, job_env  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402
from torchmetrics.functional.classification import multiclass_accuracy  # noqa: E402
from torchmetrics.regression import MeanSquaredError  # noqa: E402

CLASSES = 3
FEATURES = 4


def dataset(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)
    )


def loader(n: int, seed: int, batch_size: int = 4) -> DataLoader:
    return DataLoader(dataset(n, seed), batch_size=batch_size)


def classifier(base: type) -> type:
    """The same classifier on trainer-core's or Lightning's ``LightningModule``.

    It logs a macro accuracy per step and per epoch and a mean squared error per epoch in training,
    an accuracy per epoch in validation, and keeps what it fed the metrics, by stage and epoch.
    """

    class Classifier(base):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(FEATURES, CLASSES)
            self.train_acc = MulticlassAccuracy(CLASSES, average="macro")
            self.train_mse = MeanSquaredError()
            self.val_acc = MulticlassAccuracy(CLASSES, average="macro")
            self.fed: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
            self.batch_acc: list[float] = []

        def _keep(self, stage: str, logits: torch.Tensor, y: torch.Tensor) -> None:
            self.fed.setdefault((stage, self.current_epoch), []).append((logits.detach().clone(), y))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            self._keep("train", logits, y)
            self.batch_acc.append(float(self.train_acc(logits, y)))
            self.train_mse.update(logits[:, 0], y.float())
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
            return nn.functional.cross_entropy(logits, y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.net(x)
            if not self.trainer.sanity_checking:
                self._keep("val", logits, y)
            self.val_acc(logits, y)
            self.log("val_acc", self.val_acc)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Classifier


class EpochValues(Callback):
    """``callback_metrics`` as floats at each training epoch's end (after that epoch's validation)."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self.steps: list[float] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps.append(float(trainer.callback_metrics["train_acc_step"]))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def by_hand(fed: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Macro accuracy and the mean squared error of column 0, over every batch of one epoch."""
    logits = torch.cat([f[0] for f in fed])
    y = torch.cat([f[1] for f in fed])
    acc = float(multiclass_accuracy(logits, y, num_classes=CLASSES, average="macro"))
    mse = float(torch.mean((logits[:, 0] - y.float()) ** 2))
    return acc, mse


def run_trainer_core(epochs: int = 2, sanity: int = 0) -> tuple[Any, EpochValues, Any]:
    torch.manual_seed(0)
    model = classifier(LightningModule)()
    values = EpochValues()
    trainer = quiet_trainer(max_epochs=epochs, num_sanity_val_steps=sanity, callbacks=[values])
    # 10 samples in batches of 4: 4, 4, 2.
    trainer.fit(model, loader(10, seed=1), loader(10, seed=2))
    return model, values, trainer


def test_epoch_value_is_the_metric_over_the_epoch_and_each_epoch_starts_afresh() -> None:
    model, values, _ = run_trainer_core(epochs=2)
    assert len(values.epochs) == 2
    for epoch, logged in enumerate(values.epochs):
        acc, mse = by_hand(model.fed[("train", epoch)])
        assert logged["train_acc_epoch"] == pytest.approx(acc, abs=1e-6)
        assert logged["train_acc"] == pytest.approx(acc, abs=1e-6)
        assert logged["train_mse"] == pytest.approx(mse, rel=1e-6)
        val_acc, _ = by_hand(model.fed[("val", epoch)])
        assert logged["val_acc"] == pytest.approx(val_acc, abs=1e-6)
    # Macro accuracy is no mean of its batch values: the epoch value is not what a tensor log would give.
    batch_acc = model.batch_acc[:3]
    weighted = (4 * batch_acc[0] + 4 * batch_acc[1] + 2 * batch_acc[2]) / 10
    assert abs(values.epochs[0]["train_acc_epoch"] - weighted) > 1e-3
    # The step values are what each forward returned on its own batch.
    assert values.steps == pytest.approx(model.batch_acc, abs=1e-6)
    # Reset at each epoch's end: nothing of the last epoch is left in the metrics.
    for metric in (model.train_acc, model.train_mse, model.val_acc):
        assert metric.update_count == 0


def test_validate_returns_the_computed_value_and_resets_between_runs() -> None:
    torch.manual_seed(0)
    model = classifier(LightningModule)()
    trainer = quiet_trainer()
    val = loader(10, seed=2)
    first = trainer.validate(model, val)
    second = trainer.validate(model, val)
    x, y = val.dataset.tensors
    with torch.no_grad():
        expected = float(multiclass_accuracy(model.net(x), y, num_classes=CLASSES, average="macro"))
    assert first == second == [{"val_acc": pytest.approx(expected, abs=1e-6)}]
    assert model.val_acc.update_count == 0


def test_same_numbers_as_lightning() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    # With a sanity check: what its batches fed the validation metric is reset before the first epoch.
    _, ours, trainer = run_trainer_core(epochs=2, sanity=2)

    torch.manual_seed(0)
    theirs = _lightning_callback(pl)()
    pl_trainer = pl.Trainer(
        max_epochs=2,
        num_sanity_val_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[theirs],
    )
    pl_model = classifier(pl.LightningModule)()
    pl_trainer.fit(pl_model, loader(10, seed=1), loader(10, seed=2))

    keys = ["train_acc", "train_acc_epoch", "train_mse", "val_acc"]
    assert [{k: e[k] for k in keys} for e in ours.epochs] == [
        {k: pytest.approx(e[k], abs=1e-6) for k in keys} for e in theirs.epochs
    ]
    assert ours.steps == pytest.approx(theirs.steps, abs=1e-6)
    val = loader(10, seed=2)
    assert trainer.validate(trainer.lightning_module, val) == [
        {k: pytest.approx(v, abs=1e-6) for k, v in r.items()} for r in pl_trainer.validate(pl_model, val)
    ]


def _lightning_callback(pl: Any) -> type:
    class EpochValuesPL(EpochValues, pl.Callback):
        pass

    return EpochValuesPL


class CollectionModel(LightningModule):
    """A ``MetricCollection`` with a prefix, logged with ``self.log_dict`` in validation."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, CLASSES)
        self.metrics = torchmetrics.MetricCollection(
            {
                "acc": MulticlassAccuracy(CLASSES, average="micro"),
                "macro_acc": MulticlassAccuracy(CLASSES, average="macro"),
            },
            prefix="val_",
        )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.metrics.update(self.net(x), y)
        self.log_dict(self.metrics)


def test_log_dict_of_a_metric_collection_uses_its_prefixed_names() -> None:
    torch.manual_seed(0)
    model = CollectionModel()
    val = loader(10, seed=2)
    result = quiet_trainer().validate(model, val)
    x, y = val.dataset.tensors
    with torch.no_grad():
        logits = model.net(x)
    assert result == [
        {
            "val_acc": pytest.approx(
                float(multiclass_accuracy(logits, y, CLASSES, average="micro")), abs=1e-6
            ),
            "val_macro_acc": pytest.approx(
                float(multiclass_accuracy(logits, y, CLASSES, average="macro")), abs=1e-6
            ),
        }
    ]


class Misuse(LightningModule):
    """Logs ``self.how(self)`` from its validation step."""

    def __init__(self, how: Any) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, CLASSES)
        self.how = how
        self.a = MulticlassAccuracy(CLASSES)
        self.b = MulticlassAccuracy(CLASSES)
        self.per_class = MulticlassAccuracy(CLASSES, average=None)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        for metric in (self.a, self.b, self.per_class):
            metric.update(logits, y)
        self.how(self, batch_idx)


@pytest.mark.parametrize(
    ("how", "match"),
    [
        # A different Metric object under a name already taken this epoch.
        (lambda m, i: m.log("acc", m.a if i == 0 else m.b), r"another Metric object .* `MulticlassAccuracy`"),
        # A tensor where the name holds a Metric, and a Metric where it holds numbers.
        (
            lambda m, i: m.log("acc", m.a if i == 0 else torch.tensor(1.0)),
            r"got a Tensor where .*`MulticlassAccuracy`",
        ),
        (
            lambda m, i: m.log("acc", 1.0 if i == 0 else m.a),
            r"got a MulticlassAccuracy where this epoch logged numbers",
        ),
        # A metric whose compute() is not one number.
        (lambda m, i: m.log("acc", m.per_class), r"`MulticlassAccuracy.compute\(\)` returned \(3,\)"),
        (
            lambda m, i: m.log("acc", torchmetrics.MetricCollection([m.a])),
            r"MetricCollection with self.log_dict",
        ),
    ],
    ids=["other-metric", "tensor-after-metric", "metric-after-number", "non-scalar-compute", "collection"],
)
def test_misuse_is_refused_naming_the_metric(how: Any, match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        fast_trainer().validate(Misuse(how), loader(10, seed=2))


@pytest.mark.timeout(150)
def test_two_ddp_ranks_give_the_value_over_the_whole_dataset(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(JOBS / "torchmetrics_job.py"), "--out", str(out)],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out.read_text())
    weights = torch.load(tmp_path / "weights.pt")
    net = nn.Linear(FEATURES, CLASSES)
    net.load_state_dict(weights)
    x, y = dataset(20, seed=2).tensors
    with torch.no_grad():
        expected = float(multiclass_accuracy(net(x), y, num_classes=CLASSES, average="macro"))
    # Each rank saw 10 of the 20 samples; the metric synced its state before computing.
    assert got["fit_val_acc"] == pytest.approx(expected, abs=1e-6)
    assert got["validate"] == [{"val_acc": pytest.approx(expected, abs=1e-6)}]
    # Without the sync, rank 0 would have reported its half alone.
    assert got["rank0_half"] != pytest.approx(expected, abs=1e-3)
