"""Trainer arguments as Lightning 2.x defines them: ``max_time``, ``overfit_batches``, ``detect_anomaly``,
``benchmark``, ``reload_dataloaders_every_n_epochs`` and ``sync_batchnorm``.

Where it is cheap, the same tiny module runs under ``pytorch_lightning.Trainer`` too and what each run
saw (batches, hook calls, steps, flags) is compared.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from boring import QUIET, BoringModel, random_loader
from launch import JOBS, job_env
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
from trainer_core.callbacks.timer import Timer
from trainer_core.errors import MisconfigurationException

PL_QUIET: dict[str, Any] = {**QUIET, "accelerator": "cpu", "devices": 1}


def _quiet(**kwargs: Any) -> dict[str, Any]:
    return {**QUIET, **kwargs}


# ---------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_time": "1:2"}, "Trainer(max_time='1:2'): use 'DD:HH:MM:SS'"),
        ({"max_time": {"weeks": 1, "fortnights": 2}}, "Trainer(max_time={'weeks': 1, 'fortnights': 2})"),
        ({"max_time": 12}, "Trainer(max_time=12)"),
        ({"overfit_batches": 1.5}, "Trainer(overfit_batches=1.5): a float is a fraction"),
        ({"overfit_batches": -1}, "Trainer(overfit_batches=-1)"),
        ({"overfit_batches": "all"}, "Trainer(overfit_batches='all')"),
        ({"detect_anomaly": "yes"}, "Trainer(detect_anomaly='yes'): use True or False"),
        ({"benchmark": 1}, "Trainer(benchmark=1): use True, False or None"),
        ({"reload_dataloaders_every_n_epochs": -1}, "Trainer(reload_dataloaders_every_n_epochs=-1)"),
        ({"reload_dataloaders_every_n_epochs": 1.0}, "Trainer(reload_dataloaders_every_n_epochs=1.0)"),
        ({"sync_batchnorm": None}, "Trainer(sync_batchnorm=None): use True or False"),
    ],
)
def test_a_bad_value_is_refused_naming_the_argument(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(MisconfigurationException) as caught:
        Trainer(**_quiet(**kwargs))
    assert words in str(caught.value)


# ---------------------------------------------------------------------- max_time
@pytest.mark.parametrize(
    "max_time", ["01:02:03:04", {"days": 1, "hours": 2, "minutes": 3, "seconds": 4}, timedelta(1, 7384)]
)
def test_max_time_adds_lightnings_timer_and_lifts_the_epoch_default(max_time: Any) -> None:
    """One Timer checking after every step, with the duration Lightning reads; no default of 1000 epochs."""
    trainer = Trainer(**_quiet(max_time=max_time))
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    assert len(timers) == 1
    assert timers[0]._duration == 93784.0
    assert timers[0]._interval == "step"
    reference = pl.Trainer(**PL_QUIET, max_time=max_time)
    (pl_timer,) = [cb for cb in reference.callbacks if isinstance(cb, pl.callbacks.Timer)]
    assert pl_timer._duration == timers[0]._duration
    assert trainer.max_epochs == -1
    assert Trainer(**_quiet(max_time=max_time, max_epochs=3)).max_epochs == 3
    assert Trainer(**_quiet()).max_epochs == 1000


def test_max_time_sits_where_lightning_puts_its_timer() -> None:
    """After the user's callbacks, before the progress bar; checkpointing stays last."""
    names = [
        type(cb).__name__ for cb in Trainer(max_time="00:00:01:00", enable_model_summary=False).callbacks
    ]
    assert names == ["Timer", "TQDMProgressBar", "ModelCheckpoint"]


def test_a_timer_among_the_callbacks_wins_over_max_time() -> None:
    """Lightning's rule: the user's own Timer is kept and ``max_time`` ignored; it also lifts the epoch default."""
    mine = Timer(duration="00:00:00:07", interval="epoch")
    trainer = Trainer(**_quiet(max_time="00:01:00:00", callbacks=[mine]))
    assert [cb for cb in trainer.callbacks if isinstance(cb, Timer)] == [mine]
    assert trainer.max_epochs == -1


