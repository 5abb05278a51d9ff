"""The Tuner's learning rate range test and batch size search, against PyTorch Lightning's and against plain runs.

One regression module is written once over a base class, so the same code runs under
``trainer_core`` and under ``pytorch_lightning``: the learning rates tried must be Lightning's
exactly (and its closed formula), the smoothed losses, the stop on divergence and the suggestion
the same. A search must leave nothing behind: the weights, the optimizer state, the counters and
the random generators after it are bitwise those before it, no temporary checkpoint remains, and
the fit that follows is bitwise the fit with the found value set by hand. The batch size search
runs against a training step that raises CUDA's out-of-memory message above 20 samples (there is
no CUDA here), and must settle on the largest size below that: 16 by doubling, 20 by bisection.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningDataModule, LightningModule, Trainer
from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.batch_size_finder import BatchSizeFinder
from trainer_core.callbacks.lr_finder import LearningRateFinder
from trainer_core.checkpoint.rng import collect_rng_states
from trainer_core.errors import MisconfigurationException
from trainer_core.tuner import Tuner, is_oom_error

QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
OOM_ABOVE = 20


def _data(n: int = 64) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def _regressor(base: type, optimizer: str = "sgd") -> type:
    """The test module over ``base`` (trainer_core's or Lightning's ``LightningModule``)."""

    class Regressor(base):
        def __init__(self, lr: float = 0.01, batch_size: int = 4) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            self.lr = lr
            self.batch_size = batch_size
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            if optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=self.lr)
            return torch.optim.SGD(self.parameters(), lr=self.lr)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_data(), batch_size=self.batch_size)

    return Regressor


Regressor = _regressor(LightningModule)
AdamRegressor = _regressor(LightningModule, "adam")


def _trainer(tmp_path: Any, **kwargs: Any) -> Trainer:
    return Trainer(**{**QUIET, "max_epochs": 10, "default_root_dir": str(tmp_path), **kwargs})


def _state(model: LightningModule, trainer: Trainer) -> dict[str, Any]:
    """Everything a search must leave as it found it."""
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": [_clone(opt.state_dict()) for opt in trainer.optimizers],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "total_batch_idx": trainer.total_batch_idx,
        "rng": collect_rng_states()["torch"],
        "callbacks": list(trainer.callbacks),
        "max_steps": trainer.max_steps,
        "limit_val_batches": trainer.limit_val_batches,
    }


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _no_temporary_checkpoints(folder: Any) -> None:
    assert [name for name in os.listdir(folder) if name.startswith((".lr_find", ".scale_batch"))] == []


# ---------------------------------------------------------------------------------------------- learning rate
@pytest.mark.parametrize(
    ("mode", "max_lr", "diverges"),
    [("exponential", 1.0, False), ("linear", 0.05, False), ("exponential", 50.0, True)],
)
def test_lr_find_matches_lightning(tmp_path: Any, mode: str, max_lr: float, diverges: bool) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.tuner import Tuner as LightningTuner

    n = 40
    model = Regressor()
    finder = Tuner(_trainer(tmp_path)).lr_find(model, num_training=n, mode=mode, max_lr=max_lr)
    theirs_model = _regressor(pl.LightningModule)()
    theirs_trainer = pl.Trainer(**QUIET, max_epochs=10, accelerator="cpu", default_root_dir=str(tmp_path))
    theirs = LightningTuner(theirs_trainer).lr_find(theirs_model, num_training=n, mode=mode, max_lr=max_lr)

    lrs = finder.results["lr"]
    assert lrs == theirs.results["lr"]
    torch.testing.assert_close(
        torch.tensor(finder.results["loss"]), torch.tensor(theirs.results["loss"]), rtol=1e-6, atol=0
    )
    assert finder.suggestion() == theirs.suggestion()
    assert model.lr == theirs_model.lr == finder.suggestion()

    # Lightning's schedule in closed form: the first two steps at min_lr, then step k at fraction (k + 1) / n.
    lo = 1e-8
    for k, lr in enumerate(lrs):
        r = (k + 1) / n if k else 0.0
        expected = lo * (max_lr / lo) ** r if mode == "exponential" else lo + r * (max_lr - lo)
        assert math.isclose(lr, expected, rel_tol=1e-12)

    losses = finder.results["loss"]
    if diverges:
        # Stopped at the first smoothed loss above 4x the best one.
        assert len(lrs) == len(losses) < n
        assert losses[-1] > 4.0 * min(losses[1:-1])
        assert all(loss <= 4.0 * min(losses[1 : i + 1]) for i, loss in enumerate(losses[2:-1], start=2))
    else:
        assert len(lrs) == len(losses) == n
    # The smoothing is Lightning's: the running mean of the raw step losses, bias-corrected by the step.
    raw = model.losses[:2]
    avg = 0.0
    for step, loss in enumerate(raw, start=1):
        avg = 0.98 * avg + 0.02 * loss
        assert losses[step - 1] == pytest.approx(avg / (1 - 0.98 ** (step + 1)), rel=1e-12)
    _no_temporary_checkpoints(tmp_path)


def test_tuner_lr_find_leaves_the_model_as_it_was_and_the_next_fit_uses_the_suggestion(tmp_path: Any) -> None:
    model = AdamRegressor()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_epochs=2)
    finder = Tuner(trainer).lr_find(model, num_training=30)
    suggestion = finder.suggestion()
    assert suggestion is not None and model.lr == suggestion
    _assert_same({k: v for k, v in model.state_dict().items()}, initial)
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert not any(isinstance(cb, LearningRateFinder) for cb in trainer.callbacks)
    _no_temporary_checkpoints(tmp_path)

    model.losses.clear()
    trainer.fit(model)
    by_hand = AdamRegressor(lr=suggestion)
    _trainer(tmp_path, max_epochs=2).fit(by_hand)
    assert model.losses == by_hand.losses
    _assert_same(model.state_dict(), by_hand.state_dict())


class _Snapshots(Callback):
    """Records the run's state right before and right after the finder's hook."""

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.states.append(_state(pl_module, trainer))


def test_learning_rate_finder_callback_restores_the_run_and_fit_equals_the_lr_set_by_hand(
    tmp_path: Any,
) -> None:
    before, after = _Snapshots(), _Snapshots()
    finder = LearningRateFinder(num_training_steps=25)
    model = AdamRegressor()
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[before, finder, after])
    trainer.fit(model)
    suggestion = finder.optimal_lr.suggestion()
    assert model.lr == suggestion
    b, a = before.states[0], after.states[0]
    assert a["optimizer"][0]["param_groups"][0]["lr"] == suggestion
    a["optimizer"][0]["param_groups"][0]["lr"] = b["optimizer"][0]["param_groups"][0]["lr"]
    _assert_same(a, b)
    assert trainer.global_step == 2 * 16
    _no_temporary_checkpoints(tmp_path)

    class ByHand(Callback):
        def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = suggestion

    by_hand = AdamRegressor()
    _trainer(tmp_path, max_epochs=2, callbacks=[ByHand()]).fit(by_hand)
    assert model.losses[-32:] == by_hand.losses
    _assert_same(model.state_dict(), by_hand.state_dict())


class _FinderAtEpoch(LearningRateFinder):
    """Lightning's fine-tuning recipe: search again at the start of a given epoch, in the middle of a run."""

    def __init__(self, epoch: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.epoch = epoch
        self.states: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        return

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            self.states.append(_state(pl_module, trainer))
            self.lr_find(trainer, pl_module)
            self.states.append(_state(pl_module, trainer))


def test_a_search_in_the_middle_of_a_run_changes_nothing(tmp_path: Any) -> None:
    finder = _FinderAtEpoch(1, num_training_steps=20, update_attr=False)
    model = AdamRegressor()
    _trainer(tmp_path, max_epochs=3, callbacks=[finder]).fit(model)
    before, after = finder.states
    assert before["global_step"] == 16 and before["optimizer"][0]["state"]  # Adam has moments by now
    _assert_same(after, before)
    assert len(finder.optimal_lr.results["lr"]) == 20

    plain = AdamRegressor()
    _trainer(tmp_path, max_epochs=3).fit(plain)
    assert model.losses[:16] + model.losses[-32:] == plain.losses
    _assert_same(model.state_dict(), plain.state_dict())


class _HparamsLR(LightningModule):
    def __init__(self, learning_rate: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=4)


def test_lr_attribute_updates(tmp_path: Any) -> None:
    model = _HparamsLR()
    finder = Tuner(_trainer(tmp_path)).lr_find(model, num_training=20)
    assert model.hparams.learning_rate == finder.suggestion() != 0.01

    model = Regressor()
    model.my_lr = 0.5
    finder = Tuner(_trainer(tmp_path)).lr_find(model, num_training=20, attr_name="my_lr")
    assert model.my_lr == finder.suggestion() and model.lr == 0.01

    model = Regressor()
    finder = Tuner(_trainer(tmp_path)).lr_find(model, num_training=20, update_attr=False)
    assert model.lr == 0.01 and len(finder.results["lr"]) == 20


def test_lr_find_errors(tmp_path: Any) -> None:
    class NoLR(Regressor):
        def __init__(self) -> None:
            super().__init__()
            del self.lr

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(MisconfigurationException, match=r"\('lr', 'learning_rate'\)"):
        Tuner(_trainer(tmp_path)).lr_find(NoLR(), num_training=5)
    with pytest.raises(MisconfigurationException, match="attr_name='rate'"):
        Tuner(_trainer(tmp_path)).lr_find(Regressor(), num_training=5, attr_name="rate")
    with pytest.raises(MisconfigurationException, match="method='fit' is the only"):
        Tuner(_trainer(tmp_path)).lr_find(Regressor(), method="validate")
    with pytest.raises(ValueError, match="already configured with a `LearningRateFinder`"):
        Tuner(_trainer(tmp_path, callbacks=[LearningRateFinder()])).lr_find(Regressor())
    with pytest.raises(MisconfigurationException, match="use one of"):
        LearningRateFinder(mode="cosine")

    class TwoOptimizers(Regressor):
        def configure_optimizers(self) -> Any:
            self.automatic_optimization = False
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters()),
            ]

    with pytest.raises(MisconfigurationException, match="returned 2 optimizers"):
        Tuner(_trainer(tmp_path)).lr_find(TwoOptimizers(), num_training=5)
    _no_temporary_checkpoints(tmp_path)


