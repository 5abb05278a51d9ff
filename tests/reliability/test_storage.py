"""Part 2 of the reliability suite: storage that fails mid-save or returns short reads.

The storage is ``faulty://`` (tests/helpers/faulty_fs.py): real files on local disk behind an object
store's interface, failing on request. For each kind of save (one file, a sharded DCP folder, a
background write) every failing save must raise one clear ``CheckpointError`` naming the path and
leave the previous checkpoint loadable and still picked by ``ckpt_path="last"``; every failing load
must raise one and leave the model and optimizer exactly as they were.

Local-disk faults are covered in tests/checkpoint/test_io.py (a real EFBIG in the middle of a write,
an unpicklable value, an S3 upload cut off at 12 MB).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import faulty_fs
import pytest
import torch
from boring import quiet_trainer
from kill_job import Wide, loader

from trainer_core import Trainer, seed_everything
from trainer_core.checkpoint import FORMAT_VERSION, KEY_FORMAT_VERSION, KEY_STATE_DICT
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io import AsyncCheckpointIO, DistributedCheckpointIO, TorchCheckpointIO

faulty_fs.register()

SAVE_FAULTS = {
    "write_fails_after_64KiB": {"fail_write_after": 64 * 1024},
    "write_fails_at_first_byte": {"fail_write_after": 0},
    "publish_fails": {"fail_commit": True},
    "rename_fails": {"fail_rename": True},
}
# What each IO must say: the path, the cause, and that nothing else changed.
CAUSE = {
    "write_fails_after_64KiB": "No space left on device",
    "write_fails_at_first_byte": "No space left on device",
    "publish_fails": "refused to publish",
    "rename_fails": "refused the rename",
}


def _io(kind: str, faults: dict[str, Any]) -> Any:
    if kind == "monolithic":
        return TorchCheckpointIO(storage_options=faults)
    if kind == "sharded":
        return DistributedCheckpointIO(storage_options=faults)
    return AsyncCheckpointIO(TorchCheckpointIO(storage_options=faults))


def _trained(io: Any, steps: int = 3) -> tuple[Trainer, Wide]:
    seed_everything(0, verbose=False)
    model = Wide()
    trainer = quiet_trainer(max_steps=steps, plugins=[io])
    trainer.fit(model, loader())
    return trainer, model


def _save(trainer: Trainer, url: str) -> None:
    trainer.save_checkpoint(url)
    wait = getattr(trainer.plugin.checkpoint_io, "wait", None)
    if wait is not None:
        wait()  # a background write's error surfaces here (or at the next save / the end of fit)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    ("kind", "fault"),
    # A single file is published by committing its upload, a DCP folder by renaming its .metadata.
    [
        (kind, fault)
        for kind in ("monolithic", "async")
        for fault in sorted(SAVE_FAULTS)
        if fault != "rename_fails"
    ]
    + [("sharded", fault) for fault in sorted(SAVE_FAULTS) if fault != "publish_fails"],
)
def test_failed_save_raises_and_keeps_the_previous_checkpoint(kind: str, fault: str, tmp_path: Path) -> None:
    folder = f"faulty://{tmp_path}/ckpts"
    trainer, model = _trained(_io(kind, {}))
    _save(trainer, f"{folder}/epoch=0-step=3.ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    # Train on, then save the newer state through storage that fails.
    trainer.plugin.checkpoint_io = _io(kind, SAVE_FAULTS[fault])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    newer = f"{folder}/epoch=0-step=6.ckpt"
    with pytest.raises(CheckpointError, match=re.escape("step=6.ckpt") + ".*" + CAUSE[fault]) as error:
        _save(trainer, newer)
    assert "Traceback" not in str(error.value)

    clean = _io(kind, {})
    assert clean.list_complete(folder) == [f"{folder}/epoch=0-step=3.ckpt"]  # the failed one is never picked
    previous = clean.load_checkpoint(clean.latest_complete(folder))
    for name, tensor in saved.items():
        assert torch.equal(previous["state_dict"][name], tensor), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["monolithic", "sharded"])
def test_short_reads_fail_the_load_and_leave_the_model_untouched(kind: str, tmp_path: Path) -> None:
    url = f"faulty://{tmp_path}/ckpts/last.ckpt"
    trainer, _ = _trained(_io(kind, {}), steps=4)
    _save(trainer, url)

    seed_everything(1, verbose=False)
    fresh = Wide()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    resumed = quiet_trainer(max_steps=8, plugins=[_io(kind, {"short_reads": True})])
    with pytest.raises(CheckpointError, match=re.escape(url) + ".*fewer bytes than asked for"):
        resumed.fit(fresh, loader(), ckpt_path=url)
    assert resumed.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    # The file itself was fine: read without the fault, it resumes.
    _io(kind, {}).load_checkpoint(url)


def test_a_partial_upload_is_never_visible(tmp_path: Path) -> None:
    """A write that fails leaves no object, no marker and no staging file a reader could see."""
    trainer, _ = _trained(_io("monolithic", {}))
    folder = f"faulty://{tmp_path}/ckpts"
    trainer.plugin.checkpoint_io = _io("monolithic", {"fail_write_after": 100_000})
    with pytest.raises(CheckpointError):
        _save(trainer, f"{folder}/a.ckpt")
    ckpts = tmp_path / "ckpts"
    assert not ckpts.exists() or sorted(p.name for p in ckpts.iterdir()) == []


# ---------------------------------------------------------------------- what a killed writer leaves
def _killed_mid_save(io: Any, checkpoint: dict[str, Any], url: str, folder: Path) -> str:
    """Fork a writer, SIGKILL it once its temporary exists; return the temporary's name."""
    before = set(os.listdir(folder))
    pid = os.fork()
    if pid == 0:
        try:
            io.save_checkpoint(checkpoint, url)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    new: set[str] = set()
    while not new and time.monotonic() < deadline:
        new = {n for n in set(os.listdir(folder)) - before if n.startswith(".")}
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert len(new) == 1, f"no temporary appeared: {sorted(os.listdir(folder))}"
    return new.pop()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["monolithic", "sharded"])
