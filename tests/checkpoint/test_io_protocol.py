"""The publish protocol ``CheckpointIO`` owns: completeness, linking, wrapping, and a light import.

What a user relies on: ``save_last="link"`` makes ``last.ckpt`` a complete checkpoint that shows
the newest one, replaced in one step so a reader never finds it missing or half-made, and a failed
link leaves the previous ``last.ckpt``; a folder counts as a checkpoint only when the files its IO
names are there; a wrapping IO (the asynchronous one) behaves as the IO it wraps; and
``import trainer_core`` does not pay for ``torch.distributed.checkpoint`` until it is used.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import fsspec
import pytest
import torch
import warm_python

from trainer_core.checkpoint import (
    FORMAT_VERSION,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_STATE_DICT,
)
from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike
from trainer_core.plugins.io import (
    COMMIT_MARKER_SUFFIX,
    AsyncCheckpointIO,
    CheckpointIO,
    DistributedCheckpointIO,
    TorchCheckpointIO,
    WrappingCheckpointIO,
)
from trainer_core.plugins.io.checkpoint_io import is_temporary_name, read_commit_marker


def _checkpoint(step: int) -> dict[str, Any]:
    return {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_EPOCH: 0,
        KEY_GLOBAL_STEP: step,
        KEY_STATE_DICT: OrderedDict(weight=torch.full((4, 3), float(step)), bias=torch.arange(3.0) + step),
    }


def _memory_root() -> str:
    return f"memory://io-protocol-{uuid.uuid4().hex[:12]}"


def _step(io: CheckpointIO, path: PathLike) -> int:
    return int(io.load_checkpoint(path)[KEY_GLOBAL_STEP])


# ---------------------------------------------------------------------------------------------- local disk


def test_link_on_local_disk_is_a_relative_symlink_published_in_one_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = TorchCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step), tmp_path / f"step={step}.ckpt")
    last = tmp_path / "last.ckpt"
    io.link(tmp_path / "step=1.ckpt", last)
    assert os.readlink(last) == "step=1.ckpt"  # relative: the folder can move
    assert io.is_complete(last) and _step(io, last) == 1

    # The new link is made under a temporary name and renamed over the old one: at every moment
    # last.ckpt is the old link or the new one, never missing.
    renames = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        renames.append((os.path.basename(src), os.readlink(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    io.link(tmp_path / "step=2.ckpt", last)
    monkeypatch.undo()
    assert len(renames) == 1 and is_temporary_name(renames[0][0]) and renames[0][1] == "step=1.ckpt"
    assert os.readlink(last) == "step=2.ckpt" and _step(io, last) == 2
    assert {p.name for p in tmp_path.iterdir()} == {"step=1.ckpt", "step=2.ckpt", "last.ckpt"}


def test_a_failed_link_leaves_the_previous_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = TorchCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step), tmp_path / f"step={step}.ckpt")
    last = tmp_path / "last.ckpt"
    io.link(tmp_path / "step=1.ckpt", last)

    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.link(tmp_path / "step=2.ckpt", last)
    monkeypatch.undo()
    assert os.readlink(last) == "step=1.ckpt" and _step(io, last) == 1
    assert {p.name for p in tmp_path.iterdir()} == {"step=1.ckpt", "step=2.ckpt", "last.ckpt"}

    # A checkpoint that is not complete (a writer's temporary, or missing) is never linked.
    temporary = tmp_path / ".step=3.ckpt.tmp-0123456789ab"
    temporary.write_bytes(b"half a checkpoint")
    for incomplete in (temporary, tmp_path / "missing.ckpt"):
        with pytest.raises(
            CheckpointError, match=f"{re.escape(incomplete.name)} is not a complete checkpoint"
        ):
            io.link(incomplete, last)
    assert os.readlink(last) == "step=1.ckpt"


def test_saving_in_full_over_a_link_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1), tmp_path / "step=1.ckpt")
    last = tmp_path / "last.ckpt"
    io.link(tmp_path / "step=1.ckpt", last)
    io.save_checkpoint(_checkpoint(5), last)
    assert not last.is_symlink() and _step(io, last) == 5
    assert _step(io, tmp_path / "step=1.ckpt") == 1


def test_without_symlinks_a_link_is_a_copy_published_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1), tmp_path / "step=1.ckpt")

    def no_symlinks(*args: Any, **kwargs: Any) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    io.link(tmp_path / "step=1.ckpt", tmp_path / "last.ckpt")
    last = tmp_path / "last.ckpt"
    assert not last.is_symlink() and last.read_bytes() == (tmp_path / "step=1.ckpt").read_bytes()
    assert io.is_complete(last) and _step(io, last) == 1
    assert {p.name for p in tmp_path.iterdir()} == {"step=1.ckpt", "last.ckpt"}


# ---------------------------------------------------------------------------------------------- object stores


def test_link_on_an_object_store_is_a_copy_with_its_commit_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    root = _memory_root()
    io = TorchCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step), f"{root}/step={step}.ckpt")
    last = f"{root}/last.ckpt"
    io.link(f"{root}/step=1.ckpt", last)
    fs, last_path = fsspec.core.url_to_fs(last)
    marker = read_commit_marker(fs, last_path)
    assert marker is not None and marker["size"] == fs.size(last_path)
    assert io.is_complete(last) and _step(io, last) == 1
    assert io.latest_complete(root) == last  # published after both saves

    # A copy that fails leaves the previous last.ckpt, still complete.
    def broken_copy(*args: Any, **kwargs: Any) -> None:
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(fs, "copy", broken_copy)
    with pytest.raises(ConnectionResetError):
        io.link(f"{root}/step=2.ckpt", last)
    monkeypatch.undo()
    assert io.is_complete(last) and _step(io, last) == 1

    io.link(f"{root}/step=2.ckpt", last)
    assert io.is_complete(last) and _step(io, last) == 2
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(fs._strip_protocol(root), detail=False)) == [
        "last.ckpt",
        "last.ckpt" + COMMIT_MARKER_SUFFIX,
        "step=1.ckpt",
        "step=1.ckpt" + COMMIT_MARKER_SUFFIX,
        "step=2.ckpt",
        "step=2.ckpt" + COMMIT_MARKER_SUFFIX,
    ]


@pytest.mark.timeout(120)
def test_link_on_s3_is_a_server_side_copy(s3_url: str) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(3), f"{s3_url}/step=3.ckpt")
    io.link(f"{s3_url}/step=3.ckpt", f"{s3_url}/last.ckpt")
    fs, root = fsspec.core.url_to_fs(s3_url)
    assert fs.size(f"{root}/last.ckpt") == fs.size(f"{root}/step=3.ckpt")
    assert io.is_complete(f"{s3_url}/last.ckpt") and _step(io, f"{s3_url}/last.ckpt") == 3


# ---------------------------------------------------------------------------------------------- sharded folders


def test_link_of_a_sharded_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = DistributedCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step), tmp_path / f"step={step}.ckpt")
    # Local disk: a symlink to the folder, which reads as the folder.
    last = tmp_path / "last.ckpt"
    io.link(tmp_path / "step=1.ckpt", last)
    assert os.readlink(last) == "step=1.ckpt" and io.is_complete(last) and _step(io, last) == 1
    # A full save over the link replaces the link, never the folder it points at.
    io.save_checkpoint(_checkpoint(7), last)
    assert not last.is_symlink() and _step(io, last) == 7 and _step(io, tmp_path / "step=1.ckpt") == 1
    # And a link over that real folder replaces it whole.
    io.link(tmp_path / "step=2.ckpt", last)
    assert os.readlink(last) == "step=2.ckpt" and _step(io, last) == 2
    assert {p.name for p in tmp_path.iterdir()} == {"step=1.ckpt", "step=2.ckpt", "last.ckpt"}

    # An object store: a copy whose commit files come last, so it is never complete half-made.
    root = _memory_root()
    io.save_checkpoint(_checkpoint(4), f"{root}/step=4.ckpt")
    io.save_checkpoint(_checkpoint(9), f"{root}/last.ckpt")  # an older, full last.ckpt
    fs, _ = fsspec.core.url_to_fs(root)
    copied: list[tuple[str, bool]] = []
    real_copy = fs.copy

    def spy(src: str, dst: str, **kwargs: Any) -> None:
        copied.append((src.rsplit("/", 1)[-1], io.is_complete(f"{root}/last.ckpt")))
        real_copy(src, dst, **kwargs)

    monkeypatch.setattr(fs, "copy", spy)
    io.link(f"{root}/step=4.ckpt", f"{root}/last.ckpt")
    monkeypatch.undo()
    assert [name for name, _ in copied[-2:]] == ["trainer_state.pt", ".metadata"]
    assert not any(complete for _, complete in copied)  # the old last.ckpt went first, whole
    assert io.is_complete(f"{root}/last.ckpt") and _step(io, f"{root}/last.ckpt") == 4
    # Any IO reads a sharded folder whole, so the default IO counts it complete too.
    assert TorchCheckpointIO().is_complete(f"{root}/last.ckpt")


class _FolderIO(CheckpointIO):
    """A user's IO that writes a checkpoint as a folder: the payload, then a ``DONE`` file."""

    def folder_commit_files(self) -> tuple[str, ...]:
        return ("payload.pt", "DONE")

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        fs, fs_path = self._resolve(path)
        fs.makedirs(fs_path, exist_ok=True)
        with fs.open(f"{fs_path}/payload.pt", "wb") as f:
            torch.save(checkpoint, f)
        fs.pipe(f"{fs_path}/DONE", b"")

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None) -> dict[str, Any]:
        fs, fs_path = self._resolve(path)
        with fs.open(f"{fs_path}/payload.pt", "rb") as f:
            return torch.load(f, weights_only=True)

    def remove_checkpoint(self, path: PathLike) -> None:
        fs, fs_path = self._resolve(path)
        fs.rm(fs_path, recursive=True)


