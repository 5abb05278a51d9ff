"""``ResultCollection`` (``trainer_core/results.py``) without a Trainer: what ``self.log`` records and how it reduces.

Each test logs into a collection by hand, with ``LightningModule.log``'s arguments, and reads the
step and epoch dicts that callbacks, loggers and the progress bar get. ``sync_dist`` is checked in
one process against a plugin that records the reductions asked of it (a real 2-rank reduction is
``tests/plugins/test_distributed.py::test_sync_dist_and_rank_zero_logging``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from trainer_core.errors import MisconfigurationException
from trainer_core.results import ResultCollection

#: ``LightningModule.log``'s defaults, by the names of ``ResultCollection.log``'s arguments.
DEFAULTS: dict[str, Any] = dict(
    prog_bar=False,
    logger=True,
    on_step=None,
    on_epoch=None,
    reduce_fx="mean",
    enable_graph=False,
    sync_dist=False,
    sync_dist_group=None,
    add_dataloader_idx=True,
    batch_size=None,
    rank_zero_only=False,
)


def log(results: ResultCollection, name: str, value: Any, fx: str = "training_step", **options: Any) -> None:
    """``self.log(name, value, **options)`` from hook ``fx``."""
    args = {**DEFAULTS, **options}
    results.log(fx, name, value, *(args[key] for key in DEFAULTS))


def floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


class RecordingPlugin:
    """A plugin at world size 2 whose ``reduce`` records each call and doubles sums (two equal ranks)."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.metrics_group: Optional[Any] = None
        self.calls: list[tuple[float, str, Any]] = []

    def reduce(
        self, tensor: torch.Tensor, reduce_op: str = "mean", group: Optional[Any] = None
    ) -> torch.Tensor:
        self.calls.append((float(tensor), reduce_op, group))
        return tensor * 2 if reduce_op == "sum" else tensor


# ---------------------------------------------------------------------- step and epoch
def test_training_step_logs_per_step_and_validation_per_epoch_by_default() -> None:
    training = ResultCollection(training=True)
    log(training, "loss", torch.tensor(2.0))
    callback, logged, bar = training.step_metrics()
    assert floats(callback) == {"loss": 2.0} and floats(logged) == {"loss": 2.0} and bar == {}
    assert training.epoch_metrics() == ({}, {}, {})

    validation = ResultCollection(training=False)
    validation.new_batch(torch.zeros(4, 1))
    log(validation, "val_loss", 1.0, fx="validation_step", prog_bar=True)
    assert validation.step_metrics() == ({}, {}, {})
    callback, logged, bar = validation.epoch_metrics()
    assert floats(callback) == floats(logged) == floats(bar) == {"val_loss": 1.0}


def test_a_metric_logged_on_step_and_epoch_gets_both_names() -> None:
    results = ResultCollection(training=True)
    for value in (1.0, 3.0):
        results.new_batch(torch.zeros(2, 1))
        log(results, "loss", torch.tensor(value), on_step=True, on_epoch=True, prog_bar=True)
    callback, logged, bar = results.step_metrics()
    assert floats(callback) == {"loss": 3.0, "loss_step": 3.0}
    assert floats(logged) == floats(bar) == {"loss_step": 3.0}
    callback, logged, bar = results.epoch_metrics()
    assert floats(callback) == {"loss": 2.0, "loss_epoch": 2.0}
    assert floats(logged) == floats(bar) == {"loss_epoch": 2.0}


def test_reading_the_step_values_clears_the_dirty_flag() -> None:
    results = ResultCollection(training=True)
    assert not results.step_dirty
    log(results, "loss", 1.0)
    assert results.step_dirty
    results.step_metrics()
    assert not results.step_dirty


def test_the_epoch_mean_weighs_each_value_by_its_batch_size() -> None:
    results = ResultCollection(training=False)
    results.new_batch({"x": torch.zeros(2, 5)})  # the size is read from the batch
    log(results, "acc", 1.0, fx="validation_step")
    log(results, "acc_given", 1.0, fx="validation_step", batch_size=1)
    results.new_batch([torch.zeros(6, 5)])
    log(results, "acc", 4.0, fx="validation_step")
    log(results, "acc_given", 4.0, fx="validation_step", batch_size=3)
    callback, _, _ = results.epoch_metrics()
    assert floats(callback) == {"acc": (2 * 1.0 + 6 * 4.0) / 8, "acc_given": (1 * 1.0 + 3 * 4.0) / 4}


