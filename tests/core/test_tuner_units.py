"""The tuner's parts without a Trainer: the schedules and the suggestion (against Lightning's own), the
batch-size search schedules over a simulated memory limit, and where a tuned attribute is read and set.

tests/core/test_tuner.py runs the whole searches through a Trainer; these pin each rule alone, in-process.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from pytorch_lightning.tuner import lr_finder as pl_lr_finder

from trainer_core.errors import MisconfigurationException
from trainer_core.tuner import lightning_getattr, lightning_hasattr, lightning_setattr
from trainer_core.tuner.batch_size import _run_binsearch_scaling, _run_power_scaling
from trainer_core.tuner.lr_find import _ExponentialLR, _LinearLR, _LRFinder
from trainer_core.tuner.tuning import _check_tuner_configuration


# ---------------------------------------------------------------------- learning-rate schedules
def _lrs(schedule: type, end_lr: float, num_iter: int, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    scheduler = schedule(optimizer, end_lr, num_iter)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(_LinearLR, pl_lr_finder._LinearLR), (_ExponentialLR, pl_lr_finder._ExponentialLR)],
)
def test_the_schedules_give_lightnings_learning_rates(ours: type, theirs: type) -> None:
    mine = _lrs(ours, end_lr=1.0, num_iter=10, steps=10)
    assert mine == _lrs(theirs, end_lr=1.0, num_iter=10, steps=10)
    # Lightning's schedule: the starting rate, then step k uses (k + 1) / num_iter of the way.
    assert mine[0] == 1e-4
    k3 = 1e-4 + 0.4 * (1.0 - 1e-4) if ours is _LinearLR else 1e-4 * (1.0 / 1e-4) ** 0.4
    assert math.isclose(mine[3], k3, rel_tol=1e-12)


# ---------------------------------------------------------------------- the suggestion
def _results() -> dict[str, list[float]]:
    lrs = [1e-5 * 10 ** (i / 6) for i in range(30)]
    # Flat, a steep fall around the 18th point, then a rise (and one NaN, which is left out).
    losses = [2.0 - 1.5 / (1 + math.exp(-(i - 18))) + (0.3 * (i - 24) if i > 24 else 0.0) for i in range(30)]
    losses[5] = float("nan")
    return {"lr": lrs, "loss": losses}


@pytest.mark.parametrize(("skip_begin", "skip_end"), [(10, 1), (0, 5), (15, 3)])
def test_the_suggestion_is_lightnings_steepest_fall(skip_begin: int, skip_end: int) -> None:
    ours = _LRFinder("exponential", 1e-5, 1.0, 30)
    theirs = pl_lr_finder._LRFinder("exponential", 1e-5, 1.0, 30)
    ours.results = theirs.results = _results()
    suggestion = ours.suggestion(skip_begin, skip_end)
    assert suggestion == theirs.suggestion(skip_begin, skip_end)
    assert suggestion == ours.results["lr"][ours._optimal_idx] and ours._optimal_idx in (17, 18, 19)


def test_no_suggestion_from_fewer_than_two_points() -> None:
    finder = _LRFinder("linear", 1e-5, 1.0, 12)
    finder.results = {"lr": [float(i) for i in range(12)], "loss": [1.0] * 12}
    assert finder.suggestion(skip_begin=10, skip_end=1) is None


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"lr_find\(mode='cosine'\): use 'exponential' or 'linear'"
    ):
        _LRFinder("cosine", 1e-5, 1.0, 10)


# ---------------------------------------------------------------------- the batch-size schedules
@pytest.fixture(autouse=True)
def _no_collection_after_a_failed_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    # A full ``gc.collect()`` per simulated failure costs ~0.5 s here and frees nothing the schedule needs.
    monkeypatch.setattr("trainer_core.tuner.batch_size._free_memory", lambda failed=False: None)


class _Trial:
    """A batch-size trial on a device that runs out of memory above ``fits_up_to``."""

    def __init__(self, size: int, fits_up_to: int, max_val: int = 8192) -> None:
        self.model = SimpleNamespace(batch_size=size, _trainer=None)
        self.trainer = SimpleNamespace(lightning_module=self.model)
        self.batch_arg_name = "batch_size"
        self.fits_up_to = fits_up_to
        self.max_val = max_val
        self.tried: list[int] = []

    def run(self) -> None:
        self.tried.append(self.model.batch_size)
        if self.model.batch_size > self.fits_up_to:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def adjust(
        self, factor: float = 1.0, value: Optional[int] = None, desc: Optional[str] = None
    ) -> tuple[int, bool]:
        size = self.model.batch_size
        new = min(value if value is not None else int(size * factor), self.max_val)
        self.model.batch_size = new
        return new, new != size


def test_power_scaling_doubles_until_out_of_memory_then_halves() -> None:
    trial = _Trial(2, fits_up_to=100)
    assert _run_power_scaling(trial, 2, max_trials=25, max_val=8192) == 64
    assert trial.tried == [2, 4, 8, 16, 32, 64, 128]


def test_power_scaling_stops_after_max_trials_at_the_last_size_that_fit() -> None:
    trial = _Trial(2, fits_up_to=100)
    assert _run_power_scaling(trial, 2, max_trials=3, max_val=8192) == 8
    assert trial.tried == [2, 4, 8]


def test_binsearch_bisects_to_the_largest_size_that_fits_then_gives_the_margin_back() -> None:
    trial = _Trial(2, fits_up_to=100)
    assert _run_binsearch_scaling(trial, 2, max_trials=25, margin=0.0, max_val=8192) == 100
    assert trial.tried == [2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]
    trial = _Trial(2, fits_up_to=100)
    assert _run_binsearch_scaling(trial, 2, max_trials=25, margin=0.05, max_val=8192) == 95
    assert trial.model.batch_size == 95


def test_a_non_memory_error_in_a_trial_propagates() -> None:
    trial = _Trial(2, fits_up_to=100)
    trial.run = lambda: (_ for _ in ()).throw(RuntimeError("shapes do not match"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="shapes do not match"):
        _run_power_scaling(trial, 2, max_trials=25, max_val=8192)


# ---------------------------------------------------------------------- where the attribute lives
def _model(datamodule: Any = None, **attributes: Any) -> Any:
    trainer = SimpleNamespace(datamodule=datamodule)
    return SimpleNamespace(_trainer=trainer, **attributes)


def test_the_datamodule_wins_on_read_and_every_holder_is_set() -> None:
    datamodule = SimpleNamespace(batch_size=32, hparams={"batch_size": 16})
    model = _model(datamodule, batch_size=8, hparams={"batch_size": 4})
    assert lightning_hasattr(model, "batch_size")
    assert lightning_getattr(model, "batch_size") == 16  # the last holder: the datamodule's hparams
    lightning_setattr(model, "batch_size", 64)
    assert (model.batch_size, model.hparams, datamodule.batch_size, datamodule.hparams) == (
        64,
        {"batch_size": 64},
        64,
        {"batch_size": 64},
    )


def test_a_missing_attribute_names_where_it_was_looked_for() -> None:
    model = _model(lr=0.1)
    assert not lightning_hasattr(model, "batch_size")
    for call in (
        lambda: lightning_getattr(model, "batch_size"),
        lambda: lightning_setattr(model, "batch_size", 1),
    ):
        with pytest.raises(
            AttributeError, match="batch_size is neither stored in the model namespace nor the `hparams`"
        ):
            call()


# ---------------------------------------------------------------------- the Tuner's argument checks
@pytest.mark.parametrize(
    ("method", "kwargs", "error", "words"),
    [
        (
            "fitt",
            {},
            ValueError,
            "method 'fitt' is invalid. Should be one of ('fit', 'validate', 'test', 'predict').",
        ),
        ("fit", {"dataloaders": [1]}, MisconfigurationException, "`dataloaders` argument should be None"),
        ("test", {"train_dataloaders": [1]}, MisconfigurationException, "arguments should be None"),
        (
            "predict",
            {"val_dataloaders": [1]},
            MisconfigurationException,
            "please consider setting `dataloaders`",
        ),
    ],
)
def test_the_tuner_refuses_loaders_that_the_method_does_not_take(
    method: str, kwargs: dict[str, Any], error: type, words: str
) -> None:
    loaders = {"train_dataloaders": None, "val_dataloaders": None, "dataloaders": None, **kwargs}
    with pytest.raises(error) as caught:
        _check_tuner_configuration(method=method, **loaders)
    assert words in str(caught.value)
