"""``CombinedLoader`` and several loaders per stage, each compared with Lightning's run of the same program.

The loader alone (batches, lengths, structure in every mode), ``fit`` with a dict of training
loaders and with a ``CombinedLoader`` in each mode (losses, weights, steps), validation and test
through a ``CombinedLoader`` (results and their ``dataloader_idx`` names), a mid-epoch resume with
two torchdata ``StatefulDataLoader``\\ s (against our own run that never stopped), and
``predict_loop.current_batch_indices`` as a prediction writer reads it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import trainer_core as tc
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import CombinedLoader

pl = pytest.importorskip("pytorch_lightning")
from pytorch_lightning.utilities.combined_loader import CombinedLoader as LightningCombinedLoader  # noqa: E402

MODES = ["min_size", "max_size_cycle", "max_size", "sequential"]
QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
}


def _trainer(framework: Any, tmp_path: Path, **kwargs: Any) -> Any:
    kwargs = {**QUIET, "max_epochs": 2, "accelerator": "cpu", "devices": 1, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return framework.Trainer(default_root_dir=tmp_path / framework.__name__, **kwargs)


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _two_loaders(shuffle: bool = True, cls: type = DataLoader) -> dict[str, Any]:
    """Two loaders of different lengths (3 and 5 batches)."""
    return {
        "a": cls(_data(12, 1), batch_size=4, shuffle=shuffle),
        "b": cls(_data(20, 2), batch_size=4, shuffle=shuffle),
    }


# ---------------------------------------------------------------------- the loader alone
def _nested() -> dict[str, Any]:
    return {
        "a": DataLoader(range(6), batch_size=4),
        "b": [DataLoader(range(15), batch_size=5), (DataLoader(range(3), batch_size=1),)],
    }


def _unsized() -> dict[str, Any]:
    return {"sized": DataLoader(range(4), batch_size=2), "unsized": iter(range(3))}


def _drain(cls: type, iterables: Any, mode: str, limits: Optional[list[int]]) -> tuple[Any, list[Any]]:
    combined = cls(iterables, mode)
    if limits is not None:
        combined.limits = limits
    iter(combined)
    try:
        length: Any = len(combined)
    except TypeError:
        length = "TypeError"
    return length, [(repr(batch), batch_idx, dataloader_idx) for batch, batch_idx, dataloader_idx in combined]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("limits", [None, [1, 2, 2], [5, 1, 10]], ids=["no-limits", "limits", "large-limits"])
def test_batches_and_length_equal_lightnings(mode: str, limits: Optional[list[int]]) -> None:
    """Each batch (its structure, ``None`` for an ended loader), ``batch_idx``, ``dataloader_idx`` and ``len()``."""
    ours = _drain(CombinedLoader, _nested(), mode, limits)
    assert ours == _quietly(_drain, LightningCombinedLoader, _nested(), mode, limits)
    if limits is None:  # an iterable without a length: len() raises TypeError in every mode but min_size
        assert _drain(CombinedLoader, _unsized(), mode, None) == _quietly(
            _drain, LightningCombinedLoader, _unsized(), mode, None
        )


def test_properties_equal_lightnings() -> None:
    ours, theirs = CombinedLoader(_nested()), _quietly(LightningCombinedLoader, _nested())
    assert repr(ours._spec) == repr(theirs._spec)
    assert [type(dl) for dl in ours.flattened] == [type(dl) for dl in theirs.flattened]
    assert len(ours.flattened) == 3
    samplers = ours.sampler
    assert set(samplers) == {"a", "b"} and isinstance(samplers["b"][1], tuple)
    assert samplers["b"][1][0] is ours.flattened[2].sampler
    assert ours.batch_sampler["a"] is ours.flattened[0].batch_sampler
    replaced = [DataLoader(range(2)), DataLoader(range(3)), DataLoader(range(4))]
    ours.flattened = replaced
    assert ours.iterables["b"][1][0] is replaced[2] and ours.flattened == replaced
    with pytest.raises(ValueError, match="2 iterables given for 3"):
        ours.flattened = replaced[:2]
    with pytest.raises(MisconfigurationException, match="'sequential'"):
        CombinedLoader(replaced, "longest")
    assert CombinedLoader([1, 2, 3]).flattened == [[1, 2, 3]]  # a list of numbers is one iterable
    assert tc.utilities.combined_loader.CombinedLoader is CombinedLoader


# ---------------------------------------------------------------------- fit
def _regression(framework: Any) -> Any:
    class TwoSources(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.losses: list[float] = []
            self.reloads = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            parts = (
                batch.values() if isinstance(batch, dict) else [batch] if torch.is_tensor(batch[0]) else batch
            )
            loss = sum(nn.functional.mse_loss(self.net(x), y) for x, y in (p for p in parts if p is not None))
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            if isinstance(batch, dict):
                x, y = batch["a"] if batch["a"] is not None else batch["b"]
            else:
                x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        test_step = validation_step

        def train_dataloader(self) -> Any:
            self.reloads += 1
            return _two_loaders()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return TwoSources


def _fit(framework: Any, tmp_path: Path, data: Any, **kwargs: Any) -> dict[str, Any]:
    framework.seed_everything(3, verbose=False) if framework is pl else framework.seed_everything(3)
    module = _regression(framework)()
    trainer = _trainer(framework, tmp_path, **kwargs)
    _quietly(trainer.fit, module, data() if data is not None else None)
    shown = trainer.train_dataloader
    return {
        "losses": module.losses,
        "global_step": trainer.global_step,
        "weights": [p.detach().clone() for p in module.parameters()],
        "num_training_batches": trainer.num_training_batches,
        "shown": sorted(shown) if isinstance(shown, dict) else type(shown).__name__,
        "reloads": module.reloads,
    }


def _combined(framework: Any, mode: str) -> Any:
    cls = CombinedLoader if framework is tc else LightningCombinedLoader
    return lambda: cls(_two_loaders(), mode)


@pytest.mark.parametrize(
    "given, kwargs",
    [
        pytest.param("dict", {}, id="dict"),
        pytest.param("dict", {"limit_train_batches": 0.5}, id="dict-fraction"),
        pytest.param("module", {"reload_dataloaders_every_n_epochs": 1, "max_epochs": 3}, id="dict-reloaded"),
        pytest.param("dict", {"overfit_batches": 2}, id="dict-overfit"),
        pytest.param("list", {"limit_train_batches": 4}, id="list"),
        pytest.param("min_size", {}, id="min_size"),
        pytest.param("min_size", {"limit_train_batches": 0.5}, id="min_size-fraction"),
        pytest.param("max_size_cycle", {"limit_train_batches": 2}, id="max_size_cycle-limit"),
        pytest.param("max_size", {}, id="max_size"),
    ],
)
def test_fit_with_several_training_loaders_equals_lightning(tmp_path: Path, given: str, kwargs: dict) -> None:
    runs = []
    for framework in (pl, tc):
        if given == "dict":
            data = _two_loaders
        elif given == "list":
            data = lambda: list(_two_loaders().values())  # noqa: E731
        elif given == "module":
            data = None
        else:
            data = _combined(framework, given)
        runs.append(_fit(framework, tmp_path, data, **kwargs))
    theirs, ours = runs
    assert ours["losses"] == theirs["losses"]
    assert len(ours["losses"]) >= 2
    for key in ("global_step", "num_training_batches", "shown", "reloads"):
        assert ours[key] == theirs[key], key
    for a, b in zip(ours["weights"], theirs["weights"]):
        assert torch.equal(a, b)


def test_fit_refuses_a_sequential_training_loader(tmp_path: Path) -> None:
    trainer = _trainer(tc, tmp_path)
    with pytest.raises(MisconfigurationException, match='mode="sequential"'):
        trainer.fit(_regression(tc)(), CombinedLoader(_two_loaders(), "sequential"))


def test_each_training_loader_goes_through_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The distributed sampler is chosen per loader (the plugin's ``process_dataloader`` sees each one)."""
    trainer = _trainer(tc, tmp_path, max_steps=1)
    seen: list[Any] = []
    original = trainer.plugin.process_dataloader

    def process(loader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        seen.append((kind, loader.dataset))
        return original(loader, kind, use_distributed_sampler)

    monkeypatch.setattr(trainer.plugin, "process_dataloader", process)
    loaders = _two_loaders()
    trainer.fit(_regression(tc)(), loaders)
    assert seen == [("train", loaders["a"].dataset), ("train", loaders["b"].dataset)]


# ---------------------------------------------------------------------- validation and test
def _evaluate(framework: Any, tmp_path: Path, mode: str, stage: str) -> tuple[Any, Any]:
    framework.seed_everything(4, verbose=False) if framework is pl else framework.seed_everything(4)
    module = _regression(framework)()
    cls = CombinedLoader if framework is tc else LightningCombinedLoader
    loaders = cls(_two_loaders(shuffle=False), mode)
    trainer = _trainer(framework, tmp_path, limit_val_batches=4)
    if stage == "fit":
        _quietly(trainer.fit, module, _two_loaders(), loaders)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}, module.losses
    results = _quietly(getattr(trainer, stage), module, loaders, verbose=False)
    return results, sorted(trainer.val_dataloaders if stage == "validate" else trainer.test_dataloaders)