@pytest.mark.parametrize(
    ("reduce_fx", "expected"), [("sum", 6.0), ("max", 5.0), ("min", -1.0), (torch.max, 5.0)]
)
def test_other_epoch_reductions(reduce_fx: Any, expected: float) -> None:
    results = ResultCollection(training=False)
    for value in (2.0, 5.0, -1.0):
        results.new_batch(torch.zeros(3))
        log(results, "m", torch.tensor(value), fx="validation_step", reduce_fx=reduce_fx)
    assert floats(results.epoch_metrics()[0]) == {"m": expected}


def test_low_precision_values_are_accumulated_in_float32() -> None:
    results = ResultCollection(training=False)
    for _ in range(300):
        results.new_batch(torch.zeros(1))
        log(results, "m", torch.tensor(1.0, dtype=torch.bfloat16), fx="validation_step", reduce_fx="sum")
    value = results.epoch_metrics()[0]["m"]
    # float32 holds the sum exactly; in bfloat16 it would stop growing at 256 (256 + 1 rounds to 256).
    assert value.dtype == torch.float32 and value.item() == 300.0


def test_values_are_detached_unless_the_graph_is_kept() -> None:
    weight = torch.tensor(2.0, requires_grad=True)
    results = ResultCollection(training=True)
    log(results, "detached", weight * 3)
    log(results, "graph", weight * 3, enable_graph=True)
    callback, _, _ = results.step_metrics()
    assert not callback["detached"].requires_grad and callback["graph"].requires_grad


# ---------------------------------------------------------------------- sync_dist in one process
def test_sync_dist_reduces_step_values_with_the_metrics_reduction() -> None:
    plugin = RecordingPlugin()
    results = ResultCollection(training=True)
    results.plugin = plugin  # type: ignore[assignment]
    log(results, "loss", torch.tensor(1.5), sync_dist=True)
    log(results, "peak", torch.tensor(4.0), sync_dist=True, reduce_fx="max")
    log(results, "local", torch.tensor(7.0))
    assert plugin.calls == [(1.5, "mean", None), (4.0, "max", None)]
    assert floats(results.step_metrics()[0]) == {"loss": 1.5, "peak": 4.0, "local": 7.0}


def test_sync_dist_epoch_mean_reduces_the_total_and_the_count() -> None:
    """Sum of values and sum of batch sizes, then divided: a mean over every rank's samples."""
    plugin = RecordingPlugin()
    results = ResultCollection(training=False)
    results.plugin = plugin  # type: ignore[assignment]
    for value, size in ((1.0, 2), (4.0, 6)):
        results.new_batch(torch.zeros(size))
        log(results, "acc", value, fx="validation_step", sync_dist=True)
    assert plugin.calls == []  # nothing is reduced before the epoch's value is read
    assert floats(results.epoch_metrics()[0]) == {"acc": (2 * 1.0 + 6 * 4.0) * 2 / (8 * 2)}
    assert plugin.calls == [(26.0, "sum", None), (8.0, "sum", None)]


def test_sync_dist_uses_the_given_group_else_the_plugins_metrics_group() -> None:
    plugin = RecordingPlugin()
    plugin.metrics_group = "data-parallel ranks"
    results = ResultCollection(training=True)
    results.plugin = plugin  # type: ignore[assignment]
    log(results, "a", 1.0, sync_dist=True)
    log(results, "b", 2.0, sync_dist=True, sync_dist_group="my group")
    assert [call[2] for call in plugin.calls] == ["data-parallel ranks", "my group"]


def test_no_reduction_at_one_process_or_on_rank_zero_only() -> None:
    single = RecordingPlugin(world_size=1)
    results = ResultCollection(training=True)
    results.plugin = single  # type: ignore[assignment]
    log(results, "a", 1.0, sync_dist=True, on_epoch=True)
    results.epoch_metrics()
    assert single.calls == []
    # A value logged on rank 0 alone cannot join a collective the other ranks never enter.
    two = RecordingPlugin()
    results = ResultCollection(training=True)
    results.plugin = two  # type: ignore[assignment]
    log(results, "b", 1.0, sync_dist=True, rank_zero_only=True, on_epoch=True)
    results.epoch_metrics()
    assert two.calls == []


