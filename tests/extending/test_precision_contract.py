"""A user's precision, written as the extension contract says (docs/extending.md): a ``Precision`` subclass.

It scales the loss by a constant before the backward and unscales the gradients in its ``optimizer_step``;
the weights it trains are compared, bit for bit, with the same arithmetic written as a plain PyTorch loop.
Its checkpoint records its name and its state and resumes exactly. The built-in precisions, passed as
objects, train exactly what their names train. And the natural mistakes are refused where the Trainer is
built, naming what to change.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pytest
import torch
from boring import QUIET, random_data
from torch import nn
from torch.nn import functional as F
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Precision, Trainer
from trainer_core.callbacks import ModelCheckpoint
from trainer_core.errors import MisconfigurationException
from trainer_core.precision import DoublePrecision, HalfPrecision, MixedPrecision

STEPS = 6
LR = 0.05
SCALE = 3.0  # not a power of two: unscaling rounds, so a missed or repeated scaling shows in the weights


class ScaledLoss(Precision):
    """Float32, the loss times ``SCALE`` before the backward, the gradients divided by it before the step.

    It counts what the Trainer calls, and keeps the count of steps it took in the checkpoint.
    """

    name = "scaled-32"

    def __init__(self) -> None:
        super().__init__()
        self.contexts = 0
        self.conversions = 0
        self.pre_backwards = 0
        self.post_backwards = 0
        self.steps = 0

    def convert_input(self, batch: Any) -> Any:
        self.conversions += 1
        return batch

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        self.contexts += 1
        yield

    def pre_backward(self, tensor: torch.Tensor, module: nn.Module) -> torch.Tensor:
        self.pre_backwards += 1
        return tensor * SCALE

    def post_backward(self, tensor: torch.Tensor, module: nn.Module) -> torch.Tensor:
        self.post_backwards += 1
        return tensor

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Optional[Callable[[], Any]],
        after_closure: Optional[Callable[[Optimizer], None]] = None,
        skip_without_loss: bool = True,
        **kwargs: Any,
    ) -> Any:
        loss = closure() if closure is not None else None
        if loss is None and skip_without_loss:
            return None
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(SCALE)
        if after_closure is not None:
            after_closure(optimizer)
        optimizer.step(**kwargs)
        self.steps += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]


class Forgetful(Precision):
    """Scales the loss by a factor given to ``__init__``, which does not call ``super().__init__()``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def pre_backward(self, tensor: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return tensor * self.factor

    def backward(
        self, tensor: torch.Tensor, model: nn.Module, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        super().backward(tensor, model, optimizer, *args, **kwargs)
        for param in model.parameters():
            param.grad.div_(self.factor)


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 16)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _model() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def _loader() -> DataLoader:
    return DataLoader(random_data(STEPS * 4, 4), batch_size=4)


def _fit(precision: Union[str, int, Precision, None], plugins: Optional[list] = None, **kwargs: Any) -> tuple:
    model = _model()
    ckpt_path = kwargs.pop("ckpt_path", None)
    args = {**QUIET, "max_steps": STEPS, "num_sanity_val_steps": 0, **kwargs}
    if precision is not None:
        args["precision"] = precision
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(**args, plugins=plugins)
        trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return model, trainer


def _scaled_by_hand(factor: float, steps: int = STEPS) -> nn.Module:
    """What ``ScaledLoss`` and ``Forgetful`` do, as a plain PyTorch loop."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _, (x, y) in zip(range(steps), _loader()):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y.float())
        (loss * factor).backward()
        for param in model.parameters():
            param.grad.div_(factor)
        opt.step()
    return model


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


# ---------------------------------------------------------------------- a user's precision trains
@pytest.mark.parametrize("where", ["precision", "plugins"])
def test_a_user_precision_trains_as_its_plain_pytorch_loop(where: str) -> None:
    """``Trainer(precision=ScaledLoss())`` or ``plugins=[ScaledLoss()]``: every member runs once a step."""
    precision = ScaledLoss()
    if where == "precision":
        model, trainer = _fit(precision)
    else:
        model, trainer = _fit(None, plugins=[precision])
    assert trainer.precision_plugin is precision and trainer.precision == "scaled-32"
    counts = (precision.conversions, precision.contexts, precision.pre_backwards, precision.post_backwards)
    assert counts == (STEPS,) * 4
    assert precision.steps == STEPS
    _assert_same_weights(model, _scaled_by_hand(SCALE))
    # Scaling by 3 and dividing by 3 rounds: the weights are near the unscaled run's, but not its.
    plain, _ = _fit("32-true")
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_precision_that_forgets_super_init_works() -> None:
    """A subclass whose ``__init__`` does not call ``super().__init__()``: the base's defaults still hold."""
    precision = Forgetful(SCALE)
    model, trainer = _fit(precision)
    _assert_same_weights(model, _scaled_by_hand(SCALE))
    assert (trainer.precision, precision.scaler, precision.scales_loss) == ("32-true", None, False)
    assert precision.device_type == "cpu" and precision.state_dict() == {}


def test_manual_optimization_goes_through_the_user_precision() -> None:
    """``manual_backward`` and ``opt.step()`` reach the precision's ``pre_backward`` and ``optimizer_step``."""

    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    precision = ScaledLoss()
    torch.manual_seed(0)
    model = Manual()
    trainer = Trainer(**QUIET, max_steps=STEPS, precision=precision)
    trainer.fit(model, _loader())
    assert (precision.contexts, precision.pre_backwards) == (STEPS, STEPS)
    # No closure, so no loss: manual optimization steps anyway (skip_without_loss=False).
    assert precision.steps == STEPS
    _assert_same_weights(model, _scaled_by_hand(SCALE))


# ---------------------------------------------------------------------- the built-ins, as objects
@pytest.mark.parametrize(
    ("name", "instance"),
    [
        ("32-true", Precision),
        ("64-true", DoublePrecision),
        ("bf16-true", lambda: HalfPrecision("bf16-true")),
        ("16-true", lambda: HalfPrecision("16-true")),
        ("bf16-mixed", lambda: MixedPrecision("bf16-mixed")),
        (16, lambda: MixedPrecision("16-mixed")),
    ],
)
def test_a_built_in_precision_object_trains_what_its_name_trains(name: Any, instance: Any) -> None:
    by_name, named = _fit(name)
    by_object, objected = _fit(instance())
    _assert_same_weights(by_object, by_name)
    assert objected.precision == named.precision
    assert type(objected.precision_plugin) is type(named.precision_plugin)
    if named.precision == "16-mixed":
        assert objected.precision_plugin.scaler.get_scale() == named.precision_plugin.scaler.get_scale()


# ---------------------------------------------------------------------- its checkpoint
def test_a_user_precision_checkpoint_records_its_name_and_resumes(tmp_path: Path) -> None:
    whole, _ = _fit(ScaledLoss())
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _fit(ScaledLoss(), max_steps=3, callbacks=[ckpt], enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=True)
    assert saved["plugin"]["precision"] == "scaled-32"
    assert saved["precision"] == {"steps": 3}

    precision = ScaledLoss()
    resumed, _ = _fit(precision, ckpt_path=str(path))
    assert precision.steps == STEPS  # 3 loaded from the checkpoint, 3 taken
    _assert_same_weights(resumed, whole)

    # Under another precision the state it saved is not handed over, and a warning says so.
    model = _model()
    trainer = Trainer(**QUIET, max_steps=4)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(model, _loader(), ckpt_path=str(path))
    messages = [str(w.message) for w in caught]
    expected = (
        "The checkpoint was written with precision='scaled-32'; this run trains with precision='32-true': "
        "the state precision='scaled-32' saved (steps) is dropped."
    )
    assert any(m.startswith(expected) for m in messages), messages
    assert trainer.global_step == 4


# ---------------------------------------------------------------------- mistakes, refused where they are made
def test_a_precision_class_instead_of_an_instance_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException) as err:
        Trainer(precision=ScaledLoss, default_root_dir=tmp_path)
    assert str(err.value) == "Trainer(precision=ScaledLoss): pass an instance, ScaledLoss()."
    with pytest.raises(MisconfigurationException) as err:
        Trainer(precision=MixedPrecision, default_root_dir=tmp_path)
    assert "MixedPrecision()" in str(err.value)
    assert not list(tmp_path.iterdir())