@pytest.mark.parametrize(
    "stage, mode",
    [
        ("validate", "sequential"),
        ("test", "max_size"),
        ("fit", "sequential"),
        ("fit", "min_size"),
        ("test", "max_size_cycle"),
    ],
)
def test_evaluation_through_a_combined_loader_equals_lightning(tmp_path: Path, mode: str, stage: str) -> None:
    """Sequential: one result per loader (``/dataloader_idx_N`` names); other modes: one combined result."""
    ours = _evaluate(tc, tmp_path, mode, stage)
    theirs = _evaluate(pl, tmp_path, mode, stage)
    assert ours == theirs
    if stage != "fit":
        assert len(ours[0]) == (2 if mode == "sequential" else 1)


# ---------------------------------------------------------------------- resume
class SaveAt(tc.Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(
    "mode, step, stateful",
    [
        pytest.param("max_size_cycle", 3, True, id="max_size_cycle-shorter-at-its-end"),
        pytest.param("max_size_cycle", 7, True, id="max_size_cycle-second-epoch"),
        pytest.param("min_size", 3, True, id="min_size-epoch-end"),
        pytest.param("min_size", 4, True, id="min_size-second-epoch"),
        pytest.param("max_size", 4, True, id="max_size-shorter-ended"),
        pytest.param("max_size_cycle", 7, False, id="plain-loaders-max_size_cycle"),
    ],
)
def test_mid_epoch_resume_with_two_loaders_is_exact(
    tmp_path: Path, mode: str, step: int, stateful: bool
) -> None:
    """Stopped after ``step`` batches (mid-epoch, at the shorter loader's end, at an epoch's end), then resumed.

    Each StatefulDataLoader shuffles from its own generator and resumes from its own state; plain
    loaders are read again up to the batch the run stopped at. The resumed run must train the same
    batches as the run that never stopped, bit for bit, across the epochs that follow.
    """
    cls = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader if stateful else DataLoader

    def loaders() -> CombinedLoader:
        return CombinedLoader(_two_loaders(cls=cls), mode)

    ckpt = tmp_path / "mid.ckpt"
    tc.seed_everything(5)
    full = _regression(tc)()
    _trainer(tc, tmp_path, max_epochs=3, callbacks=[SaveAt(ckpt, step)]).fit(full, loaders())
    assert len(torch.load(ckpt, weights_only=True)["loops"]["dataloader"]["loaders"]) == (
        2 if stateful else 0
    )
    tc.seed_everything(6)
    resumed = _regression(tc)()
    _trainer(tc, tmp_path, max_epochs=3).fit(resumed, loaders(), ckpt_path=ckpt)
    assert resumed.losses == full.losses[step:]
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def _batches_seen(framework: Any, tmp_path: Path, loaders: Any, **kwargs: Any) -> list[list[int]]:
    seen: list[list[int]] = []

    class Record(framework.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            seen.append((batch["b"] if isinstance(batch, dict) else batch).tolist())

    class Counting(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.w - 1).pow(2).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if isinstance(loaders, dict):
        loaders = (CombinedLoader if framework is tc else LightningCombinedLoader)(loaders, "min_size")
    trainer = _trainer(framework, tmp_path, max_epochs=2, callbacks=[Record()], **kwargs)
    _quietly(trainer.fit, Counting(), loaders)
    return seen


def test_each_epoch_starts_every_stateful_loader_over(tmp_path: Path) -> None:
    """As in Lightning, ``min_size`` starts the longer loader's pass again at each epoch (not where it stopped)."""
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")

    def loaders() -> dict[str, Any]:
        return {
            "a": torchdata.StatefulDataLoader(range(4), batch_size=2),
            "b": torchdata.StatefulDataLoader(range(10), batch_size=2),
        }

    ours = _batches_seen(tc, tmp_path, loaders())
    assert ours == _batches_seen(pl, tmp_path, loaders())
    assert ours == [[0, 1], [2, 3], [0, 1], [2, 3]]
    # One loader cut short by limit_train_batches starts over at each epoch too.
    ours = _batches_seen(tc, tmp_path, loaders()["b"], limit_train_batches=2)
    assert ours == _batches_seen(pl, tmp_path, loaders()["b"], limit_train_batches=2)
    assert ours == [[0, 1], [2, 3], [0, 1], [2, 3]]


# ---------------------------------------------------------------------- prediction
class _Reversed(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def _predict(framework: Any, tmp_path: Path, sequential: bool) -> tuple[list[Any], list[Any]]:
    written: list[Any] = []

    class Writer(framework.callbacks.BasePredictionWriter):
        def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, *args: Any) -> None:
            written.append((list(trainer.predict_loop.current_batch_indices), args[0], args[2], args[3]))

    class Predictor(_regression(framework)):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return self.net(batch[0]).sum().item()

    framework.seed_everything(7, verbose=False) if framework is pl else framework.seed_everything(7)
    first = DataLoader(_data(10, 3), batch_size=3, sampler=_Reversed(10))
    second = DataLoader(_data(8, 4), batch_size=4, shuffle=True)
    cls = CombinedLoader if framework is tc else LightningCombinedLoader
    data = cls([first, second], "sequential") if sequential else first
    trainer = _trainer(framework, tmp_path, callbacks=[Writer("batch")])
    predictions = _quietly(trainer.predict, Predictor(), data)
    return written, predictions


@pytest.mark.parametrize("sequential", [True, False], ids=["combined-sequential", "one-loader"])
def test_current_batch_indices_equal_lightnings(tmp_path: Path, sequential: bool) -> None:
    ours = _predict(tc, tmp_path, sequential)
    assert ours == _predict(pl, tmp_path, sequential)
    assert ours[0][0][0] == [9, 8, 7]


def test_predict_refuses_a_combined_loader_in_another_mode(tmp_path: Path) -> None:
    trainer = _trainer(tc, tmp_path)
    with pytest.raises(MisconfigurationException, match='mode="sequential"'):
        trainer.predict(_regression(tc)(), CombinedLoader(_two_loaders(), "max_size"))


# ---------------------------------------------------------------------- distributed sampler
class _Buckets(torch.utils.data.BatchSampler):
    """A user's batch sampler of torch's form (``sampler, batch_size, drop_last``)."""


class _Fixed(Sampler[list[int]]):
    """A user's batch sampler that takes no sampler: it cannot be split across processes."""

    def __iter__(self) -> Any:
        return iter([[0, 1], [2, 3]])

    def __len__(self) -> int:
        return 2


def test_the_distributed_sampler_keeps_a_users_batch_sampler() -> None:
    """As Lightning does, the user's batch sampler class is made again around the rank's DistributedSampler."""
    from torch.utils.data import DistributedSampler, RandomSampler

    from trainer_core.plugins.parallel import with_distributed_sampler

    data = _data(10, 0)
    loader = DataLoader(data, batch_sampler=_Buckets(RandomSampler(data), batch_size=2, drop_last=True))
    split = with_distributed_sampler(loader, "train", num_replicas=2, rank=1)
    assert type(split.batch_sampler) is _Buckets
    assert (split.batch_sampler.batch_size, split.batch_sampler.drop_last) == (2, True)
    inner = split.batch_sampler.sampler
    assert (
        isinstance(inner, DistributedSampler) and inner.shuffle and (inner.num_replicas, inner.rank) == (2, 1)
    )
    assert len(split) == 2  # 5 of the 10 samples, in batches of 2, the last dropped
    with pytest.raises(MisconfigurationException, match="use_distributed_sampler=False"):
        with_distributed_sampler(DataLoader(data, batch_sampler=_Fixed()), "train", num_replicas=2, rank=0)
    with pytest.warns(UserWarning, match="every process predicts"):
        kept = DataLoader(data, batch_sampler=_Fixed())
        assert with_distributed_sampler(kept, "predict", num_replicas=2, rank=0) is kept


def test_batch_size_of_a_combined_batch_equals_lightnings() -> None:
    """``self.log`` weighs by the first tensor's size, past ``None`` (an ended loader), strings and numbers."""
    from pytorch_lightning.utilities.data import extract_batch_size as lightning_batch_size

    from trainer_core.utilities import extract_batch_size

    x = torch.zeros(5, 2)
    for batch in ({"a": None, "b": [x, x]}, {"name": "abc", "x": x}, [7, (x,)], [[], x], torch.tensor(2.0)):
        assert extract_batch_size(batch) == _quietly(lightning_batch_size, batch)
