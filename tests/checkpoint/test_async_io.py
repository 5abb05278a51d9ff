"""AsyncCheckpointIO on real files and real runs: same checkpoints as a synchronous save, written later.

A wrapped IO that sleeps before writing makes "later" observable: the save returns long before the
file appears, and whatever training does to the parameters in between must not reach the file.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from resume_job import ResumeModule, dataloader, trainer_kwargs
from torch import nn

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint
from trainer_core.checkpoint import FORMAT_VERSION
from trainer_core.errors import CheckpointError
from trainer_core.plugins import AsyncCheckpointIO, TorchCheckpointIO

pytestmark = pytest.mark.timeout(120)

DELAY = 0.6  # seconds the slow IO sleeps before it writes


class SlowIO(TorchCheckpointIO):
    """Sleeps before every write; records the order in which writes finish."""

    def __init__(self, delay: float = DELAY) -> None:
        super().__init__()
        self.delay = delay
        self.finished: list[tuple[str, int]] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        time.sleep(self.delay)
        super().save_checkpoint(checkpoint, path, storage_options)
        self.finished.append((Path(path).name, int(checkpoint["global_step"])))


class FailingIO(TorchCheckpointIO):
    """Fails mid-write (an unpicklable value after the tensors) for checkpoints of the given steps."""

    def __init__(self, fail_at_steps: set[int]) -> None:
        super().__init__()
        self.fail_at_steps = fail_at_steps

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        if checkpoint["global_step"] in self.fail_at_steps:
            checkpoint = {**checkpoint, "zz_not_picklable": threading.Lock()}
        super().save_checkpoint(checkpoint, path, storage_options)


class RecordingIO(TorchCheckpointIO):
    """Remembers where the tensors it was handed live, to see whether staging reused its buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.data_ptrs: list[list[int]] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        self.data_ptrs.append([t.data_ptr() for t in checkpoint["state_dict"].values()])
        super().save_checkpoint(checkpoint, path, storage_options)


def _checkpoint(step: int, **entries: Any) -> dict[str, Any]:
    """The smallest dict a trainer-core reader accepts, plus ``entries``."""
    return {"format_version": FORMAT_VERSION, "epoch": 0, "global_step": step, **entries}


def _model_checkpoint(layer: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return _checkpoint(step, state_dict=layer.state_dict(), optimizer=optimizer.state_dict())


def _trained_linear(size: int = 64) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.Linear(size, size)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(4, size)).sum().backward()
    optimizer.step()
    return layer, optimizer


def _assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{index}")
    else:
        assert a == b, where


def _read_all(folder: Path) -> dict[str, dict[str, Any]]:
    io = TorchCheckpointIO()
    return {p.name: io.load_checkpoint(str(p)) for p in sorted(folder.iterdir())}


def _fit(folder: Path, io: Optional[AsyncCheckpointIO], max_epochs: int, ckpt_path: Optional[str] = None):
    seed_everything(42)
    model = ResumeModule()
    callback = ModelCheckpoint(
        dirpath=folder, monitor="train_loss", every_n_train_steps=2, save_top_k=2, save_last=True
    )
    trainer = Trainer(
        **trainer_kwargs(enable_checkpointing=True, max_epochs=max_epochs),
        callbacks=[callback],
        plugins=[io] if io is not None else None,
    )
    trainer.fit(model, dataloader(), dataloader(shuffle=False), ckpt_path=ckpt_path)
    return model, trainer


# ---------------------------------------------------------------------- real runs