def test_lr_find_with_dataloaders_given_to_fit_and_no_early_stop(tmp_path: Any) -> None:
    hooked = Tuner(_trainer(tmp_path)).lr_find(Regressor(), num_training=30, max_lr=50.0)
    given = Tuner(_trainer(tmp_path)).lr_find(
        Regressor(), DataLoader(_data(), batch_size=4), num_training=30, max_lr=50.0
    )
    assert given.results == hooked.results
    assert len(hooked.results["lr"]) < 30  # diverged and stopped
    never = Tuner(_trainer(tmp_path)).lr_find(
        Regressor(), num_training=30, max_lr=50.0, early_stop_threshold=None
    )
    assert len(never.results["lr"]) == 30
    assert never.results["lr"][: len(hooked.results["lr"])] == hooked.results["lr"]


def test_lr_find_plot(tmp_path: Any) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    finder = Tuner(_trainer(tmp_path)).lr_find(Regressor(), num_training=30)
    fig = finder.plot(suggest=True)
    ax = fig.axes[0]
    line = ax.get_lines()[0]
    assert list(line.get_xdata()) == finder.results["lr"]
    assert list(line.get_ydata()) == finder.results["loss"]
    assert ax.get_xscale() == "log"
    marker = ax.get_lines()[1]
    assert list(marker.get_xdata()) == [finder.suggestion()]


