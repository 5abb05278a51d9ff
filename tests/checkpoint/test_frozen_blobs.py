"""FrozenBlobCheckpointIO on real files, a real S3 server and real runs: a frozen base written once.

The module is LoRA-like: a frozen base (two linear layers, ``requires_grad=False``) and a small trainable
low-rank adapter beside the first. A run saves through ``ModelCheckpoint(save_top_k=2,
every_n_train_steps=...)``; the frozen tensors must be written once, into ``<dirpath>/blobs``, every
checkpoint must hold only a reference to them, and a resume from a mid-run checkpoint must end with
the same weights, bit for bit, as the run that never stopped.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import faulty_fs
import fsspec
import pytest
import torch
from boring import fast_trainer, random_loader
from frozen_blobs_job import FEATURES, LoRAModule, fit
from launch import JOBS, job_env

from trainer_core import seed_everything
from trainer_core.checkpoint.format import (
    BLOB_REF_TAG,
    BLOBS_FORMAT_VERSION,
    FORMAT_VERSION,
    KEY_BLOBS,
    KEY_FROZEN_PARAMETERS,
)
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io import frozen_io
from trainer_core.plugins.io.async_io import AsyncCheckpointIO
from trainer_core.plugins.io.frozen_io import FrozenBlobCheckpointIO
from trainer_core.plugins.io.torch_io import TorchCheckpointIO

pytestmark = pytest.mark.timeout(120)

FROZEN_NAMES = ["base.0.weight", "base.0.bias", "base.2.weight", "base.2.bias"]
FULL = os.environ.get("FULL_MATRIX") == "1"


def _fit(dirpath: Path, io: Any, max_steps: int, ckpt_path: Any = None) -> LoRAModule:
    return fit(dirpath, io, max_steps, ckpt_path=ckpt_path)[1]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def _blob_names(folder: Path) -> list[str]:
    store = folder / "blobs"
    return sorted(p.name for p in store.iterdir() if p.is_file()) if store.exists() else []


def _count_publishes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    written: list[str] = []
    publish = frozen_io._publish_blob

    def counting(fs: Any, path: str, data: torch.Tensor) -> None:
        written.append(path)
        publish(fs, path, data)

    monkeypatch.setattr(frozen_io, "_publish_blob", counting)
    return written


# ---------------------------------------------------------------------- real runs


def test_resume_is_exact_and_frozen_base_is_written_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = _count_publishes(monkeypatch)
    folder = tmp_path / "run"
    whole = _fit(folder, FrozenBlobCheckpointIO(), max_steps=8)

    # Four saves (steps 2..8), the base's four tensors written once; retention kept two checkpoints.
    assert len(written) == 4
    assert len(_blob_names(folder)) == 4
    kept = sorted(p.name for p in folder.glob("*.ckpt"))
    assert kept == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    raw = torch.load(folder / kept[0], weights_only=True)
    assert raw["format_version"] == BLOBS_FORMAT_VERSION
    assert sorted(raw[KEY_FROZEN_PARAMETERS]) == sorted(FROZEN_NAMES)
    assert all(BLOB_REF_TAG in raw["state_dict"][name] for name in FROZEN_NAMES)
    assert sorted(raw[KEY_BLOBS]["sha256"]) == _blob_names(folder)
    # The same checkpoint saved plainly is larger by the base: the file holds the adapter, its Adam state
    # and the loop state, and a few bytes per reference.
    TorchCheckpointIO().save_checkpoint(
        TorchCheckpointIO().load_checkpoint(str(folder / kept[0])), str(tmp_path / "plain")
    )
    base_bytes = sum(t.numel() * t.element_size() for n, t in whole.state_dict().items() if n in FROZEN_NAMES)
    assert (folder / kept[0]).stat().st_size <= (tmp_path / "plain").stat().st_size - base_bytes + 200 * len(
        FROZEN_NAMES
    )

    # Resume from the mid-run checkpoint in the same folder: no blob is written again, and the run ends
    # where the run that never stopped did.
    mtimes = {name: (folder / "blobs" / name).stat().st_mtime_ns for name in _blob_names(folder)}
    resumed = _fit(folder, FrozenBlobCheckpointIO(), max_steps=8, ckpt_path=str(folder / kept[0]))
    _assert_same_bits(_weights(whole), _weights(resumed))
    assert len(written) == 4
    assert {name: (folder / "blobs" / name).stat().st_mtime_ns for name in _blob_names(folder)} == mtimes

    # Any reader resolves the references: load_from_checkpoint, without the plugin.
    loaded = LoRAModule.load_from_checkpoint(str(folder / "epoch=0-step=8.ckpt"))
    _assert_same_bits(_weights(whole), _weights(loaded))


def test_training_is_the_same_as_with_plain_checkpoints(tmp_path: Path) -> None:
    plain = _fit(tmp_path / "plain", None, max_steps=4)
    frozen = _fit(tmp_path / "frozen", FrozenBlobCheckpointIO(), max_steps=4)
    _assert_same_bits(_weights(plain), _weights(frozen))
    assert not (tmp_path / "plain" / "blobs").exists()


@pytest.mark.parametrize("order", ["frozen_outside", "async_outside"])
def test_composes_with_async_io(order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = _count_publishes(monkeypatch)
    if order == "frozen_outside":
        io: Any = FrozenBlobCheckpointIO(AsyncCheckpointIO())
    else:
        io = AsyncCheckpointIO(FrozenBlobCheckpointIO())
    with pytest.warns(UserWarning, match="another thread") if order == "async_outside" else _no_warning():
        model = _fit(tmp_path / "run", io, max_steps=8)
    folder = tmp_path / "run"
    assert len(_blob_names(folder)) == 4 and len(written) == 4
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    resumed = _fit(
        folder, FrozenBlobCheckpointIO(), max_steps=8, ckpt_path=str(folder / "epoch=0-step=6.ckpt")
    )
    _assert_same_bits(_weights(model), _weights(resumed))


class _no_warning:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


# ---------------------------------------------------------------------- retention


def _checkpoint(step: int, state: dict[str, torch.Tensor], frozen: list[str]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "epoch": 0,
        "global_step": step,
        "state_dict": dict(state),
        KEY_FROZEN_PARAMETERS: frozen,
    }


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"base": torch.randn(64, 64, generator=gen), "adapter": torch.randn(4, generator=gen)}


def test_retention_never_removes_a_blob_in_use(tmp_path: Path) -> None:
    io = FrozenBlobCheckpointIO()
    state = _state()
    a, b, c, copy = (str(tmp_path / f"{n}.ckpt") for n in ("a", "b", "c", "copy"))
    io.save_checkpoint(_checkpoint(1, state, ["base"]), a)
    io.save_checkpoint(_checkpoint(2, state, ["base"]), b)
    old_blobs = _blob_names(tmp_path)
    assert len(old_blobs) == 1
    with torch.no_grad():
        state["base"].mul_(2)  # the frozen tensor changed in place: a new blob
    io.save_checkpoint(_checkpoint(3, state, ["base"]), c)
    blobs = _blob_names(tmp_path)
    assert len(blobs) == 2
    new_blob = (set(blobs) - set(old_blobs)).pop()

    io.remove_checkpoint(a)  # b still uses the old blob
    assert _blob_names(tmp_path) == blobs
    shutil.copy(c, copy)  # a copy made by hand, with no list of its blobs: read to find them
    io.remove_checkpoint(b)  # nothing uses the old blob any more
    assert _blob_names(tmp_path) == [new_blob]
    io.remove_checkpoint(c)  # the copy still uses the new one
    assert _blob_names(tmp_path) == [new_blob]
    assert torch.equal(TorchCheckpointIO().load_checkpoint(copy)["state_dict"]["base"], state["base"])
    os.remove(copy)
    io.save_checkpoint(_checkpoint(4, {"adapter": state["adapter"]}, []), str(tmp_path / "d.ckpt"))
    io.remove_checkpoint(str(tmp_path / "d.ckpt"))
    assert _blob_names(tmp_path) == []


def test_change_behind_the_version_counter_is_caught_by_the_sample(tmp_path: Path) -> None:
    io = FrozenBlobCheckpointIO()
    state = _state()
    io.save_checkpoint(_checkpoint(1, state, ["base"]), str(tmp_path / "a.ckpt"))
    version = state["base"]._version
    state["base"].data.add_(1.0)  # what merging an adapter into the base does; torch does not count it
    assert state["base"]._version == version
    io.save_checkpoint(_checkpoint(2, state, ["base"]), str(tmp_path / "b.ckpt"))
    loaded = TorchCheckpointIO().load_checkpoint(str(tmp_path / "b.ckpt"))
    assert torch.equal(loaded["state_dict"]["base"], state["base"])


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("damage", ["missing", "altered", "truncated"])
def test_missing_or_damaged_blob_is_one_clear_error(damage: str, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    _fit(folder, FrozenBlobCheckpointIO(), max_steps=4)  # steps 2 and 4, the base as it was
    first, second = str(folder / "epoch=0-step=2.ckpt"), str(folder / "epoch=0-step=4.ckpt")
    # A second checkpoint whose base differs in one tensor: it alone uses that blob.
    checkpoint = TorchCheckpointIO().load_checkpoint(second)
    checkpoint["state_dict"]["base.2.bias"] = checkpoint["state_dict"]["base.2.bias"] + 1
    third = str(folder / "epoch=0-step=5.ckpt")
    FrozenBlobCheckpointIO().save_checkpoint(checkpoint, third)
    only_third = (
        set(_blob_names(folder)) - set(torch.load(first, weights_only=True)[KEY_BLOBS]["sha256"])
    ).pop()
    blob = folder / "blobs" / only_third
    if damage == "missing":
        blob.unlink()
    elif damage == "altered":
        data = bytearray(blob.read_bytes())
        data[0] ^= 0x01
        blob.write_bytes(bytes(data))
    else:
        blob.write_bytes(blob.read_bytes()[:-1])

    seed_everything(3)
    model = LoRAModule()
    before = _weights(model)
    trainer = fast_trainer(max_steps=6, plugins=[FrozenBlobCheckpointIO()])
    with pytest.raises(CheckpointError) as info:
        trainer.fit(model, random_loader(64, FEATURES, batch_size=4), ckpt_path=third)
    message = str(info.value)
    assert str(blob) in message and third in message and "base.2.bias" in message
    assert {"missing": "missing", "altered": "does not match its sha256", "truncated": "truncated"}[
        damage
    ] in message
    assert "Nothing was loaded" in message
    _assert_same_bits(before, _weights(model))  # the model is as it was
    # The earlier checkpoints' blobs are intact: the run resumes from the previous one.
    # (this model's own base differs, so the resumed base below came from the blobs)
    assert not torch.equal(LoRAModule.load_from_checkpoint(first).base[0].weight, model.base[0].weight)
    trainer = fast_trainer(max_steps=6, plugins=[FrozenBlobCheckpointIO()])
    trainer.fit(model, random_loader(64, FEATURES, batch_size=4), ckpt_path=second)
    assert trainer.global_step == 6
    _assert_same_bits(
        {n: t for n, t in _weights(model).items() if n in FROZEN_NAMES},
        {
            n: t
            for n, t in TorchCheckpointIO().load_checkpoint(second)["state_dict"].items()
            if n in FROZEN_NAMES
        },
    )


def test_failed_blob_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    faulty_fs.register()
    io = FrozenBlobCheckpointIO()
    url = f"faulty://{tmp_path}/last.ckpt"
    state = _state()
    io.save_checkpoint(_checkpoint(1, state, ["base"]), url)
    original = state["base"].clone()
    with torch.no_grad():
        state["base"].add_(1)
    # The new blob cannot be written (disk full after 1 kB): the save fails before the checkpoint.
    with pytest.raises(CheckpointError, match="frozen-weight blobs"):
        io.save_checkpoint(_checkpoint(2, state, ["base"]), url, storage_options={"fail_write_after": 1024})
    loaded = TorchCheckpointIO().load_checkpoint(url)
    assert loaded["global_step"] == 1
    assert torch.equal(loaded["state_dict"]["base"], original)
    assert (
        len([n for n in _blob_names(tmp_path) if not n.endswith(".complete")]) == 1
    )  # no torn blob published
    # The checkpoint itself fails after its (new) blob went in: the old file and its blob stay usable.
    with pytest.raises(CheckpointError):
        io.save_checkpoint(_checkpoint(2, state, ["base"]), url, storage_options={"fail_commit": True})
    assert TorchCheckpointIO().load_checkpoint(url)["global_step"] == 1
    io.remove_checkpoint(f"faulty://{tmp_path}/other.ckpt")  # a removal collects what nothing uses
    assert torch.equal(TorchCheckpointIO().load_checkpoint(url)["state_dict"]["base"], original)


# ---------------------------------------------------------------------- object store


def test_s3_blobs_written_once_resolved_and_collected(s3_server: Any, s3_url: str, monkeypatch) -> None:
    written = _count_publishes(monkeypatch)
    options = s3_server.storage_options
    io = FrozenBlobCheckpointIO(TorchCheckpointIO(storage_options=options))
    state = _state()
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step, state, ["base"]), f"{s3_url}/s{step}.ckpt")
    assert len(written) == 1
    fs, root = fsspec.core.url_to_fs(s3_url, **options)
    store = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/blobs", detail=False) if not p.endswith("/refs")]
    assert len([n for n in store if not n.endswith(".complete")]) == 1 and len(store) == 2  # blob + marker
    loaded = TorchCheckpointIO(storage_options=options).load_checkpoint(f"{s3_url}/s2.ckpt")
    assert torch.equal(loaded["state_dict"]["base"], state["base"])
    assert torch.equal(loaded["state_dict"]["adapter"], state["adapter"])
    with torch.no_grad():
        state["base"].add_(1)
    io.save_checkpoint(_checkpoint(3, state, ["base"]), f"{s3_url}/s3.ckpt")
    io.remove_checkpoint(f"{s3_url}/s1.ckpt")
    fs.invalidate_cache()
    assert len([p for p in fs.ls(f"{root}/blobs", detail=False) if p.endswith(".complete")]) == 2
    io.remove_checkpoint(f"{s3_url}/s2.ckpt")
    fs.invalidate_cache()
    remaining = [p for p in fs.ls(f"{root}/blobs", detail=False) if not p.endswith("/refs")]
    assert len(remaining) == 2  # the new blob and its marker; the old one went with its last user
    loaded = TorchCheckpointIO(storage_options=options).load_checkpoint(f"{s3_url}/s3.ckpt")
    assert torch.equal(loaded["state_dict"]["base"], state["base"])


# ---------------------------------------------------------------------- two ranks


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1 (make stress)")
def test_two_ddp_ranks_resume_exactly(tmp_path: Path) -> None:
    """2 gloo ranks: rank 0 writes the blobs once, every rank reads them, and the resume is exact."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(JOBS / "frozen_blobs_job.py"), "--out", str(out)],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    if proc.returncode != 0:
        pytest.fail(f"job exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["exact"] and seen["global_step"] == 12, (rank, seen)
        assert len(seen["blobs"]) == 4 and len(seen["kept"]) == 2, (rank, seen)


def test_link_references_the_blobs_of_its_target(tmp_path: Path) -> None:
    io = pickle.loads(pickle.dumps(FrozenBlobCheckpointIO()))  # ddp_spawn sends the IO to each rank
    state = _state()
    a, last = str(tmp_path / "a.ckpt"), str(tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(1, state, ["base"]), a)
    io.link(a, last)  # ModelCheckpoint(save_last="link")
    blobs = _blob_names(tmp_path)
    assert len(blobs) == 1
    assert torch.equal(TorchCheckpointIO().load_checkpoint(last)["state_dict"]["base"], state["base"])
    io.remove_checkpoint(last)  # a still uses the blob
    assert _blob_names(tmp_path) == blobs
    io.link(a, last)
    io.remove_checkpoint(a)  # the (now dangling) link's list still names it: kept, to be safe
    assert _blob_names(tmp_path) == blobs
    b = str(tmp_path / "b.ckpt")
    with torch.no_grad():
        state["base"].add_(1)
    io.save_checkpoint(_checkpoint(2, state, ["base"]), b)
    io.link(b, last)  # replaces the dangling link, and its list
    io.remove_checkpoint(str(tmp_path / "gone.ckpt"))  # any removal collects: a's blob is unused now
    assert len(_blob_names(tmp_path)) == 1 and _blob_names(tmp_path) != blobs


def test_next_run_replaces_a_damaged_blob_instead_of_referencing_it(tmp_path: Path) -> None:
    state = _state()
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    FrozenBlobCheckpointIO().save_checkpoint(_checkpoint(1, state, ["base"]), a)
    (blob,) = (tmp_path / "blobs").glob("[0-9a-f]" * 64)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        TorchCheckpointIO().load_checkpoint(a)
    FrozenBlobCheckpointIO().save_checkpoint(_checkpoint(2, state, ["base"]), b)  # a new run's first save
    for path in (a, b):  # the blob was checked, found damaged and written again: both load
        assert torch.equal(TorchCheckpointIO().load_checkpoint(path)["state_dict"]["base"], state["base"])


def test_a_store_shared_through_a_symlink_is_neither_written_nor_pruned(tmp_path: Path) -> None:
    """Run B's ``blobs`` is a symlink to run A's store: B's retention must not remove A's blobs."""
    state = _state()
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    FrozenBlobCheckpointIO().save_checkpoint(_checkpoint(1, state, ["base"]), str(run_a / "a.ckpt"))
    store_a = {name: (run_a / "blobs" / name).read_bytes() for name in _blob_names(run_a)}
    io_b = FrozenBlobCheckpointIO()
    other = {"base": torch.zeros(8, 8), "adapter": state["adapter"]}  # B's own base: a blob A does not use
    io_b.save_checkpoint(_checkpoint(1, other, ["base"]), str(run_b / "b.ckpt"))
    shutil.rmtree(run_b / "blobs")
    (run_b / "blobs").symlink_to(run_a / "blobs", target_is_directory=True)  # "share" A's store

    with pytest.raises(CheckpointError, match=r"frozen-weight store .*b/blobs is a symlink"):
        io_b.save_checkpoint(_checkpoint(2, other, ["base"]), str(run_b / "c.ckpt"))
    assert not (run_b / "c.ckpt").exists()
    with pytest.warns(UserWarning, match=r"b/blobs is a symlink .*never pruned") as warned:
        io_b.remove_checkpoint(str(run_b / "b.ckpt"))
        assert io_b.remove_unreferenced_blobs(str(run_b)) == []
    assert len([w for w in warned if "never pruned" in str(w.message)]) == 1  # once per store
    assert {name: (run_a / "blobs" / name).read_bytes() for name in _blob_names(run_a)} == store_a
    loaded = TorchCheckpointIO().load_checkpoint(str(run_a / "a.ckpt"))
    _assert_same_bits({"base": loaded["state_dict"]["base"]}, {"base": state["base"]})
    # The refs folder shared through a symlink counts the same.
    (run_b / "blobs").unlink()
    (run_b / "blobs").mkdir()
    (run_b / "blobs" / "refs").symlink_to(run_a / "blobs" / "refs", target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"blobs/refs is a symlink"):
        FrozenBlobCheckpointIO().save_checkpoint(_checkpoint(3, other, ["base"]), str(run_b / "d.ckpt"))
    assert sorted(p.name for p in (run_a / "blobs" / "refs").iterdir()) == ["a.ckpt.json"]


def test_a_damaged_list_of_blobs_is_read_from_its_checkpoint_instead(tmp_path: Path) -> None:
    """A ``refs/<name>.json`` nested 100,000 deep or not UTF-8 is unreadable: the checkpoint is read to see its blobs."""
    io = FrozenBlobCheckpointIO()
    state = _state()
    a, b = (str(tmp_path / f"{n}.ckpt") for n in ("a", "b"))
    io.save_checkpoint(_checkpoint(1, state, ["base"]), a)
    io.save_checkpoint(_checkpoint(2, state, ["base"]), b)
    blobs = _blob_names(tmp_path)
    lists = sorted((tmp_path / "blobs" / "refs").iterdir())
    lists[1].write_bytes(b"[" * 100_000 + b"]" * 100_000)  # b's list
    io.remove_checkpoint(a)
    assert _blob_names(tmp_path) == blobs  # b still uses the blob, found by reading b.ckpt
    lists[1].write_bytes(b"\xff\xfe")
    assert io.remove_unreferenced_blobs(str(tmp_path)) == []
    assert torch.equal(io.load_checkpoint(b)["state_dict"]["base"], state["base"])