def test_fit_writes_the_same_checkpoints_as_sync_and_resumes_exactly(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    _fit(folder, None, max_epochs=2)
    sync_files = _read_all(folder)
    for p in folder.iterdir():
        p.unlink()

    io = AsyncCheckpointIO()
    _, trainer = _fit(folder, io, max_epochs=2)
    assert trainer.plugin.checkpoint_io is io
    assert io._executor is None  # the end of fit tore the writer thread down
    async_files = _read_all(folder)
    assert set(async_files) == set(sync_files) and "last.ckpt" in async_files
    assert len(async_files) == 3  # top-k removed the older ones: removals went through the async IO
    for name in sync_files:
        _assert_same(async_files[name], sync_files[name], name)

    # Resuming from the async last.ckpt continues exactly like a run that never stopped.
    full, _ = _fit(tmp_path / "full", None, max_epochs=3)
    resumed, _ = _fit(folder, AsyncCheckpointIO(), max_epochs=3, ckpt_path=str(folder / "last.ckpt"))
    assert 0 < len(resumed.losses) < len(full.losses)
    assert resumed.losses == full.losses[-len(resumed.losses) :]


def test_error_in_background_write_fails_the_fit_at_the_next_save(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    io = AsyncCheckpointIO(FailingIO(fail_at_steps={4}))
    with pytest.raises(CheckpointError, match=r"background write of the checkpoint .*step=4.ckpt failed"):
        _fit(folder, io, max_epochs=1)
    # ModelCheckpoint's removal of step 2's file (which step 4's replaces) met the failure and raised
    # before removing anything: the last good checkpoints are intact and loadable, nothing half-written.
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        assert TorchCheckpointIO().load_checkpoint(str(folder / name))["global_step"] == 2


def test_error_in_the_last_write_fails_the_fit_at_its_end(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    _fit(folder, None, max_epochs=1)
    final_step = TorchCheckpointIO().load_checkpoint(str(folder / "last.ckpt"))["global_step"]
    for p in folder.iterdir():
        p.unlink()

    io = AsyncCheckpointIO(FailingIO(fail_at_steps={final_step}))
    with pytest.raises(CheckpointError, match=r"last\.ckpt failed.*TypeError"):
        _fit(folder, io, max_epochs=1)
    # The previous last.ckpt is intact: the failed write never replaced it. (The final one is the
    # every-2-steps save at step 12: as in Lightning, an epoch end that saved nothing writes no
    # last.ckpt; the one before, step 10.)
    previous = TorchCheckpointIO().load_checkpoint(str(folder / "last.ckpt"))
    assert final_step == 12 and previous["global_step"] == 10
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]
    io.teardown()  # the error was raised once; tearing down again is quiet


# ---------------------------------------------------------------------- the save itself


def test_the_write_happens_later_and_holds_the_state_at_save_time(tmp_path: Path) -> None:
    layer, optimizer = _trained_linear()
    expected = {k: v.clone() for k, v in layer.state_dict().items()}
    expected_exp_avg = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    path = tmp_path / "a.ckpt"
    io = AsyncCheckpointIO(SlowIO())

    io.save_checkpoint(_model_checkpoint(layer, optimizer, 1), path)
    assert not path.exists()  # the slow IO is still asleep
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1)
    layer(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # changes exp_avg in place
    io.teardown()

    written = TorchCheckpointIO().load_checkpoint(str(path))
    for key, value in expected.items():
        assert torch.equal(written["state_dict"][key], value), key
        assert not torch.equal(written["state_dict"][key], layer.state_dict()[key]), key
    assert torch.equal(written["optimizer"]["state"][0]["exp_avg"], expected_exp_avg)


def test_save_returns_before_the_write_and_saves_run_in_order(tmp_path: Path) -> None:
    layer, optimizer = _trained_linear()
    slow = SlowIO()
    io = AsyncCheckpointIO(slow)
    path = tmp_path / "same.ckpt"

    start = time.perf_counter()
    io.save_checkpoint(_model_checkpoint(layer, optimizer, 1), path)
    first_call = time.perf_counter() - start
    with torch.no_grad():
        layer.weight.fill_(2.0)
    start = time.perf_counter()
    io.save_checkpoint(_model_checkpoint(layer, optimizer, 2), path)
    second_call = time.perf_counter() - start

    assert first_call < DELAY / 4, first_call
    assert second_call > DELAY / 2, second_call  # waited for the first write
    assert slow.finished == [("same.ckpt", 1)]
    # A reader waits for the pending write: it sees the second checkpoint, whole.
    assert io.latest_complete(tmp_path) == str(path)
    written = io.load_checkpoint(path)
    assert slow.finished == [("same.ckpt", 1), ("same.ckpt", 2)]
    assert written["global_step"] == 2 and torch.equal(written["state_dict"]["weight"], layer.weight)
    io.teardown()


def test_remove_waits_for_the_pending_write(tmp_path: Path) -> None:
    layer, optimizer = _trained_linear()
    io = AsyncCheckpointIO(SlowIO(delay=0.3))
    path = tmp_path / "gone.ckpt"
    io.save_checkpoint(_model_checkpoint(layer, optimizer, 1), path)
    io.remove_checkpoint(path)  # must not race the write and leave the file behind
    assert not path.exists()
    assert not io.is_complete(path)
    io.teardown()


def test_background_error_surfaces_at_next_save_and_at_teardown(tmp_path: Path) -> None:
    layer, optimizer = _trained_linear()
    io = AsyncCheckpointIO(FailingIO(fail_at_steps={2}))
    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    io.save_checkpoint(_model_checkpoint(layer, optimizer, 1), good)
    io.save_checkpoint(_model_checkpoint(layer, optimizer, 2), bad)  # fails in the background
    with pytest.raises(CheckpointError, match=r"bad\.ckpt failed.*TypeError") as raised:
        io.save_checkpoint(_model_checkpoint(layer, optimizer, 3), good)
    assert isinstance(raised.value.__cause__, CheckpointError)
    assert not bad.exists()
    assert io.load_checkpoint(good)["global_step"] == 1  # the failed-on save was not written either

    io.save_checkpoint(_model_checkpoint(layer, optimizer, 3), good)  # the IO keeps working
    io.save_checkpoint(_model_checkpoint(layer, optimizer, 2), bad)
    with pytest.raises(CheckpointError, match=r"bad\.ckpt failed"):
        io.teardown()
    io.teardown()  # idempotent: the error was raised once and the thread is gone
    assert io.load_checkpoint(good)["global_step"] == 3
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]

    io.save_checkpoint(_model_checkpoint(layer, optimizer, 4), good)  # a new run after teardown
    io.teardown()
    assert io.load_checkpoint(good)["global_step"] == 4


def test_staging_keeps_tied_tensors_shared_and_containers_independent(tmp_path: Path) -> None:
    shared = torch.arange(6.0)
    meta = {"lr": [0.1, 0.2]}
    checkpoint = _checkpoint(0, state_dict={}, a=shared, view=shared[2:4], meta=meta, nested=([shared],))
    io = AsyncCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    meta["lr"].append(0.3)
    shared.zero_()
    io.teardown()
    written = torch.load(tmp_path / "x.ckpt", weights_only=True)
    assert written["meta"] == {"lr": [0.1, 0.2]}
    assert torch.equal(written["view"], torch.tensor([2.0, 3.0]))
    assert written["a"].untyped_storage().data_ptr() == written["view"].untyped_storage().data_ptr()
    assert written["nested"][0][0].untyped_storage().data_ptr() == written["a"].untyped_storage().data_ptr()


# ---------------------------------------------------------------------- blocking time


def test_blocking_time_is_a_fraction_of_a_sync_save_and_buffers_are_reused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3584, 3584)  # 12.8 M float32 parameters: about 51 MB
    checkpoint = _checkpoint(0, state_dict=model.state_dict())
    sync_io = TorchCheckpointIO()
    recording = RecordingIO()
    async_io = AsyncCheckpointIO(recording)

    sync_times, blocked_times = [], []
    async_io.save_checkpoint(checkpoint, tmp_path / "warmup.ckpt")  # the first save allocates the buffers
    for i in range(4):
        start = time.perf_counter()
        sync_io.save_checkpoint(checkpoint, tmp_path / f"sync{i}.ckpt")
        sync_times.append(time.perf_counter() - start)
        async_io.wait()  # time only the staging, not the wait for the previous write
        with torch.no_grad():
            model.weight.add_(1)
        start = time.perf_counter()
        async_io.save_checkpoint(checkpoint, tmp_path / f"async{i}.ckpt")
        blocked_times.append(time.perf_counter() - start)
    async_io.teardown()

    ratio = statistics.median(blocked_times) / statistics.median(sync_times)
    print(
        f"async save blocked {statistics.median(blocked_times) * 1e3:.1f} ms, sync save "
        f"{statistics.median(sync_times) * 1e3:.1f} ms: ratio {ratio:.3f}"
    )
    assert ratio < 0.5
    # Every save staged into the same buffers: repeated saves allocate nothing.
    assert all(ptrs == recording.data_ptrs[0] for ptrs in recording.data_ptrs)
    assert len(recording.data_ptrs) == 5
    written = TorchCheckpointIO().load_checkpoint(str(tmp_path / "async3.ckpt"))
    assert torch.equal(written["state_dict"]["weight"], model.weight)
