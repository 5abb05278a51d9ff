"""Each precision in one process: what it trains, compared with a hand-written PyTorch loop and with
Lightning itself; loss scaling (skipped steps, unscaled hooks and clipping, the scaler's state in the
checkpoint); a checkpoint resumed under another precision; and what is refused before training.

The same precisions under the distributed plugins: tests/plugins/test_precision_distributed.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from boring import QUIET, random_data
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import trainer_core
from trainer_core import Trainer
from trainer_core.callbacks import Callback, ModelCheckpoint
from trainer_core.errors import MisconfigurationException
from trainer_core.precision import HalfPrecision, MixedPrecision, precision_from

STEPS = 6
INF_STEP = 2
LR = 0.05


def _module(framework: Any = trainer_core, inf_step: Optional[int] = None) -> Any:
    class Regressor(framework.LightningModule):
        """A tiny MLP; at ``inf_step`` one parameter's gradient becomes inf (its loss term is inf * bias)."""

        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(4, 16)
            self.l2 = nn.Linear(16, 1)
            self.seen: list[torch.dtype] = []
            self.made: list[torch.dtype] = []
            self.grads_seen: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.made.append(torch.ones(1).dtype)  # what the forward creates takes the default dtype
            return self.l2(torch.tanh(self.l1(x)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.seen.append(x.dtype)
            loss = F.mse_loss(self(x).float(), y.float())
            if self.trainer.global_step == inf_step:
                loss = loss + self.l2.bias.sum() * float("inf")
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.seen.append(batch[0].dtype)
            # In the batch's dtype: a bfloat16 loss under bf16-true (its epoch mean is Lightning's, in float32).
            self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads_seen.append(_flat_grads(self))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    torch.manual_seed(0)
    return Regressor()


def _flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten() for p in module.parameters()])


def _loader() -> DataLoader:
    return DataLoader(random_data(STEPS * 4, 4), batch_size=4)


def _fit(precision: str, framework: Any = trainer_core, **kwargs: Any) -> tuple[Any, Any]:
    model = _module(framework, kwargs.pop("inf_step", None))
    ckpt_path = kwargs.pop("ckpt_path", None)
    args = {**QUIET, "max_steps": STEPS, "precision": precision, "num_sanity_val_steps": 0, **kwargs}
    if framework is not trainer_core:
        args.update(accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = framework.Trainer(**args)
        val = _loader() if "limit_val_batches" in kwargs else None
        trainer.fit(model, _loader(), val, ckpt_path=ckpt_path)
    return model, trainer


def _hand_loop(
    clip: Optional[float] = None, inf_step: Optional[int] = None, skip: Optional[int] = None
) -> tuple[nn.Module, list[torch.Tensor], list[float]]:
    """``16-mixed`` written by hand: autocast to float16, torch's GradScaler, unscale, clip, step."""
    model = _module()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    grads, scales = [], []
    for step, (x, y) in enumerate(_loader()):
        opt.zero_grad()
        if step == skip:
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y.float())
            if step == inf_step:
                loss = loss + model.l2.bias.sum() * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads.append(_flat_grads(model))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, grads, scales


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


# ---------------------------------------------------------------------- what each precision trains in
@pytest.mark.parametrize(
    ("precision", "weights", "compute"),
    [
        ("bf16-mixed", torch.float32, torch.float32),
        ("16-mixed", torch.float32, torch.float32),
        ("bf16-true", torch.bfloat16, torch.bfloat16),
        ("16-true", torch.float16, torch.float16),
        ("64-true", torch.float64, torch.float64),
    ],
)
def test_each_precision_trains_in_its_dtypes(
    precision: str, weights: torch.dtype, compute: torch.dtype
) -> None:
    model, trainer = _fit(precision, limit_val_batches=2, val_check_interval=STEPS)
    assert trainer.precision == precision
    assert {p.dtype for p in model.parameters()} == {weights}
    # *-true: float inputs (training and validation) and tensors made in forward take the weights' dtype.
    assert set(model.seen) == {compute}
    assert set(model.made) == {compute}
    assert torch.isfinite(torch.tensor(float(trainer.callback_metrics["val_loss"])))