def test_anything_else_is_refused_naming_the_precisions(tmp_path: Path) -> None:
    for wrong in ("fp8", 8, True, torch.float16):
        with pytest.raises(MisconfigurationException) as err:
            Trainer(precision=wrong, default_root_dir=tmp_path)
        message = str(err.value)
        assert message.startswith(f"Trainer(precision={wrong!r}) is not supported")
        assert "'bf16-mixed'" in message and "a Precision instance" in message
    for make, message in [
        (
            lambda: HalfPrecision("16-mixed"),
            "HalfPrecision(precision='16-mixed'): use '16-true' or 'bf16-true'.",
        ),
        (lambda: MixedPrecision("bf16"), "MixedPrecision(precision='bf16'): use '16-mixed' or 'bf16-mixed'."),
    ]:
        with pytest.raises(MisconfigurationException) as err:
            make()
        assert str(err.value) == message
    assert not list(tmp_path.iterdir())


def test_the_pipeline_refuses_a_precision_whose_backward_it_would_skip(
    tmp_path: Path, no_process_group_left_behind: None
) -> None:
    """The pipeline runs each micro-batch's backward itself: refused before its processes start."""
    from pipeline_split_job import SplitNet

    from trainer_core.plugins import PipelinePlugin

    # A group an earlier test of this pytest worker left behind is not this test's doing.
    group_before = torch.distributed.is_initialized()
    trainer = Trainer(
        **QUIET,
        plugins=[PipelinePlugin(split_points=["layers.2"])],
        devices=2,
        max_steps=1,
        precision=ScaledLoss(),
        default_root_dir=tmp_path,
    )
    with pytest.raises(MisconfigurationException) as err:
        trainer.fit(SplitNet(), DataLoader(random_data(16, 8), batch_size=8))
    message = str(err.value)
    assert "ScaledLoss's pre_backward, backward and post_backward would never run" in message
    assert "ScaledLoss.optimizer_step" in message
    assert not list(tmp_path.iterdir())
    assert torch.distributed.is_initialized() == group_before