# ---------------------------------------------------------------------- several dataloaders
def test_names_carry_the_dataloader_index_and_split_per_dataloader() -> None:
    results = ResultCollection(training=False)
    for idx, value in ((0, 1.0), (1, 5.0)):
        results.set_dataloader(idx)
        results.new_batch(torch.zeros(1))
        log(results, "val_loss", value, fx="validation_step")
    results.set_dataloader(None)
    log(results, "overall", 9.0, fx="on_validation_epoch_end")
    _, logged, _ = results.epoch_metrics()
    assert floats(logged) == {
        "val_loss/dataloader_idx_0": 1.0,
        "val_loss/dataloader_idx_1": 5.0,
        "overall": 9.0,
    }
    assert results.per_dataloader(logged, 2) == [
        {"val_loss/dataloader_idx_0": 1.0, "overall": 9.0},
        {"val_loss/dataloader_idx_1": 5.0, "overall": 9.0},
    ]


# ---------------------------------------------------------------------- metric objects
def test_a_torchmetrics_metric_reports_its_forward_per_step_and_compute_per_epoch() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.MeanMetric()
    results = ResultCollection(training=True)
    for value in (2.0, 4.0, 9.0):
        metric(torch.tensor(value))
        log(results, "mean", metric, on_step=True, on_epoch=True)
    callback, _, _ = results.step_metrics()
    assert float(callback["mean_step"]) == 9.0
    assert float(results.epoch_metrics()[0]["mean_epoch"]) == 5.0
    results.reset_torchmetrics()
    assert float(metric.mean_value) == 0.0  # the next epoch starts afresh
    assert float(results.epoch_metrics()[0]["mean_epoch"]) == 5.0  # the computed value stays readable


def test_another_object_under_a_metrics_name_is_refused() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    results = ResultCollection(training=True)
    log(results, "m", torchmetrics.MeanMetric())
    with pytest.raises(MisconfigurationException, match=r"got another Metric object where this epoch logged"):
        log(results, "m", torchmetrics.MeanMetric())


# ---------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    ("value", "fx", "options", "message"),
    [
        (torch.ones(2), "training_step", {}, r"got a tensor of shape \(2,\); log a scalar"),
        (1.0, "training_step", {"on_step": False, "on_epoch": False}, r"logs nothing; set one of them"),
        (1.0, "training_step", {"reduce_fx": "median"}, r"reduce_fx='median'\) is not supported"),
        (1.0, "predict_step", {}, r"is not supported in `predict_step`: prediction logs nothing"),
        ("high", "training_step", {}, r"got a str; log a number, a scalar tensor or a torchmetrics Metric"),
        (True, "training_step", {}, r"got a bool"),
    ],
)
def test_what_cannot_be_logged(value: Any, fx: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        log(ResultCollection(training=True), "m", value, fx=fx, **options)


def test_one_name_from_two_hooks_is_refused() -> None:
    results = ResultCollection(training=True)
    log(results, "m", 1.0)
    with pytest.raises(
        MisconfigurationException, match=r"called from both `training_step` and `on_train_epoch_end`"
    ):
        log(results, "m", 1.0, fx="on_train_epoch_end")


def test_reset_forgets_values_and_names() -> None:
    results = ResultCollection(training=True)
    log(results, "m", 1.0, fx="on_train_epoch_end")
    results.reset()
    assert results.metrics == {} and results.epoch_metrics() == ({}, {}, {})
    log(results, "m", 2.0, fx="training_step")  # a name is free again after the reset
    assert floats(results.step_metrics()[0]) == {"m": 2.0}


def test_a_dtensor_like_value_is_logged_whole() -> None:
    class Sharded:
        def full_tensor(self) -> torch.Tensor:
            return torch.tensor(3.0)

    results = ResultCollection(training=True)
    log(results, "loss", Sharded())
    assert floats(results.step_metrics()[0]) == {"loss": 3.0}


def test_a_users_plugin_whose_reduce_takes_no_group_still_serves_sync_dist() -> None:
    # A plugin written for one process group: ``reduce(tensor, reduce_op)``, no ``group`` argument.
    plugin = SimpleNamespace(world_size=2, metrics_group=None, reduce=lambda t, reduce_op: t * 10)
    results = ResultCollection(training=False)
    results.plugin = plugin  # type: ignore[assignment]
    results.new_batch(torch.zeros(1))
    log(results, "s", 1.5, fx="validation_step", reduce_fx="sum", sync_dist=True)
    assert floats(results.epoch_metrics()[0]) == {"s": 15.0}
