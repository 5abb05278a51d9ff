"""``TrainerConfig`` (trainer_core/config.py): every check of the run settings, and how they resolve.

In-process and without a Trainer, except where the test is about what the Trainer makes of the config.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import pytest

from trainer_core import Trainer
from trainer_core.config import TrainerConfig
from trainer_core.errors import MisconfigurationException

FRACTION_OR_BATCHES = "use a fraction in [0.0, 1.0] or a number of batches."
FRACTION = "a float is a fraction of the data in [0.0, 1.0]; pass an int for a number of batches."


# ---------------------------------------------------------------------- every refusal, word for word
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fast_dev_run": -1}, "Trainer(fast_dev_run=-1): use True or a positive number of batches."),
        ({"fast_dev_run": 1.5}, "Trainer(fast_dev_run=1.5): use True or a positive number of batches."),
        ({"fast_dev_run": "x"}, "Trainer(fast_dev_run='x'): use True or a positive number of batches."),
        ({"overfit_batches": 1.5}, f"Trainer(overfit_batches=1.5): {FRACTION}"),
        ({"overfit_batches": -1}, "Trainer(overfit_batches=-1): a number of batches cannot be negative."),
        ({"overfit_batches": "all"}, f"Trainer(overfit_batches='all'): {FRACTION_OR_BATCHES}"),
        ({"max_steps": -2}, "Trainer(max_steps=-2): use -1 (no limit) or a non-negative integer."),
        ({"max_steps": 2.0}, "Trainer(max_steps=2.0): use -1 (no limit) or a non-negative integer."),
        ({"limit_train_batches": 1.5}, f"Trainer(limit_train_batches=1.5): {FRACTION}"),
        ({"limit_val_batches": -1}, "Trainer(limit_val_batches=-1): a number of batches cannot be negative."),
        ({"limit_test_batches": "a"}, f"Trainer(limit_test_batches='a'): {FRACTION_OR_BATCHES}"),
        ({"limit_predict_batches": True}, f"Trainer(limit_predict_batches=True): {FRACTION_OR_BATCHES}"),
        ({"val_check_interval": 2.5}, f"Trainer(val_check_interval=2.5): {FRACTION}"),
        ({"check_val_every_n_epoch": 0}, "Trainer(check_val_every_n_epoch=0): use a positive integer."),
        ({"check_val_every_n_epoch": True}, "Trainer(check_val_every_n_epoch=True): use a positive integer."),
        (
            {"num_sanity_val_steps": -2},
            "Trainer(num_sanity_val_steps=-2): use -1 (all), 0 (none) or a number of batches.",
        ),
        (
            {"num_sanity_val_steps": 1.0},
            "Trainer(num_sanity_val_steps=1.0): use -1 (all), 0 (none) or a number of batches.",
        ),
        ({"log_every_n_steps": 0}, "Trainer(log_every_n_steps=0): use a positive integer."),
        ({"accumulate_grad_batches": 2.0}, "Trainer(accumulate_grad_batches=2.0): use a positive integer."),
        ({"gradient_clip_algorithm": "l2"}, "Trainer(gradient_clip_algorithm='l2'): use 'norm' or 'value'."),
        ({"gradient_clip_val": -1}, "Trainer(gradient_clip_val=-1): use a non-negative number."),
        ({"gradient_clip_val": "1"}, "Trainer(gradient_clip_val='1'): use a non-negative number."),
        ({"benchmark": 1}, "Trainer(benchmark=1): use True, False or None."),
        ({"detect_anomaly": None}, "Trainer(detect_anomaly=None): use True or False."),
        ({"sync_batchnorm": "yes"}, "Trainer(sync_batchnorm='yes'): use True or False."),
        (
            {"reload_dataloaders_every_n_epochs": False},
            "Trainer(reload_dataloaders_every_n_epochs=False): use 0 (off) or a positive integer.",
        ),
        # Of several bad values, the first in the Trainer's order of checks is named.
        (
            {"gradient_clip_algorithm": "x", "gradient_clip_val": -1, "max_steps": -5},
            "Trainer(max_steps=-5): use -1 (no limit) or a non-negative integer.",
        ),
    ],
)
def test_each_bad_value_is_refused_with_the_message_naming_it(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException) as caught:
        TrainerConfig(**kwargs)
    assert str(caught.value) == message


# ---------------------------------------------------------------------- what the settings resolve to
def test_defaults_resolve_as_lightnings() -> None:
    config = TrainerConfig()
    assert config.attributes() == {
        "fast_dev_run": False,
        "max_epochs": 1000,
        "min_epochs": None,
        "max_steps": -1,
        "min_steps": None,
        "limit_train_batches": 1.0,
        "limit_val_batches": 1.0,
        "limit_test_batches": 1.0,
        "limit_predict_batches": 1.0,
        "overfit_batches": 0.0,
        "val_check_interval": 1.0,
        "check_val_every_n_epoch": 1,
        "num_sanity_val_steps": 2,
        "log_every_n_steps": 50,
        "accumulate_grad_batches": 1,
        "gradient_clip_val": None,
        "gradient_clip_algorithm": None,
        "deterministic": None,
        "benchmark": None,
        "inference_mode": True,
        "use_distributed_sampler": True,
        "detect_anomaly": False,
        "sync_batchnorm": False,
        "reload_dataloaders_every_n_epochs": 0,
        "enable_model_summary": True,
        "optimizer_in_backward": False,
    }


@pytest.mark.parametrize(("fast_dev_run", "batches"), [(True, 1), (3, 3)])
def test_fast_dev_run_overrides_the_limits_and_hides_bad_ones(fast_dev_run: Any, batches: int) -> None:
    config = TrainerConfig(
        fast_dev_run=fast_dev_run, limit_train_batches=5.0, max_steps=-7, max_epochs=9, num_sanity_val_steps=4
    )
    assert (config.limit_train_batches, config.limit_val_batches) == (batches, batches)
    assert (config.limit_test_batches, config.limit_predict_batches) == (batches, batches)
    assert (config.max_steps, config.max_epochs, config.num_sanity_val_steps) == (batches, 1, 0)
    assert (config.val_check_interval, config.check_val_every_n_epoch) == (1.0, 1)
    assert config.fast_dev_run is fast_dev_run


def test_overfit_batches_sets_the_train_and_val_limits_only() -> None:
    config = TrainerConfig(overfit_batches=2, limit_train_batches=-3, limit_test_batches=4)
    assert (config.limit_train_batches, config.limit_val_batches, config.limit_test_batches) == (2, 2, 4)
    assert TrainerConfig(overfit_batches=None).overfit_batches == 0.0


@pytest.mark.parametrize(
    ("kwargs", "max_epochs"),
    [({}, 1000), ({"timed": True}, -1), ({"max_steps": 5}, -1), ({"max_epochs": 3, "timed": True}, 3)],
)
def test_max_epochs_has_no_default_under_a_step_or_time_limit(
    kwargs: dict[str, Any], max_epochs: int
) -> None:
    assert TrainerConfig(**kwargs).max_epochs == max_epochs


@pytest.mark.parametrize(
    ("benchmark", "deterministic", "resolved"),
    [
        (None, None, None),
        (None, True, False),
        (None, "warn", False),
        (True, None, True),
        (False, True, False),
    ],
)
def test_benchmark_resolves_off_under_deterministic_unless_given(
    benchmark: Any, deterministic: Any, resolved: Any
) -> None:
    assert TrainerConfig(benchmark=benchmark, deterministic=deterministic).benchmark is resolved


def test_benchmark_with_deterministic_warns_that_cudnn_may_still_differ() -> None:
    with pytest.warns(UserWarning, match=r"torch ignores cudnn.deterministic while cudnn.benchmark is on"):
        assert TrainerConfig(benchmark=True, deterministic=True).benchmark is True


def test_detect_anomaly_logs_that_it_slows_training(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainer_core"):
        TrainerConfig(detect_anomaly=True)
    assert "Trainer(detect_anomaly=True) slows training down a lot" in caplog.text


# ---------------------------------------------------------------------- the config and the Trainer
def test_every_field_is_a_trainer_argument_with_the_same_default() -> None:
    """LightningCLI reads ``Trainer``'s signature; the config must not drift from it."""
    parameters = inspect.signature(Trainer).parameters
    for field in dataclasses.fields(TrainerConfig):
        assert field.name in parameters, field.name
        assert parameters[field.name].default == field.default, field.name


def test_the_trainers_settings_are_the_configs_as_plain_attributes() -> None:
    """The loops read them every step and the tuner sets them: instance attributes, no property between."""
    trainer = Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_time="00:00:01:00",
        overfit_batches=3,
        accumulate_grad_batches=2,
    )
    expected = TrainerConfig(overfit_batches=3, accumulate_grad_batches=2, timed=True).attributes()
    assert {name: vars(trainer)[name] for name in expected} == expected
    assert trainer.max_epochs == -1 and trainer.limit_val_batches == 3
    assert not any(hasattr(Trainer, name) for name in expected)
    trainer.max_steps = 7
    assert trainer.max_steps == 7