def test_next_save_removes_what_a_killed_writer_left_and_nothing_else(kind: str, tmp_path: Path) -> None:
    io = _io(kind, {})
    big = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        "epoch": 0,
        "global_step": 0,
        KEY_STATE_DICT: {"w": torch.randn(8_000_000)},  # 32 MB: the writer is killed mid-write
    }
    io.save_checkpoint(big, str(tmp_path / "a.ckpt"))
    leftover = _killed_mid_save(io, big, str(tmp_path / "b.ckpt"), tmp_path)
    assert re.fullmatch(r"\.b\.ckpt\.tmp-[0-9a-f]+", leftover)
    # Not ours: other names, and a temporary a live writer holds (locked, as our writers do).
    others = ["notes.tmp-123abc", ".notes.tmp-not-hex", "b.ckpt.tmp-0123456789ab"]
    for name in others:
        (tmp_path / name).write_text("someone else's")
    live = tmp_path / ".c.ckpt.tmp-0123456789ab"
    with open(live, "wb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        old = time.time() - 60
        for name in [leftover, live.name, *others]:
            os.utime(tmp_path / name, (old, old))  # all old enough to be candidates

        io.save_checkpoint({**big, KEY_STATE_DICT: {"w": torch.zeros(4)}}, str(tmp_path / "d.ckpt"))

        left = set(os.listdir(tmp_path))
        assert leftover not in left
        assert {live.name, *others, "a.ckpt", "d.ckpt"} <= left
    assert io.list_complete(str(tmp_path))[-1] == str(tmp_path / "d.ckpt")


def test_a_rename_that_fails_on_local_disk_leaves_no_temporary(tmp_path: Path) -> None:
    """The local publish step (rename over the target) fails for real: the target is a folder."""
    io = TorchCheckpointIO()
    small = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        "epoch": 0,
        "global_step": 1,
        KEY_STATE_DICT: {"w": torch.ones(3)},
    }
    io.save_checkpoint(small, str(tmp_path / "a.ckpt"))
    (tmp_path / "b.ckpt").mkdir()
    (tmp_path / "b.ckpt" / "notes.txt").write_text("someone's folder")

    with pytest.raises(
        CheckpointError, match=re.escape(str(tmp_path / "b.ckpt")) + ".*(Is a directory|Directory not empty)"
    ):
        io.save_checkpoint({**small, "global_step": 2}, str(tmp_path / "b.ckpt"))

    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]
    assert (tmp_path / "b.ckpt" / "notes.txt").read_text() == "someone's folder"
    assert io.load_checkpoint(io.latest_complete(str(tmp_path)))["global_step"] == 1