def test_true_precisions_leave_integer_inputs_alone() -> None:
    precision = HalfPrecision("bf16-true")
    batch = {
        "x": torch.ones(2, dtype=torch.float32),
        "ids": torch.arange(2),
        "mask": torch.ones(2, dtype=torch.bool),
    }
    converted = precision.convert_input(batch)
    assert converted["x"].dtype == torch.bfloat16
    assert converted["ids"].dtype == torch.int64 and converted["mask"].dtype == torch.bool
    assert MixedPrecision("bf16-mixed").convert_input(batch) is batch


def test_the_loop_asks_each_precision_once_what_it_does_per_step() -> None:
    """The default does nothing per step; the built-ins keep the loop's plain backward and step unless they scale."""

    class UserMixed(MixedPrecision):
        def pre_backward(self, tensor: torch.Tensor, module: nn.Module) -> torch.Tensor:
            return tensor

    asked = {
        name: (
            p.forward_context_needed,
            p.input_conversion_needed,
            p.scales_loss or p.custom_backward,
            p.scales_loss or p.custom_optimizer_step,
        )
        for name, p in {
            "32-true": precision_from("32-true"),
            "64-true": precision_from(64),
            "bf16-true": precision_from("bf16-true"),
            "bf16-mixed": precision_from("bf16"),
            "16-mixed": precision_from(16),
            "user": UserMixed("bf16-mixed"),
        }.items()
    }
    assert asked == {
        "32-true": (False, False, False, False),
        "64-true": (True, True, False, False),
        "bf16-true": (True, True, False, False),
        "bf16-mixed": (True, False, False, False),
        "16-mixed": (True, False, True, True),
        "user": (True, False, True, False),
    }


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_trains_as_lightning_does(precision: str) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    ours, trainer = _fit(precision, limit_val_batches=3, val_check_interval=STEPS)
    theirs, their_trainer = _fit(precision, framework=pl, limit_val_batches=3, val_check_interval=STEPS)
    _assert_same_weights(ours, theirs)
    # The epoch mean of bfloat16 losses is taken in float32, as Lightning takes it.
    assert trainer.callback_metrics["val_loss"].dtype == torch.float32
    assert float(trainer.callback_metrics["val_loss"]) == float(their_trainer.callback_metrics["val_loss"])


# ---------------------------------------------------------------------- loss scaling
def test_16_mixed_matches_a_hand_written_loop_with_a_grad_scaler() -> None:
    """The inf step is skipped, the scale halves, and every other step matches torch's own recipe bit for bit."""
    model, trainer = _fit("16-mixed", inf_step=INF_STEP)
    reference, grads, scales = _hand_loop(inf_step=INF_STEP)
    _assert_same_weights(model, reference)
    # float16 also overflows by itself at the first scale (65536): those steps are skipped too, in both.
    assert trainer.strategy.precision.scaler.get_scale() == scales[-1] < 2.0**15
    # Lightning's names for it.
    assert trainer.precision_plugin.scaler is trainer.strategy.precision.scaler
    assert trainer.precision_plugin.precision == "16-mixed"
    # on_before_optimizer_step sees the gradients at their true scale (Lightning's order).
    for seen, expected in zip(model.grads_seen, grads):
        torch.testing.assert_close(seen, expected, rtol=0, atol=0, equal_nan=True)
    assert not torch.isfinite(model.grads_seen[INF_STEP]).all()


def test_16_mixed_clips_the_unscaled_gradients() -> None:
    model, _ = _fit("16-mixed", gradient_clip_val=0.05)
    reference, _, _ = _hand_loop(clip=0.05)
    _assert_same_weights(model, reference)
    unclipped, _ = _fit("16-mixed")
    assert not torch.equal(model.l1.weight, unclipped.l1.weight)


def test_a_skipped_batch_does_not_step_the_scaler() -> None:
    class Skips(type(_module())):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if batch_idx == 1 else super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Skips()
    trainer = Trainer(**QUIET, max_steps=STEPS, precision="16-mixed")
    trainer.fit(model, _loader())
    reference, _, scales = _hand_loop(skip=1)
    _assert_same_weights(model, reference)
    assert trainer.strategy.precision.scaler.get_scale() == scales[-1]