def test_lr_find_is_skipped_under_fast_dev_run(tmp_path: Any) -> None:
    model = Regressor()
    with pytest.warns(UserWarning, match="fast_dev_run"):
        assert Tuner(_trainer(tmp_path, fast_dev_run=True)).lr_find(model) is None
    assert model.lr == 0.01


# ---------------------------------------------------------------------------------------------- batch size
class _OOMRegressor(LightningModule):
    """Runs out of "CUDA" memory above ``OOM_ABOVE`` samples a batch, and records the sizes it was given."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.batch_size = batch_size
        self.sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch)

    def _step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        self.sizes.append(len(x))
        if len(x) > OOM_ABOVE:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(256), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(256), batch_size=self.batch_size)


@pytest.mark.parametrize(
    ("mode", "found", "tried"),
    [
        ("power", 16, [2, 4, 8, 16, 32]),
        ("binsearch", 20, [2, 4, 8, 16, 32, 24, 20, 22, 21]),
    ],
)
def test_scale_batch_size_settles_below_the_simulated_oom(
    tmp_path: Any, mode: str, found: int, tried: list[int]
) -> None:
    model = _OOMRegressor()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_epochs=1, limit_val_batches=0)
    assert Tuner(trainer).scale_batch_size(model, mode=mode, margin=0.0) == found
    assert model.batch_size == found
    # Every size that fits runs its 3 steps; the first batch of a size that does not fit fails.
    expected = [s for size in tried for s in ([size] * 3 if size <= OOM_ABOVE else [size])]
    assert model.sizes == expected
    _assert_same(model.state_dict(), initial)
    assert trainer.global_step == 0
    _no_temporary_checkpoints(tmp_path)


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_scale_batch_size_matches_lightning(
    tmp_path: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.tuner import Tuner as LightningTuner

    class Theirs(pl.LightningModule):
        training_step = _OOMRegressor.training_step
        _step = _OOMRegressor._step
        configure_optimizers = _OOMRegressor.configure_optimizers
        train_dataloader = _OOMRegressor.train_dataloader

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.batch_size = 8
            self.sizes: list[int] = []

    # Lightning collects garbage before every trial, which takes seconds here and decides nothing.
    monkeypatch.setattr("pytorch_lightning.tuner.batch_size_scaling.garbage_collection_cuda", lambda: None)
    theirs = Theirs()
    theirs_trainer = pl.Trainer(**QUIET, max_epochs=1, accelerator="cpu", default_root_dir=str(tmp_path))
    expected = LightningTuner(theirs_trainer).scale_batch_size(theirs, mode=mode)
    ours = _OOMRegressor()
    assert Tuner(_trainer(tmp_path, max_epochs=1)).scale_batch_size(ours, mode=mode) == expected
    assert ours.batch_size == theirs.batch_size == expected
    if mode == "binsearch":
        assert expected == int(20 * 0.95)  # the default margin of 5% given back


def test_batch_size_finder_callback_then_the_fit_runs_at_the_size_found(tmp_path: Any) -> None:
    model = _OOMRegressor()
    finder = BatchSizeFinder(mode="binsearch", margin=0.0)
    trainer = _trainer(
        tmp_path, max_epochs=1, callbacks=[finder], num_sanity_val_steps=0, limit_val_batches=2
    )
    trainer.fit(model)
    assert finder.optimal_batch_size == model.batch_size == 20
    search = len(model.sizes) - math.ceil(256 / 20) - 2
    assert model.sizes[search:] == [20] * 12 + [16] + [20, 20]
    assert trainer.global_step == 13


class _SizeFromDataModule(LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(256), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(256), batch_size=self.batch_size)


class _SizeInHparams(_OOMRegressor):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        del self.batch_size
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(256), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(256), batch_size=self.hparams.batch_size)


def test_batch_size_attribute_on_hparams_or_datamodule(tmp_path: Any) -> None:
    model = _SizeInHparams()
    trainer = _trainer(tmp_path, max_epochs=1, limit_val_batches=0)
    assert Tuner(trainer).scale_batch_size(model, mode="power") == 16
    assert model.hparams.batch_size == 16

    model = _OOMRegressor()
    del model.batch_size
    datamodule = _SizeFromDataModule()
    trainer = _trainer(tmp_path, max_epochs=1, limit_val_batches=0)
    found = Tuner(trainer).scale_batch_size(model, datamodule=datamodule, mode="power")
    assert found == datamodule.batch_size == 16


def test_scale_batch_size_for_validate(tmp_path: Any) -> None:
    model = _OOMRegressor()
    assert Tuner(_trainer(tmp_path)).scale_batch_size(model, method="validate", mode="power") == 16
    assert model.sizes == [2, 2, 2, 4, 4, 4, 8, 8, 8, 16, 16, 16, 32]


def test_scale_batch_size_errors(tmp_path: Any) -> None:
    model = _OOMRegressor()
    with pytest.raises(MisconfigurationException, match="no field 'bs'"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, batch_arg_name="bs")
    with pytest.raises(MisconfigurationException, match="dataloaders passed directly"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, train_dataloaders=DataLoader(_data(), batch_size=4))
    with pytest.raises(MisconfigurationException, match="`dataloaders` argument should be None"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, dataloaders=DataLoader(_data(), batch_size=4))
    with pytest.raises(ValueError, match="method 'tune' is invalid"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, method="tune")
    with pytest.raises(MisconfigurationException, match="use one of"):
        BatchSizeFinder(mode="triple")

    class OtherError(_OOMRegressor):
        def _step(self, batch: Any) -> torch.Tensor:
            if len(batch[0]) > 4:
                raise RuntimeError("shapes do not match")
            return super()._step(batch)

    model = OtherError()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="shapes do not match"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model)
    _assert_same(model.state_dict(), initial)  # put back even when the search fails
    _no_temporary_checkpoints(tmp_path)


def test_is_oom_error() -> None:
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom_error(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    assert is_oom_error(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear"))
    assert not is_oom_error(RuntimeError("out of memory"))
    assert not is_oom_error(ValueError("CUDA out of memory."))