class _Clock:
    """``time.monotonic`` that moves one second per training batch, so a run stops at an exact step."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ticking(base: type) -> type:
    class Ticking(base):  # type: ignore[misc, valid-type]
        def __init__(self, clock: _Clock) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.clock = clock

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.clock.now += 1.0
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Ticking


def test_max_time_stops_at_the_same_step_as_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five "seconds" at one a batch: both trainers stop after the fifth step, in the middle of the second epoch."""
    import pytorch_lightning.callbacks.timer as pl_timer

    import trainer_core.callbacks.timer as our_timer

    steps = {}
    for name, module_base, trainer_class, timer_module, extra in (
        ("ours", LightningModule, Trainer, our_timer, QUIET),
        ("lightning", pl.LightningModule, pl.Trainer, pl_timer, PL_QUIET),
    ):
        clock = _Clock()
        monkeypatch.setattr(timer_module.time, "monotonic", clock)
        trainer = trainer_class(**extra, max_time={"seconds": 5}, num_sanity_val_steps=0)
        trainer.fit(_ticking(module_base)(clock), random_loader(6, 4, batch_size=2))
        steps[name] = (trainer.global_step, trainer.current_epoch)
        monkeypatch.undo()
    assert steps["ours"] == steps["lightning"] == (5, 2)


# ---------------------------------------------------------------------- overfit_batches
def _indexed(n: int) -> TensorDataset:
    """Sample ``i`` is the number ``i``: a batch says which samples it holds."""
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))


