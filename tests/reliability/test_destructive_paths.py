"""Every path that deletes deletes only what trainer-core wrote and named, and never follows a symlink out.

Each test puts *bystanders* next to the target of a deleting path (and inside it, for a folder): an
unrelated file and a symlink to a folder outside, which holds a file of its own. It runs the path and
checks that the target's own files went, that both bystanders are still there as they were (the link
still a link to the same place) and that the outside file's bytes are unchanged.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from boring import BoringModel, quiet_trainer, random_loader

from trainer_core import seed_everything
from trainer_core.callbacks import ModelCheckpoint
from trainer_core.checkpoint.format import FORMAT_VERSION, KEY_FROZEN_PARAMETERS
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO
from trainer_core.plugins.io.async_io import AsyncCheckpointIO
from trainer_core.plugins.io.checkpoint_io import remove_abandoned_temporaries, temporary_path
from trainer_core.plugins.io.frozen_io import FrozenBlobCheckpointIO

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

UNRELATED = b"a model card the user wrote"
OUTSIDE = b"another run's precious bytes"


class Bystanders:
    """An unrelated file and a symlink to an outside folder (with a file in it), placed in ``folder``."""

    def __init__(self, folder: Path, outside: Path, tag: str = "") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        outside.mkdir(parents=True, exist_ok=True)
        self.outside_file = outside / "weights.bin"
        self.outside_file.write_bytes(OUTSIDE)
        self.file = folder / f"README{tag}.md"
        self.file.write_bytes(UNRELATED)
        self.link = folder / f"shared{tag}"
        self.link.symlink_to(outside, target_is_directory=True)
        self.target = os.readlink(self.link)

    def check(self) -> None:
        assert self.file.read_bytes() == UNRELATED
        assert self.link.is_symlink() and os.readlink(self.link) == self.target
        assert (self.link / "weights.bin").read_bytes() == OUTSIDE
        assert self.outside_file.read_bytes() == OUTSIDE


def _checkpoint(step: int = 1) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "format_version": FORMAT_VERSION,
        "epoch": 0,
        "global_step": step,
        "state_dict": {"w": torch.randn(8, 8, generator=gen), "b": torch.randn(8, generator=gen)},
    }


def _sharded(path: Path, step: int = 1) -> list[str]:
    """A real sharded folder at ``path``; returns the names DCP and the IO wrote into it."""
    DistributedCheckpointIO().save_checkpoint(_checkpoint(step), str(path))
    return sorted(os.listdir(path))


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


# ---------------------------------------------------------------------- TorchCheckpointIO


def test_removing_a_file_checkpoint_leaves_its_neighbours(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(), str(folder / "a.ckpt"))
    near = Bystanders(folder, tmp_path / "outside")
    io.remove_checkpoint(str(folder / "a.ckpt"))
    assert not (folder / "a.ckpt").exists()
    near.check()


def test_a_link_is_removed_as_a_link_never_its_target(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(), str(folder / "a.ckpt"))
    saved = (folder / "a.ckpt").read_bytes()
    io.link(str(folder / "a.ckpt"), str(folder / "last.ckpt"))  # ModelCheckpoint(save_last="link")
    near = Bystanders(folder, tmp_path / "outside")
    io.remove_checkpoint(str(folder / "last.ckpt"))
    assert not os.path.lexists(folder / "last.ckpt")
    assert (folder / "a.ckpt").read_bytes() == saved
    # A symlink to a folder outside, named as if it were a checkpoint: only the link goes.
    (folder / "b.ckpt").symlink_to(tmp_path / "outside", target_is_directory=True)
    io.remove_checkpoint(str(folder / "b.ckpt"))
    assert not os.path.lexists(folder / "b.ckpt")
    near.check()


def test_a_folder_that_is_not_a_checkpoint_is_kept(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "mine.ckpt"
    near = Bystanders(folder, tmp_path / "outside")
    with pytest.warns(UserWarning, match=r"Did not remove .*mine\.ckpt: it is a folder"):
        TorchCheckpointIO().remove_checkpoint(str(folder))
    near.check()


# ---------------------------------------------------------------------- sharded folders


@pytest.mark.parametrize("io", [DistributedCheckpointIO(), TorchCheckpointIO()], ids=["distributed", "torch"])
def test_removing_a_sharded_folder_deletes_only_its_own_files(io: Any, tmp_path: Path) -> None:
    run = tmp_path / "run"
    clean, mixed = run / "clean.ckpt", run / "mixed.ckpt"
    written = _sharded(clean)
    assert (
        ".metadata" in written
        and "trainer_state.pt" in written
        and any(n.endswith(".distcp") for n in written)
    )
    _sharded(mixed)
    beside = Bystanders(run, tmp_path / "outside")
    inside = Bystanders(mixed, tmp_path / "outside-2", tag="-inside")

    io.remove_checkpoint(str(clean))
    assert not clean.exists()  # nothing but its own files: the folder goes too
    with pytest.warns(UserWarning, match=r"not the folder: it also holds README-inside\.md, shared-inside"):
        io.remove_checkpoint(str(mixed))
    assert sorted(os.listdir(mixed)) == ["README-inside.md", "shared-inside"]
    beside.check()
    inside.check()


def test_saving_over_a_folder_with_foreign_files_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = run / "last.ckpt"
    _sharded(path, step=1)
    near = Bystanders(path, tmp_path / "outside")
    before = _bytes(path)
    with pytest.raises(CheckpointError, match=r"Did not replace the folder .*last\.ckpt.*README\.md, shared"):
        DistributedCheckpointIO().save_checkpoint(_checkpoint(2), str(path))
    assert _bytes(path) == before  # the old checkpoint as it was, the user's files with it
    assert DistributedCheckpointIO().load_checkpoint(str(path))["global_step"] == 1
    assert [p.name for p in run.iterdir()] == ["last.ckpt"]  # no temporary left behind
    near.check()


def test_linking_over_a_folder_with_foreign_files_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    io = DistributedCheckpointIO()
    _sharded(run / "a.ckpt", step=1)
    _sharded(run / "last.ckpt", step=2)
    near = Bystanders(run / "last.ckpt", tmp_path / "outside")
    with pytest.raises(CheckpointError, match="Did not replace the folder"):
        io.link(str(run / "a.ckpt"), str(run / "last.ckpt"))
    assert io.load_checkpoint(str(run / "last.ckpt"))["global_step"] == 2
    near.check()
    # Without them the folder is ours alone, and the link replaces it.
    near.file.unlink()
    near.link.unlink()
    io.link(str(run / "a.ckpt"), str(run / "last.ckpt"))
    assert (run / "last.ckpt").is_symlink() and io.load_checkpoint(str(run / "last.ckpt"))["global_step"] == 1


def test_object_store_link_and_removal_touch_only_own_files() -> None:
    """memory:// stands in for an object store (no rename, no symlinks): copies and removals by name."""
    fs = fsspec.filesystem("memory")
    root = f"memory://destructive-{time.time_ns()}"
    io = DistributedCheckpointIO()
    io.save_checkpoint(_checkpoint(1), f"{root}/a.ckpt")
    io.save_checkpoint(_checkpoint(2), f"{root}/last.ckpt")
    for folder in ("a.ckpt", "last.ckpt"):
        fs.pipe_file(f"{root}/{folder}/README.md", UNRELATED)
    fs.pipe_file(f"{root}/notes.txt", UNRELATED)
    io.link(f"{root}/a.ckpt", f"{root}/last.ckpt")  # server-side copy over the old folder
    assert io.load_checkpoint(f"{root}/last.ckpt")["global_step"] == 1
    assert fs.cat_file(f"{root}/last.ckpt/README.md") == UNRELATED  # kept, and a's copy not carried over
    with pytest.warns(UserWarning, match="it also holds README.md"):
        io.remove_checkpoint(f"{root}/a.ckpt")
    assert [p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/a.ckpt")] == ["README.md"]
    assert fs.cat_file(f"{root}/a.ckpt/README.md") == UNRELATED
    assert fs.cat_file(f"{root}/notes.txt") == UNRELATED


# ---------------------------------------------------------------------- temporaries, async, frozen blobs


def test_abandoned_temporaries_go_without_following_links(tmp_path: Path) -> None:
    run = tmp_path / "run"
    near = Bystanders(run, tmp_path / "outside")
    abandoned = Path(temporary_path(str(run / "x.ckpt")))  # a folder a killed writer left
    abandoned.mkdir()
    (abandoned / "__0_0.distcp").write_bytes(b"torn")
    (abandoned / "into-outside").symlink_to(tmp_path / "outside", target_is_directory=True)
    named_like_ours = Path(temporary_path(str(run / "y.ckpt")))  # a link with our pattern's name
    named_like_ours.symlink_to(tmp_path / "outside", target_is_directory=True)
    old = time.time() - 60
    for path in (abandoned, named_like_ours):
        os.utime(path, (old, old), follow_symlinks=False)
    assert remove_abandoned_temporaries(str(run)) == [abandoned.name]
    assert not abandoned.exists() and named_like_ours.is_symlink()
    near.check()


def test_async_removal_leaves_neighbours(tmp_path: Path) -> None:
    run = tmp_path / "run"
    io = AsyncCheckpointIO()
    io.save_checkpoint(_checkpoint(), str(run / "a.ckpt"))
    io.wait()
    near = Bystanders(run, tmp_path / "outside")
    io.remove_checkpoint(str(run / "a.ckpt"))
    io.teardown()
    assert not (run / "a.ckpt").exists()
    near.check()


def test_frozen_blob_retention_removes_only_blobs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    io = FrozenBlobCheckpointIO()
    a = _checkpoint(1)
    a[KEY_FROZEN_PARAMETERS] = ["w"]
    io.save_checkpoint(a, str(run / "a.ckpt"))
    (blob,) = [p for p in (run / "blobs").iterdir() if p.is_file()]
    beside = Bystanders(run, tmp_path / "outside")
    in_store = Bystanders(run / "blobs", tmp_path / "outside-2", tag="-store")
    # A symlink named like a blob (a sha256), pointing at a file outside: never a blob of ours.
    fake = run / "blobs" / ("f" * 64)
    fake.symlink_to(in_store.outside_file)
    io.remove_checkpoint(str(run / "a.ckpt"))
    assert not (run / "a.ckpt").exists() and not blob.exists()
    assert fake.is_symlink() and fake.read_bytes() == OUTSIDE
    beside.check()
    in_store.check()


# ---------------------------------------------------------------------- callbacks and loggers


def test_model_checkpoint_retention_and_a_users_last_link(tmp_path: Path) -> None:
    dirpath = tmp_path / "ckpts"
    near = Bystanders(dirpath, tmp_path / "outside")
    # The user's own last.ckpt: a link to a file outside. It is not the callback's to replace or delete.
    (dirpath / "last.ckpt").symlink_to(near.outside_file)
    seed_everything(0, verbose=False)
    callback = ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = quiet_trainer(max_steps=3, enable_checkpointing=True, callbacks=[callback])
    trainer.fit(BoringModel(), random_loader(16, 4, batch_size=4))
    names = sorted(p.name for p in dirpath.iterdir())
    assert names == ["README.md", "epoch=0-step=3.ckpt", "last-v1.ckpt", "last.ckpt", "shared"]
    assert os.readlink(dirpath / "last.ckpt") == str(near.outside_file)
    near.check()


def test_tensorboard_spool_removal_does_not_follow_links(tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("tensorboard")
    from trainer_core.loggers import TensorBoardLogger

    spools = tmp_path / "tmp"
    spools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))
    near = Bystanders(spools, tmp_path / "outside")
    logger = TensorBoardLogger(f"memory://tb-{time.time_ns()}", name="run")
    logger.log_metrics({"loss": 1.0}, step=0)
    (spool,) = [p for p in spools.iterdir() if p.name.startswith("trainer-core-tensorboard-")]
    (spool / "into-outside").symlink_to(tmp_path / "outside", target_is_directory=True)
    logger.finalize("success")
    assert not spool.exists()
    near.check()
