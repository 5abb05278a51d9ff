"""Hook call order of ``fit``, ``validate``, ``test`` and ``predict``.

A user's Lightning 2.x module and callbacks rely on the order in which the Trainer calls their
hooks (for example: gradients exist in ``on_before_optimizer_step``; callbacks run before the
module's hook of the same name; ``setup`` runs before ``configure_optimizers``). These tests
record every hook call, on entry, from a module and a callback that override every hook and
call ``super()``, and compare the recording with an explicit expected list written from
Lightning 2.x's documented order (``tests/tests_pytorch/models/test_hooks.py`` in
Lightning-AI/pytorch-lightning; Lightning records on *exit*, so its ``optimizer_step`` appears
after the closure's hooks, whereas here it is recorded on entry, before the closure runs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from boring import quiet_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks import Callback

N_BATCHES = 2


def _loader(n: int = 8, batch_size: int = 2) -> DataLoader:
    return random_loader(n, 4, batch_size=batch_size)


class HookedCallback(Callback):
    """Records ``Callback.<hook>`` on entry of every hook a callback can override."""

    def __init__(self, called: list[str]) -> None:
        self.called = called
        self.args: dict[str, list[Any]] = {}

    def _rec(self, name: str, *args: Any) -> None:
        self.called.append(f"Callback.{name}")
        self.args.setdefault(name, []).append(args)

    def setup(self, trainer, pl_module, stage):
        self._rec("setup", stage)
        return super().setup(trainer, pl_module, stage)

    def teardown(self, trainer, pl_module, stage):
        self._rec("teardown", stage)
        return super().teardown(trainer, pl_module, stage)

    def on_fit_start(self, trainer, pl_module):
        self._rec("on_fit_start")

    def on_fit_end(self, trainer, pl_module):
        self._rec("on_fit_end")

    def on_sanity_check_start(self, trainer, pl_module):
        self._rec("on_sanity_check_start")

    def on_sanity_check_end(self, trainer, pl_module):
        self._rec("on_sanity_check_end")

    def on_train_start(self, trainer, pl_module):
        self._rec("on_train_start")

    def on_train_end(self, trainer, pl_module):
        self._rec("on_train_end")

    def on_validation_start(self, trainer, pl_module):
        self._rec("on_validation_start")

    def on_validation_end(self, trainer, pl_module):
        self._rec("on_validation_end")

    def on_test_start(self, trainer, pl_module):
        self._rec("on_test_start")

    def on_test_end(self, trainer, pl_module):
        self._rec("on_test_end")

    def on_predict_start(self, trainer, pl_module):
        self._rec("on_predict_start")

    def on_predict_end(self, trainer, pl_module):
        self._rec("on_predict_end")

    def on_train_epoch_start(self, trainer, pl_module):
        self._rec("on_train_epoch_start")

    def on_train_epoch_end(self, trainer, pl_module):
        self._rec("on_train_epoch_end")

    def on_validation_epoch_start(self, trainer, pl_module):
        self._rec("on_validation_epoch_start")

    def on_validation_epoch_end(self, trainer, pl_module):
        self._rec("on_validation_epoch_end")

    def on_test_epoch_start(self, trainer, pl_module):
        self._rec("on_test_epoch_start")

    def on_test_epoch_end(self, trainer, pl_module):
        self._rec("on_test_epoch_end")

    def on_predict_epoch_start(self, trainer, pl_module):
        self._rec("on_predict_epoch_start")

    def on_predict_epoch_end(self, trainer, pl_module):
        self._rec("on_predict_epoch_end")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._rec("on_train_batch_start", batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._rec("on_train_batch_end", outputs, batch_idx)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._rec("on_validation_batch_start", batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._rec("on_validation_batch_end", outputs, batch_idx)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._rec("on_test_batch_start", batch_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._rec("on_test_batch_end", outputs, batch_idx)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._rec("on_predict_batch_start", batch_idx)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._rec("on_predict_batch_end", outputs, batch_idx)

    def on_exception(self, trainer, pl_module, exception):
        self._rec("on_exception", exception)

    def on_before_backward(self, trainer, pl_module, loss):
        self._rec("on_before_backward", loss)

    def on_after_backward(self, trainer, pl_module):
        self._rec("on_after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._rec("on_before_optimizer_step", optimizer)

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._rec("on_before_zero_grad", optimizer)


class HookedModel(LightningModule):
    """Records ``<hook>`` on entry of every LightningModule hook, then runs the default."""

    def __init__(self, called: list[str]) -> None:
        super().__init__()
        self.called = called
        self.layer = nn.Linear(4, 1)
        self.args: dict[str, list[Any]] = {}

    def _rec(self, name: str, *args: Any) -> None:
        self.called.append(name)
        self.args.setdefault(name, []).append(args)

    def forward(self, x):
        return self.layer(x)

    # steps
    def training_step(self, batch, batch_idx):
        self._rec("training_step", batch_idx)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        self._rec("validation_step", batch_idx)
        x, y = batch
        return {"x": nn.functional.mse_loss(self(x), y)}

    def test_step(self, batch, batch_idx):
        self._rec("test_step", batch_idx)
        x, y = batch
        return {"y": nn.functional.mse_loss(self(x), y)}

    def predict_step(self, batch, batch_idx):
        self._rec("predict_step", batch_idx)
        return self(batch[0])

    # configuration
    def configure_callbacks(self):
        self._rec("configure_callbacks")
        return super().configure_callbacks()

    def configure_model(self):
        self._rec("configure_model")
        return super().configure_model()

    def configure_optimizers(self):
        self._rec("configure_optimizers")
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def prepare_data(self):
        self._rec("prepare_data")
        return super().prepare_data()

    def setup(self, stage):
        self._rec("setup", stage)
        return super().setup(stage)

    def teardown(self, stage):
        self._rec("teardown", stage)
        return super().teardown(stage)

    # data
    def train_dataloader(self):
        self._rec("train_dataloader")
        return _loader()

    def val_dataloader(self):
        self._rec("val_dataloader")
        return _loader()

    def test_dataloader(self):
        self._rec("test_dataloader")
        return _loader()

    def predict_dataloader(self):
        self._rec("predict_dataloader")
        return _loader()

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self._rec("on_before_batch_transfer", dataloader_idx)
        return super().on_before_batch_transfer(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self._rec("transfer_batch_to_device", device, dataloader_idx)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self._rec("on_after_batch_transfer", dataloader_idx)
        return super().on_after_batch_transfer(batch, dataloader_idx)

    # optimization
    def on_before_zero_grad(self, optimizer):
        self._rec("on_before_zero_grad", optimizer)
        return super().on_before_zero_grad(optimizer)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self._rec("optimizer_zero_grad", epoch, batch_idx)
        return super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_backward(self, loss):
        self._rec("on_before_backward", loss)
        return super().on_before_backward(loss)

    def backward(self, loss, *args, **kwargs):
        self._rec("backward", loss)
        return super().backward(loss, *args, **kwargs)

    def on_after_backward(self):
        self._rec("on_after_backward")
        return super().on_after_backward()

    def on_before_optimizer_step(self, optimizer):
        self._rec("on_before_optimizer_step", optimizer)
        return super().on_before_optimizer_step(optimizer)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self._rec("configure_gradient_clipping", gradient_clip_val, gradient_clip_algorithm)
        return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self._rec("optimizer_step", epoch, batch_idx)
        return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def lr_scheduler_step(self, scheduler, metric):
        self._rec("lr_scheduler_step", metric)
        return super().lr_scheduler_step(scheduler, metric)

    def manual_backward(self, loss, *args, **kwargs):
        self._rec("manual_backward", loss)
        return super().manual_backward(loss, *args, **kwargs)

    # stage hooks
    def on_fit_start(self):
        self._rec("on_fit_start")

    def on_fit_end(self):
        self._rec("on_fit_end")

    def on_train_start(self):
        self._rec("on_train_start")

    def on_train_end(self):
        self._rec("on_train_end")

    def on_validation_start(self):
        self._rec("on_validation_start")

    def on_validation_end(self):
        self._rec("on_validation_end")

    def on_test_start(self):
        self._rec("on_test_start")

    def on_test_end(self):
        self._rec("on_test_end")

    def on_predict_start(self):
        self._rec("on_predict_start")

    def on_predict_end(self):
        self._rec("on_predict_end")

    def on_train_epoch_start(self):
        self._rec("on_train_epoch_start")

    def on_train_epoch_end(self):
        self._rec("on_train_epoch_end")

    def on_validation_epoch_start(self):
        self._rec("on_validation_epoch_start")

    def on_validation_epoch_end(self):
        self._rec("on_validation_epoch_end")

    def on_test_epoch_start(self):
        self._rec("on_test_epoch_start")

    def on_test_epoch_end(self):
        self._rec("on_test_epoch_end")

    def on_predict_epoch_start(self):
        self._rec("on_predict_epoch_start")

    def on_predict_epoch_end(self):
        self._rec("on_predict_epoch_end")

    def on_train_batch_start(self, batch, batch_idx):
        self._rec("on_train_batch_start", batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._rec("on_train_batch_end", outputs, batch_idx)

    def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
        self._rec("on_validation_batch_start", batch_idx)

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._rec("on_validation_batch_end", outputs, batch_idx)

    def on_test_batch_start(self, batch, batch_idx, dataloader_idx=0):
        self._rec("on_test_batch_start", batch_idx)

    def on_test_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._rec("on_test_batch_end", outputs, batch_idx)

    def on_predict_batch_start(self, batch, batch_idx, dataloader_idx=0):
        self._rec("on_predict_batch_start", batch_idx)

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._rec("on_predict_batch_end", outputs, batch_idx)

    def on_validation_model_eval(self):
        self._rec("on_validation_model_eval")
        return super().on_validation_model_eval()

    def on_validation_model_train(self):
        self._rec("on_validation_model_train")
        return super().on_validation_model_train()

    def on_test_model_eval(self):
        self._rec("on_test_model_eval")
        return super().on_test_model_eval()

    def on_test_model_train(self):
        self._rec("on_test_model_train")
        return super().on_test_model_train()

    def on_predict_model_eval(self):
        self._rec("on_predict_model_eval")
        return super().on_predict_model_eval()

    def on_save_checkpoint(self, checkpoint):
        self._rec("on_save_checkpoint")

    def on_load_checkpoint(self, checkpoint):
        self._rec("on_load_checkpoint")


# ---------------------------------------------------------------------- expected sequences
TRANSFER = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"]


def _setup(stage: str, optimizers: bool) -> list[str]:
    return [
        "configure_callbacks",
        "prepare_data",
        "Callback.setup",
        "setup",
        "configure_model",
        *(["configure_optimizers"] if optimizers else []),
    ]


def _teardown() -> list[str]:
    return ["Callback.teardown", "teardown"]


def _eval_run(fn: str, batches: int) -> list[str]:
    """One evaluation run as Lightning calls it (the dataloader hook excluded)."""
    out = [
        f"on_{fn}_model_eval",
        f"Callback.on_{fn}_start",
        f"on_{fn}_start",
        f"Callback.on_{fn}_epoch_start",
        f"on_{fn}_epoch_start",
    ]
    for _ in range(batches):
        out += [
            *TRANSFER,
            f"Callback.on_{fn}_batch_start",
            f"on_{fn}_batch_start",
            f"{fn}_step",
            f"Callback.on_{fn}_batch_end",
            f"on_{fn}_batch_end",
        ]
    out += [
        f"Callback.on_{fn}_epoch_end",
        f"on_{fn}_epoch_end",
        f"Callback.on_{fn}_end",
        f"on_{fn}_end",
        f"on_{fn}_model_train",
    ]
    return out


def _auto_train_batch(zero_grad: bool = True, step: bool = True) -> list[str]:
    """One automatic-optimization batch; ``optimizer_step`` is entered before its closure runs."""
    return [
        *TRANSFER,
        "Callback.on_train_batch_start",
        "on_train_batch_start",
        *(["optimizer_step"] if step else []),
        "training_step",
        *(
            ["Callback.on_before_zero_grad", "on_before_zero_grad", "optimizer_zero_grad"]
            if zero_grad
            else []
        ),
        "Callback.on_before_backward",
        "on_before_backward",
        "backward",
        "Callback.on_after_backward",
        "on_after_backward",
        *(
            ["Callback.on_before_optimizer_step", "on_before_optimizer_step", "configure_gradient_clipping"]
            if step
            else []
        ),
        "Callback.on_train_batch_end",
        "on_train_batch_end",
    ]


def _fit_expected(train_batches: list[list[str]], val_batches: int) -> list[str]:
    return [
        *_setup("fit", optimizers=True),
        "Callback.on_fit_start",
        "on_fit_start",
        "Callback.on_sanity_check_start",
        "val_dataloader",
        *_eval_run("validation", val_batches),
        "Callback.on_sanity_check_end",
        "train_dataloader",
        "Callback.on_train_start",
        "on_train_start",
        "Callback.on_train_epoch_start",
        "on_train_epoch_start",
        *[hook for batch in train_batches for hook in batch],
        *_eval_run("validation", val_batches),
        "Callback.on_train_epoch_end",
        "on_train_epoch_end",
        "Callback.on_train_end",
        "on_train_end",
        "Callback.on_fit_end",
        "on_fit_end",
        *_teardown(),
    ]


def _trainer(callback: Callback, **kwargs: Any) -> Trainer:
    """Two batches of every kind, and the sanity check left on: its hooks are part of the order."""
    defaults: dict[str, Any] = dict(
        max_epochs=1,
        limit_train_batches=N_BATCHES,
        limit_val_batches=N_BATCHES,
        limit_test_batches=N_BATCHES,
        limit_predict_batches=N_BATCHES,
        callbacks=[callback],
    )
    return quiet_trainer(**{**defaults, **kwargs})


def _diff(called: list[str], expected: list[str]) -> str:
    """The first position where the two sequences differ, with context, for the failure message."""
    for i, (a, b) in enumerate(zip(called, expected)):
        if a != b:
            lo = max(0, i - 3)
            return f"first difference at {i}: got {called[lo : i + 4]} expected {expected[lo : i + 4]}"
    return f"lengths differ: got {len(called)} expected {len(expected)}"


# ---------------------------------------------------------------------- tests
def test_fit_hook_order():
    called: list[str] = []
    model = HookedModel(called)
    callback = HookedCallback(called)
    trainer = _trainer(callback)
    trainer.fit(model)

    expected = _fit_expected([_auto_train_batch() for _ in range(N_BATCHES)], N_BATCHES)
    assert called == expected, _diff(called, expected)
    assert trainer.global_step == N_BATCHES


def test_fit_hook_arguments():
    """Besides the order: the batch indices, stages and outputs the hooks receive."""
    called: list[str] = []
    model = HookedModel(called)
    callback = HookedCallback(called)
    _trainer(callback, gradient_clip_val=0.5, gradient_clip_algorithm="value").fit(model)

    assert callback.args["setup"] == [("fit",)]
    assert callback.args["teardown"] == [("fit",)]
    assert model.args["setup"] == [("fit",)]
    assert [a[-1] for a in callback.args["on_train_batch_start"]] == [0, 1]
    assert [a[-1] for a in model.args["training_step"]] == [0, 1]
    # two sanity-check batches, then two validation batches after the training batches
    assert [a[-1] for a in model.args["validation_step"]] == [0, 1, 0, 1]
    assert model.args["optimizer_step"] == [(0, 0), (0, 1)]
    assert model.args["optimizer_zero_grad"] == [(0, 0), (0, 1)]
    assert model.args["transfer_batch_to_device"][0] == (torch.device("cpu"), 0)
    assert model.args["configure_gradient_clipping"] == [(0.5, "value"), (0.5, "value")]
    outputs, batch_idx = model.args["on_train_batch_end"][0]
    assert set(outputs) == {"loss"} and batch_idx == 0
    assert outputs["loss"].grad_fn is None  # the batch-end hook gets the detached loss
    outputs, _ = model.args["on_validation_batch_end"][0]
    assert set(outputs) == {"x"}


def test_fit_hook_order_with_accumulation():
    """With accumulate_grad_batches=2, the first batch zeroes the gradients and the second steps."""
    called: list[str] = []
    model = HookedModel(called)
    callback = HookedCallback(called)
    trainer = _trainer(callback, accumulate_grad_batches=2, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model)

    expected = [
        *_setup("fit", optimizers=True),
        "Callback.on_fit_start",
        "on_fit_start",
        "train_dataloader",
        "Callback.on_train_start",
        "on_train_start",
        "Callback.on_train_epoch_start",
        "on_train_epoch_start",
        *_auto_train_batch(zero_grad=True, step=False),
        *_auto_train_batch(zero_grad=False, step=True),
        "Callback.on_train_epoch_end",
        "on_train_epoch_end",
        "Callback.on_train_end",
        "on_train_end",
        "Callback.on_fit_end",
        "on_fit_end",
        *_teardown(),
    ]
    assert called == expected, _diff(called, expected)
    assert trainer.global_step == 1


def test_fit_hook_order_manual_optimization():
    """Manual optimization: ``manual_backward`` runs the backward hooks; ``opt.step()`` runs the closure,
    then ``on_before_optimizer_step``; Lightning calls no zero-grad hooks for ``opt.zero_grad()``."""
    called: list[str] = []

    class ManualModel(HookedModel):
        def __init__(self, called):
            super().__init__(called)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self._rec("training_step", batch_idx)
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step(closure=lambda: called.append("closure"))
            return {"loss": loss}

    model = ManualModel(called)
    callback = HookedCallback(called)
    trainer = _trainer(callback, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model)

    batch = [
        *TRANSFER,
        "Callback.on_train_batch_start",
        "on_train_batch_start",
        "training_step",
        "manual_backward",
        "Callback.on_before_backward",
        "on_before_backward",
        "backward",
        "Callback.on_after_backward",
        "on_after_backward",
        "closure",
        "Callback.on_before_optimizer_step",
        "on_before_optimizer_step",
        "Callback.on_train_batch_end",
        "on_train_batch_end",
    ]
    expected = [
        *_setup("fit", optimizers=True),
        "Callback.on_fit_start",
        "on_fit_start",
        "train_dataloader",
        "Callback.on_train_start",
        "on_train_start",
        "Callback.on_train_epoch_start",
        "on_train_epoch_start",
        *batch,
        *batch,
        "Callback.on_train_epoch_end",
        "on_train_epoch_end",
        "Callback.on_train_end",
        "on_train_end",
        "Callback.on_fit_end",
        "on_fit_end",
        *_teardown(),
    ]
    assert called == expected, _diff(called, expected)


def test_on_validation_model_zero_grad_called_before_validation_in_fit():
    """Lightning 2.x calls ``on_validation_model_zero_grad`` (default: ``zero_grad(set_to_none=True)``)
    before each validation run inside ``fit``, so no gradients are held during validation."""
    seen: list[Any] = []

    class Model(HookedModel):
        def on_validation_model_zero_grad(self):
            seen.append("on_validation_model_zero_grad")
            self.zero_grad(set_to_none=True)

        def on_validation_start(self):
            seen.append([p.grad is None for p in self.parameters()])

    model = Model([])
    _trainer(HookedCallback([]), num_sanity_val_steps=0).fit(model)
    assert seen == ["on_validation_model_zero_grad", [True, True]]


@pytest.mark.parametrize(
    ("verb", "fn", "kind"), [("validate", "validation", "val"), ("test", "test", "test")]
)
def test_evaluate_hook_order(verb, fn, kind):
    called: list[str] = []
    model = HookedModel(called)
    callback = HookedCallback(called)
    trainer = _trainer(callback)
    results = getattr(trainer, verb)(model, verbose=False)

    expected = [
        *_setup(verb, optimizers=False),
        f"{kind}_dataloader",
        *_eval_run(fn, N_BATCHES),
        *_teardown(),
    ]
    assert called == expected, _diff(called, expected)
    assert callback.args["setup"] == [(verb,)]
    assert model.args["teardown"] == [(verb,)]
    assert results == [{}]


def test_predict_hook_order():
    called: list[str] = []
    model = HookedModel(called)
    callback = HookedCallback(called)
    trainer = _trainer(callback)
    predictions = trainer.predict(model)

    batch = [
        *TRANSFER,
        "Callback.on_predict_batch_start",
        "on_predict_batch_start",
        "predict_step",
        "Callback.on_predict_batch_end",
        "on_predict_batch_end",
    ]
    expected = [
        *_setup("predict", optimizers=False),
        "predict_dataloader",
        "on_predict_model_eval",
        "Callback.on_predict_start",
        "on_predict_start",
        "Callback.on_predict_epoch_start",
        "on_predict_epoch_start",
        *batch,
        *batch,
        "Callback.on_predict_epoch_end",
        "on_predict_epoch_end",
        "Callback.on_predict_end",
        "on_predict_end",
        *_teardown(),
    ]
    assert called == expected, _diff(called, expected)
    assert callback.args["setup"] == [("predict",)]
    assert len(predictions) == N_BATCHES and predictions[0].shape == (2, 1)


def test_exception_calls_on_exception():
    """A failing ``training_step`` reaches ``Callback.on_exception`` right away, and propagates.

    (What follows differs on purpose from Lightning, which skips the ``teardown`` hooks on an error;
    trainer-core calls them, so only the first hook after the failure is pinned here.)"""
    called: list[str] = []

    class Failing(HookedModel):
        def training_step(self, batch, batch_idx):
            self._rec("training_step", batch_idx)
            raise ValueError("boom")

    model = Failing(called)
    callback = HookedCallback(called)
    with pytest.raises(ValueError, match="boom"):
        _trainer(callback, num_sanity_val_steps=0, limit_val_batches=0).fit(model)
    tail = called[called.index("training_step") :]
    assert tail[:2] == ["training_step", "Callback.on_exception"]
    assert isinstance(callback.args["on_exception"][0][0], ValueError)


@pytest.mark.timeout(120)
def test_a_batch_index_under_another_name_reaches_the_step_under_fsdp() -> None:
    """FSDP2 wraps ``training_step`` so that its signature reads one parameter short; the index still arrives."""
    from trainer_core.plugins import FSDPPlugin

    seen: list[int] = []

    class NamedIndex(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(32, 2)

        def training_step(self, batch: Any, batch_nb: int) -> torch.Tensor:
            seen.append(batch_nb)
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = quiet_trainer(max_steps=3, plugins=FSDPPlugin())
    trainer.fit(NamedIndex(), train_dataloaders=random_loader(8, 32))
    assert seen == [0, 1, 2]