def _recording(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(1, 1)
            self.seen: list[tuple[str, int, list[int]]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append(("train", self.current_epoch, batch[0].squeeze(1).int().tolist()))
            return self.layer(batch[0]).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            kind = "sanity" if self.trainer.sanity_checking else "val"
            self.seen.append((kind, self.current_epoch, batch[0].squeeze(1).int().tolist()))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recording


@pytest.mark.parametrize("overfit_batches", [3, 0.25])
def test_overfit_batches_sees_the_same_first_batches_as_lightning(overfit_batches: Any) -> None:
    """The first batches of each loader, in order, every epoch (shuffling turned off with a warning), as Lightning."""
    seen = {}
    for name, module_base, trainer_class, extra in (
        ("ours", LightningModule, Trainer, QUIET),
        ("lightning", pl.LightningModule, pl.Trainer, PL_QUIET),
    ):
        torch.manual_seed(0)
        model = _recording(module_base)()
        train = DataLoader(_indexed(16), batch_size=2, shuffle=True)
        val = DataLoader(_indexed(16), batch_size=2, shuffle=True)
        trainer = trainer_class(
            **extra, overfit_batches=overfit_batches, max_epochs=2, limit_train_batches=1, limit_val_batches=5
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, train, val)
        shuffle_warnings = [w for w in caught if "overfit" in str(w.message) and "shuffl" in str(w.message)]
        assert len(shuffle_warnings) == 2, f"{name}: {[str(w.message) for w in caught]}"
        seen[name] = model.seen
    assert seen["ours"] == seen["lightning"]
    first = [[0, 1], [2, 3], [4, 5]] if overfit_batches == 3 else [[0, 1], [2, 3]]
    for epoch in (0, 1):
        assert [b for kind, e, b in seen["ours"] if kind == "train" and e == epoch] == first
        assert [b for kind, e, b in seen["ours"] if kind == "val" and e == epoch] == first
    assert [b for kind, _, b in seen["ours"] if kind == "sanity"] == first[:2]


def test_overfit_batches_leaves_a_loader_in_order_and_validate_alone() -> None:
    """No warning for loaders already in order; ``trainer.validate`` keeps its own limits and order."""
    model = _recording(LightningModule)()
    trainer = Trainer(**_quiet(overfit_batches=2, max_epochs=1, num_sanity_val_steps=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(model, DataLoader(_indexed(8), batch_size=2), DataLoader(_indexed(8), batch_size=2))
    assert trainer.num_training_batches == 2
    assert trainer.limit_train_batches == trainer.limit_val_batches == 2
    model.seen.clear()
    trainer.limit_val_batches = 1.0
    trainer.validate(model, DataLoader(_indexed(8), batch_size=2))
    assert [b for _, _, b in model.seen] == [[0, 1], [2, 3], [4, 5], [6, 7]]


# ---------------------------------------------------------------------- detect_anomaly
class _NanGradient(LightningModule):
    """A backward that makes NaN: sqrt's gradient at 0 is infinite, times the 0 that made the 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.anomaly_seen: dict[str, bool] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.anomaly_seen["train"] = torch.is_anomaly_enabled()
        return torch.sqrt(self.weight * 0.0).sum() + batch[0].sum() * 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.anomaly_seen["sanity" if self.trainer.sanity_checking else "val"] = torch.is_anomaly_enabled()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_detect_anomaly_names_the_backward_that_made_nan_and_is_off_afterwards() -> None:
    loader = random_loader(4, 2, batch_size=2)
    model = _NanGradient()
    trainer = Trainer(**_quiet(detect_anomaly=True, max_epochs=1))
    with pytest.raises(RuntimeError, match="Function 'MulBackward0' returned nan values in its 0th output"):
        trainer.fit(model, loader, random_loader(2, 2, batch_size=2))
    assert model.anomaly_seen == {"sanity": False, "train": True}
    assert not torch.is_anomaly_enabled()
    # Without it the NaN goes into the weights silently, as in Lightning.
    quiet = _NanGradient()
    Trainer(**_quiet(max_epochs=1, num_sanity_val_steps=0)).fit(quiet, loader)
    assert torch.isnan(quiet.weight).all()


def test_detect_anomaly_puts_back_the_users_own_setting() -> None:
    """A session with anomaly detection on keeps it after a fit; ``detect_anomaly=False`` leaves it alone."""
    model = BoringModel()
    previous = torch.is_anomaly_enabled()
    torch.autograd.set_detect_anomaly(True)
    try:
        Trainer(**_quiet(max_epochs=1, detect_anomaly=True)).fit(model, random_loader(4, 4, batch_size=2))
        assert torch.is_anomaly_enabled()
        Trainer(**_quiet(max_epochs=1)).fit(model, random_loader(4, 4, batch_size=2))
        assert torch.is_anomaly_enabled()
    finally:
        torch.autograd.set_detect_anomaly(previous)


# ---------------------------------------------------------------------- benchmark
@pytest.fixture
def torch_flags() -> Any:
    benchmark = torch.backends.cudnn.benchmark
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.backends.cudnn.benchmark = benchmark
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("session", [False, True])
@pytest.mark.parametrize("benchmark", [None, False, True])
@pytest.mark.parametrize("deterministic", [None, True])
def test_benchmark_sets_cudnn_as_lightning_does(
    torch_flags: Any, session: bool, benchmark: Any, deterministic: Any
) -> None:
    """``None`` keeps the session's value unless ``deterministic=True`` (then off); a bool sets it."""
    results = []
    for trainer_class, extra in ((Trainer, QUIET), (pl.Trainer, PL_QUIET)):
        torch.backends.cudnn.benchmark = session
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer_class(**extra, benchmark=benchmark, deterministic=deterministic)
        results.append(torch.backends.cudnn.benchmark)
    assert results[0] == results[1]
    expected = (False if deterministic else session) if benchmark is None else benchmark
    assert results[0] is expected


# ---------------------------------------------------------------------- reload_dataloaders_every_n_epochs
def _loader_hooks(base: type) -> type:
    class LoaderHooks(base):  # type: ignore[misc, valid-type]
        """Records the epoch of every ``*_dataloader`` call; the data depend on the epoch the loader was made in."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(1, 1)
            self.calls: list[tuple[str, int]] = []
            self.batches: list[tuple[str, int, float]] = []

        def train_dataloader(self) -> DataLoader:
            self.calls.append(("train", self.trainer.current_epoch))
            return DataLoader(_indexed(4), batch_size=2)

        def val_dataloader(self) -> DataLoader:
            self.calls.append(("val", self.trainer.current_epoch))
            return DataLoader(_indexed(2), batch_size=2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return LoaderHooks


RELOAD_CASES = [
    {"reload_dataloaders_every_n_epochs": 1},
    {"reload_dataloaders_every_n_epochs": 2, "num_sanity_val_steps": 0},
    {"reload_dataloaders_every_n_epochs": 2, "check_val_every_n_epoch": 2},
    {"reload_dataloaders_every_n_epochs": 3, "check_val_every_n_epoch": 2, "val_check_interval": 0.5},
    {"reload_dataloaders_every_n_epochs": 2, "check_val_every_n_epoch": None, "val_check_interval": 3},
    {"reload_dataloaders_every_n_epochs": 0},
]


@pytest.mark.parametrize("case", RELOAD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_reload_dataloaders_calls_the_hooks_at_the_epochs_lightning_does(case: dict[str, Any]) -> None:
    calls = {}
    for name, module_base, trainer_class, extra in (
        ("ours", LightningModule, Trainer, QUIET),
        ("lightning", pl.LightningModule, pl.Trainer, PL_QUIET),
    ):
        model = _loader_hooks(module_base)()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer_class(**extra, max_epochs=6, **case).fit(model)
        calls[name] = model.calls
    assert calls["ours"] == calls["lightning"]


def _data_module(base: type) -> Any:
    class Data(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def train_dataloader(self) -> DataLoader:
            self.calls.append(("train", self.trainer.current_epoch))
            return DataLoader(_indexed(4), batch_size=2)

        def val_dataloader(self) -> DataLoader:
            self.calls.append(("val", self.trainer.current_epoch))
            return DataLoader(_indexed(2), batch_size=2)

    return Data()


def test_reload_dataloaders_from_a_datamodule() -> None:
    """The data module's hooks are called again, at the same epochs as Lightning calls them."""
    from trainer_core.datamodule import LightningDataModule

    calls = {}
    for name, dm_base, module_base, trainer_class, extra in (
        ("ours", LightningDataModule, LightningModule, Trainer, QUIET),
        ("lightning", pl.LightningDataModule, pl.LightningModule, pl.Trainer, PL_QUIET),
    ):
        data = _data_module(dm_base)
        model = _loader_hooks(module_base)()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer_class(**extra, max_epochs=5, reload_dataloaders_every_n_epochs=2).fit(
                model, datamodule=data
            )
        assert model.calls == []
        calls[name] = data.calls
    # The sanity check's validation loader, the training loader, then both again every second epoch.
    expected = [("val", 0), ("train", 0), ("train", 2), ("val", 2), ("train", 4), ("val", 4)]
    assert calls["ours"] == calls["lightning"] == expected


class _EpochData(LightningModule):
    """A shuffled loader whose data depend on the epoch it is made in: a resume must make it when the run did."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        self.train_calls: list[int] = []

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch
        self.train_calls.append(epoch)
        gen = torch.Generator().manual_seed(epoch)
        x = torch.randn(12, 2, generator=gen)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) + epoch), batch_size=3, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _epoch_fit(tmp_path: Path, max_epochs: int, ckpt_path: Any = None) -> tuple[_EpochData, Trainer]:
    torch.manual_seed(0)
    model = _EpochData()
    trainer = Trainer(
        **{**QUIET, "enable_checkpointing": True},
        max_epochs=max_epochs,
        reload_dataloaders_every_n_epochs=2,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def test_a_resumed_run_reloads_where_the_saved_run_did(tmp_path: Path) -> None:
    """Saved after epoch 1, the resumed run makes epoch 2's loader and ends with the same weights, bit for bit.

    Saved after epoch 2, it reloads at epoch 4 as the run that went on did (Lightning would count from
    the resume and reload at 5). Its first loader is made at epoch 3, where the saved run still used
    epoch 2's: data made from the epoch number differ there, which is why the weights are not compared.
    """
    full, _ = _epoch_fit(tmp_path, max_epochs=6)
    assert full.train_calls == [0, 2, 4]
    resumed, trainer = _epoch_fit(tmp_path / "r1", max_epochs=6, ckpt_path=tmp_path / "epoch=1.ckpt")
    assert resumed.train_calls == [2, 4]
    assert trainer.progress.train_loader_epoch == 4
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    later, _ = _epoch_fit(tmp_path / "r2", max_epochs=6, ckpt_path=tmp_path / "epoch=2.ckpt")
    assert later.train_calls == [3, 4]


# ---------------------------------------------------------------------- sync_batchnorm
class _BatchNormNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("plugin", ["single_device", "ddp"])
def test_sync_batchnorm_on_one_process_changes_nothing(
    plugin: str, no_process_group_left_behind: None
) -> None:
    """One process (a single-device plugin, or DDP at world size 1): the same layers and the same weights."""
    states = []
    for sync in (False, True):
        torch.manual_seed(0)
        model = _BatchNormNet()
        trainer = Trainer(**_quiet(plugins=plugin, max_epochs=2, sync_batchnorm=sync, accelerator="cpu"))
        trainer.fit(model, random_loader(8, 3, batch_size=4))
        assert type(model.net[1]) is nn.BatchNorm1d
        states.append(model.state_dict())
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name


@pytest.mark.timeout(300)
def test_sync_batchnorm_on_two_ranks_trains_what_one_process_does_on_the_whole_batch(tmp_path: Path) -> None:
    """2 gloo ranks of 4 samples: with sync_batchnorm the running statistics and weights are one process's on 8.

    Without it each rank normalises with its own 4 samples' statistics, and the numbers differ.
    """
    sys.path.insert(0, str(JOBS))
    try:
        from sync_batchnorm_job import BatchNormNet, data
    finally:
        sys.path.remove(str(JOBS))
    from trainer_core import seed_everything

    seed_everything(0)
    reference = BatchNormNet()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in DataLoader(data(), batch_size=8):
        optimizer.zero_grad()
        nn.functional.mse_loss(reference.net(x), y).backward()
        optimizer.step()
    expected = reference.state_dict()

    args = [sys.executable, str(JOBS / "sync_batchnorm_job.py"), "--out", str(tmp_path)]
    proc = subprocess.run(args, cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    synced = torch.load(tmp_path / "sync.pt", weights_only=False)
    assert synced["global_step"] == 4
    assert synced["layer_during_training"] == "CPUSyncBatchNorm"
    assert synced["layer_after_fit"] == "BatchNorm1d"
    for name, tensor in expected.items():
        torch.testing.assert_close(synced["state"][name], tensor, rtol=0, atol=1e-6, msg=name)

    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert plain["layer_during_training"] == "BatchNorm1d"
    for name in ("net.1.running_mean", "net.1.running_var", "net.0.weight"):
        assert (plain["state"][name] - expected[name]).abs().max() > 1e-3, name


class _StatefulData(_EpochData):
    """The same data every epoch, from torchdata's StatefulDataLoader, shuffled: its state travels in checkpoints."""

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.train_calls.append(self.trainer.current_epoch)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(12, 2, generator=gen)
        return StatefulDataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=3, shuffle=True)


@pytest.mark.parametrize(("every", "saved_after", "calls"), [(1, 1, [2, 3, 4]), (2, 2, [3, 4])])
def test_a_stateful_loader_made_anew_resumes_exactly(
    tmp_path: Path, every: int, saved_after: int, calls: list[int]
) -> None:
    """A reload epoch starts from the new loader's own state, not the saved one of the loader before it;
    between reloads the saved state carries on, as without reloading."""
    pytest.importorskip("torchdata.stateful_dataloader")

    def fit(root: Path, ckpt_path: Any = None) -> _StatefulData:
        torch.manual_seed(0)
        model = _StatefulData()
        Trainer(
            **{**QUIET, "enable_checkpointing": True},
            max_epochs=5,
            reload_dataloaders_every_n_epochs=every,
            callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)],
        ).fit(model, ckpt_path=ckpt_path)
        return model

    full = fit(tmp_path)
    resumed = fit(tmp_path / "resumed", ckpt_path=tmp_path / f"epoch={saved_after}.ckpt")
    assert resumed.train_calls == calls
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