def test_a_subclass_names_the_files_that_complete_its_folders() -> None:
    root = _memory_root()
    io = _FolderIO()
    io.save_checkpoint(_checkpoint(1), f"{root}/a.ckpt")
    time.sleep(0.01)
    io.save_checkpoint(_checkpoint(2), f"{root}/b.ckpt")
    fs, _ = fsspec.core.url_to_fs(root)
    fs.rm(f"{fs._strip_protocol(root)}/b.ckpt/DONE")  # b's writer was killed before its last file
    assert io.is_complete(f"{root}/a.ckpt") and not io.is_complete(f"{root}/b.ckpt")
    assert io.list_complete(root) == [f"{root}/a.ckpt"]
    # An IO that writes files only never takes a folder for a checkpoint.
    assert not TorchCheckpointIO().is_complete(f"{root}/a.ckpt")

    io.link(f"{root}/a.ckpt", f"{root}/last.ckpt")
    assert io.latest_complete(root) == f"{root}/last.ckpt" and _step(io, f"{root}/last.ckpt") == 1
    with pytest.raises(CheckpointError, match=r"b\.ckpt is not a complete checkpoint"):
        io.link(f"{root}/b.ckpt", f"{root}/last.ckpt")


# ---------------------------------------------------------------------------------------------- wrapping