class _Scale(Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.scales.append(trainer.strategy.precision.scaler.get_scale())


def test_the_loss_scaler_resumes_exactly(tmp_path: Path) -> None:
    whole_scales = _Scale()
    whole, _ = _fit("16-mixed", inf_step=1, callbacks=[whole_scales])
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _fit("16-mixed", inf_step=1, max_steps=3, callbacks=[ckpt], enable_checkpointing=True)
    saved = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)
    assert (
        saved["precision"]["scale"] == whole_scales.scales[2] and saved["plugin"]["precision"] == "16-mixed"
    )
    resumed_scales = _Scale()
    resumed, _ = _fit(
        "16-mixed", inf_step=1, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), callbacks=[resumed_scales]
    )
    _assert_same_weights(resumed, whole)
    assert resumed_scales.scales == whole_scales.scales[3:]


# ---------------------------------------------------------------------- a checkpoint from another precision
@pytest.mark.parametrize(
    ("written", "resumed", "note"),
    [
        ("16-mixed", "bf16-mixed", "the loss scaler's state (scale 16384.0) is dropped"),
        ("32-true", "16-mixed", "the loss scaler starts fresh"),
        ("32-true", "bf16-true", "saved in float32, are converted to bfloat16 (rounded: the values change)"),
        ("bf16-true", "32-true", "saved in bfloat16, are converted to float32 (exactly)"),
    ],
)
def test_resuming_under_another_precision_says_what_changed(
    tmp_path: Path, written: str, resumed: str, note: str
) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _fit(written, max_steps=3, callbacks=[ckpt], enable_checkpointing=True)
    path = str(tmp_path / "epoch=0-step=3.ckpt")
    saved = torch.load(path, weights_only=False)["state_dict"]
    seen: dict[str, torch.Tensor] = {}

    class Grab(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            seen.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    model = _module()
    trainer = Trainer(**QUIET, max_steps=4, precision=resumed, callbacks=[Grab()])
    with pytest.warns(
        UserWarning, match=f"precision='{written}'; this run trains with precision='{resumed}'"
    ) as caught:
        trainer.fit(model, _loader(), ckpt_path=path)
    assert any(note in str(w.message) for w in caught), [str(w.message) for w in caught]
    for name, value in saved.items():
        assert torch.equal(seen[name], value.to(seen[name].dtype)), name
    if resumed == "16-mixed":
        assert trainer.strategy.precision.scaler.get_scale() == 2.0**16


# ---------------------------------------------------------------------- refused before training
def test_an_unknown_precision_names_the_valid_ones() -> None:
    with pytest.raises(MisconfigurationException, match="'16-true'"):
        Trainer(precision="fp8")


def test_lbfgs_with_loss_scaling_is_refused_before_training() -> None:
    class WithLBFGS(type(_module())):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters())

    model = WithLBFGS()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MisconfigurationException, match="LBFGS"):
        Trainer(**QUIET, max_steps=1, precision="16-mixed").fit(model, _loader())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_device_without_bfloat16_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    from trainer_core import precision as module

    monkeypatch.setattr(module, "_autocast_supported", lambda device, dtype: True)
    for name in ("bf16-mixed", "bf16-true"):
        with pytest.raises(
            MisconfigurationException, match=r"Tesla V100 does not compute in bfloat16.*16-mixed"
        ):
            precision_from(name, "cuda").check_device(torch.device("cuda", 0))
    MixedPrecision("16-mixed", "cuda").check_device(torch.device("cuda", 0))  # float16 is fine there


def test_a_device_that_cannot_autocast_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_core import precision as module

    monkeypatch.setattr(module, "_autocast_supported", lambda device, dtype: dtype is not torch.float16)
    with pytest.raises(
        MisconfigurationException, match=r"cannot autocast to torch.float16 on 'cpu'.*'bf16-mixed'"
    ):
        Trainer(precision="16-mixed")
    Trainer(precision="bf16-mixed")


def test_manual_optimization_scales_and_clips_as_torch_does() -> None:
    """``manual_backward`` scales, ``clip_gradients`` unscales first, ``opt.step()`` skips the inf step."""

    class Manual(type(_module())):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = F.mse_loss(self(x).float(), y.float())
            if batch_idx == INF_STEP:
                loss = loss + self.l2.bias.sum() * float("inf")
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()

    torch.manual_seed(0)
    model = Manual()
    trainer = Trainer(**QUIET, max_steps=STEPS, precision="16-mixed")
    trainer.fit(model, _loader())
    reference, _, scales = _hand_loop(clip=0.05, inf_step=INF_STEP)
    _assert_same_weights(model, reference)
    assert trainer.strategy.precision.scaler.get_scale() == scales[-1]
