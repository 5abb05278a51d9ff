"""``Metrics`` (``trainer_core/metrics.py``) without a Trainer: where logged values go once recorded.

The run is a ``SimpleNamespace`` with just what ``Metrics`` reads (``progress``, ``loggers``,
``current_epoch``); the loggers record what they are sent. Checked: which values reach callbacks,
the progress bar and the loggers, at which step, under which names, and when.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from trainer_core.loops.progress import Progress
from trainer_core.metrics import Metrics
from trainer_core.results import ResultCollection


class RecordingLogger:
    def __init__(self) -> None:
        self.sent: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.sent.append((step, dict(metrics)))


def fake_run(loggers: int = 1, stepped: int = 7, epoch: int = 3) -> SimpleNamespace:
    progress = Progress()
    progress.batches_that_stepped = stepped
    return SimpleNamespace(
        progress=progress, loggers=[RecordingLogger() for _ in range(loggers)], current_epoch=epoch
    )


def log(results: ResultCollection, fx: str, name: str, value: Any, **options: Any) -> None:
    """``self.log`` with its defaults (prog_bar and on_step/on_epoch overridable)."""
    results.log(
        fx,
        name,
        value,
        options.get("prog_bar", False),
        options.get("logger", True),
        options.get("on_step"),
        options.get("on_epoch"),
        "mean",
        False,
        False,
        None,
        True,
        options.get("batch_size"),
        False,
    )


def test_a_logging_interval_sends_the_step_values_at_the_last_stepped_batch() -> None:
    run = fake_run(loggers=2)
    metrics = Metrics(run)
    log(metrics.train_results, "training_step", "loss", torch.tensor(0.5), prog_bar=True)
    log(metrics.train_results, "training_step", "hidden", 2.0, logger=False)
    metrics.log_train_step()
    for logger in run.loggers:
        # Lightning's step for training logs: batches that stepped, minus the one just counted.
        assert logger.sent == [(6, {"loss": 0.5, "epoch": 3})]
    assert {k: float(v) for k, v in metrics.callback.items()} == {"loss": 0.5, "hidden": 2.0}
    assert metrics.progress_bar == {"loss": 0.5} and isinstance(metrics.progress_bar["loss"], float)
    assert metrics.logged == {"loss": 0.5}


def test_take_step_values_fills_callbacks_and_the_bar_without_logging() -> None:
    run = fake_run()
    metrics = Metrics(run)
    metrics.results = metrics.train_results
    log(metrics.train_results, "training_step", "loss", 1.25, prog_bar=True)
    metrics.take_step_values()
    assert float(metrics.callback["loss"]) == 1.25 and metrics.progress_bar == {"loss": 1.25}
    assert run.loggers[0].sent == [] and metrics.logged == {}
    # Nothing new since: the values are not read again.
    metrics.callback.clear()
    metrics.take_step_values()
    assert metrics.callback == {}


def test_take_step_values_ignores_an_evaluation_collection() -> None:
    metrics = Metrics(fake_run())
    metrics.results = ResultCollection(training=False)
    log(metrics.results, "validation_step", "val_loss", 1.0, on_step=True)
    metrics.take_step_values()
    assert metrics.callback == {} and metrics.progress_bar == {}


def test_an_epoch_is_published_under_the_logged_names_and_returned() -> None:
    run = fake_run(stepped=10, epoch=1)
    metrics = Metrics(run)
    results = ResultCollection(training=False)
    for value in (1.0, 3.0):
        results.new_batch(torch.zeros(2))
        log(results, "validation_step", "val_loss", value, on_step=True, on_epoch=True, prog_bar=True)
    returned = metrics.publish_epoch(results, log=True)
    assert {k: float(v) for k, v in returned.items()} == {"val_loss_epoch": 2.0}
    assert run.loggers[0].sent == [(10, {"val_loss_epoch": 2.0, "epoch": 1})]
    assert {k: float(v) for k, v in metrics.callback.items()} == {"val_loss": 2.0, "val_loss_epoch": 2.0}
    assert metrics.progress_bar == {"val_loss_epoch": 2.0}


def test_an_epoch_can_be_published_at_a_given_step_or_without_logging() -> None:
    run = fake_run(stepped=10)
    metrics = Metrics(run)
    results = ResultCollection(training=False)
    results.new_batch(torch.zeros(1))
    log(results, "test_step", "acc", 0.75)
    metrics.publish_epoch(results, log=True, step=4)
    metrics.publish_epoch(results, log=False)
    assert run.loggers[0].sent == [(4, {"acc": 0.75, "epoch": 3})]
    assert float(metrics.callback["acc"]) == 0.75


def test_without_loggers_nothing_is_recorded_as_logged() -> None:
    metrics = Metrics(fake_run(loggers=0))
    log(metrics.train_results, "training_step", "loss", 1.0)
    metrics.log_train_step()
    assert metrics.logged == {} and float(metrics.callback["loss"]) == 1.0


def test_a_logged_epoch_value_is_not_overwritten_by_the_epoch_key() -> None:
    run = fake_run()
    metrics = Metrics(run)
    metrics.log({"epoch": 99.0, "lr": 0.1}, step=2)
    # A metric the user named "epoch" is sent as it is; the epoch is added only where absent.
    assert run.loggers[0].sent == [(2, {"epoch": 99.0, "lr": 0.1})]


def test_clear_forgets_every_value() -> None:
    metrics = Metrics(fake_run())
    log(metrics.train_results, "training_step", "loss", 1.0, prog_bar=True)
    metrics.log_train_step()
    metrics.clear()
    assert metrics.callback == {} and metrics.progress_bar == {} and metrics.logged == {}