def _recorded(name: str) -> Any:
    def method(self: _RecordingIO, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(name)
        return getattr(TorchCheckpointIO, name)(self, *args, **kwargs)

    return method


class _RecordingIO(TorchCheckpointIO):
    """Records which of its public methods were called from outside (a wrapper forwarding to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    load_checkpoint = _recorded("load_checkpoint")
    remove_checkpoint = _recorded("remove_checkpoint")
    is_complete = _recorded("is_complete")
    latest_complete = _recorded("latest_complete")
    saved_at = _recorded("saved_at")
    link = _recorded("link")


def test_a_wrapping_io_forwards_what_it_does_not_change(tmp_path: Path) -> None:
    inner = _RecordingIO()
    wrapper = WrappingCheckpointIO(inner)
    assert AsyncCheckpointIO(inner).unwrapped is inner
    assert AsyncCheckpointIO(AsyncCheckpointIO(inner)).unwrapped is inner
    assert inner.unwrapped is inner and wrapper.unwrapped is inner and wrapper.checkpoint_io is inner

    wrapper.save_checkpoint(_checkpoint(1), tmp_path / "a.ckpt")
    assert _step(wrapper, tmp_path / "a.ckpt") == 1
    wrapper.link(tmp_path / "a.ckpt", tmp_path / "last.ckpt")
    assert wrapper.is_complete(tmp_path / "last.ckpt")
    assert wrapper.latest_complete(tmp_path) is not None
    assert wrapper.saved_at(tmp_path / "a.ckpt") == os.stat(tmp_path / "a.ckpt").st_mtime
    wrapper.remove_checkpoint(tmp_path / "last.ckpt")
    assert inner.calls == [
        "load_checkpoint",
        "link",
        "is_complete",
        "latest_complete",
        "saved_at",
        "remove_checkpoint",
    ]
    assert wrapper.folder_commit_files() == inner.folder_commit_files()
    wrapper.wait()  # a synchronous IO has nothing pending


class _SlowIO(TorchCheckpointIO):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail = fail

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any = None
    ) -> None:
        self.release.wait(timeout=30)
        if self.fail:
            raise OSError(28, "No space left on device")
        super().save_checkpoint(checkpoint, path, storage_options)


def test_async_link_follows_the_write_it_shows_without_blocking(tmp_path: Path) -> None:
    inner = _SlowIO()
    io = AsyncCheckpointIO(inner)
    try:
        io.save_checkpoint(_checkpoint(1), tmp_path / "a.ckpt")
        io.link(tmp_path / "a.ckpt", tmp_path / "last.ckpt")  # returns while the write is pending
        assert not os.path.lexists(tmp_path / "last.ckpt")
        inner.release.set()
        io.wait()
        assert os.readlink(tmp_path / "last.ckpt") == "a.ckpt" and _step(io, tmp_path / "last.ckpt") == 1
    finally:
        inner.release.set()
        io.teardown()

    failing = _SlowIO(fail=True)
    io = AsyncCheckpointIO(failing)
    failing.release.set()
    io.save_checkpoint(_checkpoint(2), tmp_path / "b.ckpt")
    io.link(tmp_path / "b.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(
        CheckpointError, match=r"background write of the checkpoint .*b\.ckpt failed.*No space"
    ):
        io.wait()
    io.teardown()
    assert os.readlink(tmp_path / "last.ckpt") == "a.ckpt"  # the failed write was not linked


# ---------------------------------------------------------------------------------------------- import cost


def test_import_does_not_load_distributed_checkpoint(tmp_path: Path) -> None:
    """``torch.distributed.checkpoint`` and DTensor (most of a second) load only when sharded IO is used."""
    code = f"""
import sys
import torch
import trainer_core
from trainer_core.checkpoint import FORMAT_VERSION
from trainer_core.plugins.io import TorchCheckpointIO

heavy = ("torch.distributed.checkpoint", "torch.distributed.tensor")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
# Saving and picking single-file checkpoints does not need it either.
io = TorchCheckpointIO()
checkpoint = {{"format_version": FORMAT_VERSION, "epoch": 0, "global_step": 1, "state_dict": {{"w": torch.ones(2)}}}}
io.save_checkpoint(checkpoint, {str(tmp_path / "a.ckpt")!r})
assert io.latest_complete({str(tmp_path)!r}).endswith("a.ckpt")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]

from trainer_core.plugins import DistributedCheckpointIO
from trainer_core.plugins.io import DistributedCheckpointIO as same

assert same is DistributedCheckpointIO and "torch.distributed.checkpoint" in sys.modules
"""
    result = subprocess.run(
        [warm_python.REAL_EXECUTABLE, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "marker",
    [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b'{"writer": ["x"], "size": "big", "saved_at": "soon"}'],
    ids=["nested-100k-deep", "not-utf8", "wrong-types"],
)
def test_a_damaged_commit_marker_vouches_for_nothing(marker: bytes) -> None:
    """A marker nested 100,000 deep, not UTF-8 or of the wrong types marks its object incomplete; "last" goes on."""
    root = _memory_root()
    io = TorchCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(_checkpoint(step), f"{root}/step={step}.ckpt")
    fs, path = fsspec.core.url_to_fs(f"{root}/step=2.ckpt.complete")
    fs.pipe_file(path, marker)
    assert not io.is_complete(f"{root}/step=2.ckpt")
    assert io.list_complete(root) == [f"{root}/step=1.ckpt"]
