"""LambdaCallback: every hook given as a function runs where a Callback subclass's hook would, with the same
arguments; a name that is not a hook is refused."""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
from boring import BoringModel, fast_trainer, random_loader
from torch import nn

from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.lambda_function import LambdaCallback, callback_hooks
from trainer_core.errors import MisconfigurationException


class Model(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


class Recorder(Callback):
    """A subclass that records every hook: what LambdaCallback must match."""

    def __init__(self, calls: list[tuple[str, tuple[str, ...]]]) -> None:
        self.calls = calls


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, ...]:
    values = [*args, *(f"{k}={v}" for k, v in sorted(kwargs.items()))]
    return tuple(type(a).__name__ if not isinstance(a, (int, str)) else repr(a) for a in values)


for _name in callback_hooks():

    def _hook(self: Recorder, *args: Any, _name: str = _name, **kwargs: Any) -> None:
        self.calls.append((_name, _describe(args, kwargs)))

    setattr(Recorder, _name, _hook)


def _run_all_stages(callback: Callback) -> None:
    trainer = fast_trainer(
        callbacks=[callback],
        limit_train_batches=2,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        num_sanity_val_steps=1,
        enable_checkpointing=True,
        default_root_dir=None,
    )
    model = Model()
    loader = random_loader(4, 4, batch_size=2)
    trainer.fit(model, loader, loader)
    trainer.validate(model, loader, verbose=False)
    trainer.test(model, loader, verbose=False)
    trainer.predict(model, loader)


def test_every_hook_runs_like_a_subclass(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    expected: list[tuple[str, tuple[str, ...]]] = []
    _run_all_stages(Recorder(expected))

    seen: list[tuple[str, tuple[str, ...]]] = []
    hooks = {
        name: functools.partial(
            lambda name, *args, **kwargs: seen.append((name, _describe(args, kwargs))), name
        )
        for name in callback_hooks()
    }
    _run_all_stages(LambdaCallback(**hooks))
    assert seen == expected
    # The run reached the hooks of every stage, the checkpoint hook included.
    names = {name for name, _ in seen}
    for hook in (
        "setup",
        "on_fit_start",
        "on_train_batch_end",
        "on_before_optimizer_step",
        "on_save_checkpoint",
        "on_validation_batch_end",
        "on_test_epoch_end",
        "on_predict_batch_end",
        "teardown",
    ):
        assert hook in names, hook


def test_only_given_hooks_are_called(tmp_path: Any) -> None:
    calls: list[int] = []
    cb = LambdaCallback(
        on_train_batch_end=lambda trainer, module, outputs, batch, batch_idx: calls.append(batch_idx)
    )
    fast_trainer(callbacks=[cb], limit_train_batches=3).fit(BoringModel(), random_loader(6, 4, batch_size=2))
    assert calls == [0, 1, 2]
    from trainer_core.connectors import callback_overrides

    # The Trainer sees only the given hook as overridden: the others cost nothing per batch.
    assert callback_overrides(cb, "on_train_batch_end")
    assert not callback_overrides(cb, "on_train_batch_start")


def test_builtin_and_callable_objects_work() -> None:
    class Count:
        def __init__(self) -> None:
            self.n = 0

        def __call__(self, *args: Any) -> None:
            self.n += 1

    count = Count()
    out = io.StringIO()
    # Neither a callable object nor ``print`` (a builtin) has a code object of its own; the callback
    # wraps them so that the Trainer still sees the hooks as overridden.
    cb = LambdaCallback(
        on_train_epoch_end=count, on_train_start=functools.partial(print, "started", file=out)
    )
    fast_trainer(callbacks=[cb], max_epochs=2, limit_train_batches=1).fit(BoringModel(), random_loader(2, 4))
    assert count.n == 2
    assert out.getvalue().startswith("started <trainer_core.trainer.Trainer object")


def test_on_exception_gets_the_error() -> None:
    errors: list[BaseException] = []

    class Failing(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise ValueError("boom at step")

    cb = LambdaCallback(on_exception=lambda trainer, module, exc: errors.append(exc))
    with pytest.raises(ValueError, match="boom at step"):
        fast_trainer(callbacks=[cb]).fit(Failing(), random_loader(2, 4))
    assert len(errors) == 1 and str(errors[0]) == "boom at step"


def test_unknown_names_are_refused() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"LambdaCallback\(on_train_epoch_ends=\.\.\.\): not a Callback hook"
    ):
        LambdaCallback(on_train_epoch_ends=lambda *a: None)
    with pytest.raises(MisconfigurationException, match="state_dict"):
        LambdaCallback(state_dict=lambda: {})
    with pytest.raises(MisconfigurationException, match=r"on_fit_start=3\)"):
        LambdaCallback(on_fit_start=3)
    # Lightning's keyword set is accepted in full.
    import inspect

    from pytorch_lightning.callbacks import LambdaCallback as LightningLambda

    assert set(inspect.signature(LightningLambda).parameters) <= callback_hooks()
