"""Object stores at speed, against a real S3 server (moto on loopback) and real files.

What a user relies on: a checkpoint on ``s3://`` goes up as several parts at once and comes down
as several ranges at once, byte for byte what a local save writes; memory stays bounded by the
parts in flight; an upload interrupted mid-way (a part that fails, a writer killed) publishes
nothing, leaves no multipart upload behind and the previous checkpoint still loads; a download
that fails mid-way loads nothing and leaves no file; retention never deletes the last complete
checkpoint when a new save fails.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from trainer_core.errors import CheckpointError
from trainer_core.plugins.io.checkpoint_io import read_commit_marker
from trainer_core.plugins.io.distributed_io import SHARD_IO_THREADS, DistributedCheckpointIO
from trainer_core.plugins.io.object_store import TransferError, download_to_local
from trainer_core.plugins.io.torch_io import TorchCheckpointIO

MiB = 2**20


def _checkpoint(step: int, numel: int = 5 * MiB // 4 * 4) -> dict[str, Any]:
    """A Trainer-shaped checkpoint with ``numel`` float32 values (20 MiB by default: 3 parts of 8 MiB)."""
    generator = torch.Generator().manual_seed(step)
    return {
        "format_version": 1,
        "epoch": 0,
        "global_step": step,
        "state_dict": {"w": torch.randn(numel, generator=generator), "b": torch.arange(7.0)},
        "loops": {},
        "optimizer_states": [],
    }


def _recording_s3(name: str, fail_part: int = 0, fail_range: int = 0, fail_key: str = "") -> type:
    """An s3fs filesystem that records how many transfers run at once, and can fail one of them.

    Everything still goes to the real server; only the counting (and the injected failure) is ours.
    """
    from s3fs import S3FileSystem

    class RecordingS3FileSystem(S3FileSystem):
        protocol = (name,)
        lock = threading.Lock()
        active = {"upload_part": 0, "get_object": 0}
        peak = {"upload_part": 0, "get_object": 0}
        calls = {"upload_part": 0, "get_object": 0}
        bytes_in_flight = 0
        peak_bytes_in_flight = 0
        fail_checkpoint_puts = False  # set to fail every upload of a .ckpt object from then on

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            cls = type(self)
            if method in ("put_object", "upload_part"):
                key = kwargs.get("Key", "")
                if (cls.fail_checkpoint_puts and key.endswith(".ckpt")) or (
                    fail_key and key.endswith(fail_key)
                ):
                    raise ConnectionResetError("connection reset by peer")
            ranged = method == "get_object" and "Range" in kwargs
            if method != "upload_part" and not ranged:
                return await super()._call_s3(method, *args, **kwargs)
            size = memoryview(kwargs["Body"]).nbytes if method == "upload_part" else 0
            with cls.lock:
                cls.calls[method] += 1
                number = cls.calls[method]
                cls.active[method] += 1
                cls.peak[method] = max(cls.peak[method], cls.active[method])
                cls.bytes_in_flight += size
                cls.peak_bytes_in_flight = max(cls.peak_bytes_in_flight, cls.bytes_in_flight)
            try:
                if (method == "upload_part" and number == fail_part) or (ranged and number == fail_range):
                    raise ConnectionResetError("connection reset by peer")
                return await super()._call_s3(method, *args, **kwargs)
            finally:
                with cls.lock:
                    cls.active[method] -= 1
                    cls.bytes_in_flight -= size

        # s3fs's synchronous ``call_s3`` (used by its own files) wraps the base class's coroutine.
        call_s3 = fsspec.asyn.sync_wrapper(_call_s3)

    fsspec.register_implementation(name, RecordingS3FileSystem, clobber=True)
    return RecordingS3FileSystem


def _uploads(s3_server: Any, url: str) -> list[dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    key = path.split("/", 1)[1]
    return [u for u in fs.list_multipart_uploads(s3_server.bucket) if u["Key"] == key]


def test_parallel_upload_and_download_match_a_local_save_byte_for_byte(s3_server, s3_url, tmp_path) -> None:
    recording = _recording_s3("recs3")
    io = TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=4)
    checkpoint = _checkpoint(step=3)
    url = f"{s3_url}/big.ckpt"
    io.save_checkpoint(checkpoint, url.replace("s3://", "recs3://"))
    TorchCheckpointIO().save_checkpoint(checkpoint, tmp_path / "local.ckpt")

    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    local_bytes = (tmp_path / "local.ckpt").read_bytes()
    assert fs.cat(path) == local_bytes  # the same file torch.save writes to disk
    # 20 MiB in parts of 8 MiB: 3 parts, of which at least 2 were in flight at once; never more
    # than 4 parts' bytes held by the upload.
    assert recording.calls["upload_part"] == 3 and recording.peak["upload_part"] >= 2
    assert recording.peak_bytes_in_flight <= 4 * 8 * MiB
    assert read_commit_marker(fs, path)["size"] == len(local_bytes) and io.is_complete(url)
    assert _uploads(s3_server, url) == []

    loaded = TorchCheckpointIO(
        storage_options=s3_server.storage_options, transfer_concurrency=4
    ).load_checkpoint(url.replace("s3://", "recs3://"))
    assert recording.calls["get_object"] >= 2 and recording.peak["get_object"] >= 2  # 16 MiB ranges
    assert loaded["global_step"] == 3
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"])
    # The sequential path (the switch the benchmark compares against) reads the same checkpoint.
    sequential = TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=1)
    assert torch.equal(sequential.load_checkpoint(url)["state_dict"]["w"], checkpoint["state_dict"]["w"])


@pytest.mark.parametrize("source", ["s3", "memory"])
def test_download_to_local_writes_every_range_at_its_offset(s3_server, s3_url, tmp_path, source) -> None:
    data = os.urandom(5 * MiB + 12345)  # not a multiple of the range size: a short last range
    if source == "s3":
        fs, path = fsspec.core.url_to_fs(f"{s3_url}/blob.bin", **s3_server.storage_options)
    else:
        fs, path = fsspec.filesystem("memory"), f"/dl-{os.urandom(4).hex()}/blob.bin"
    fs.pipe(path, data)
    target = tmp_path / "blob.bin"
    assert download_to_local(fs, path, str(target), chunk_size=MiB, concurrency=3) == len(data)
    assert target.read_bytes() == data


@pytest.mark.parametrize("concurrency", [4, 1], ids=["parallel", "sequential"])
def test_interrupted_upload_publishes_nothing_and_aborts(s3_server, s3_url, concurrency: int) -> None:
    io = TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=concurrency)
    url = f"{s3_url}/last.ckpt"
    io.save_checkpoint(_checkpoint(step=1, numel=1000), url)
    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    old_marker = read_commit_marker(fs, path)

    _recording_s3("fails3", fail_part=2)  # the second of three parts fails while the others are in flight
    with pytest.raises(CheckpointError) as raised:
        io.save_checkpoint(_checkpoint(step=2), url.replace("s3://", "fails3://"))
    message = str(raised.value)
    assert "last.ckpt" in message and "connection reset" in message and "unchanged" in message

    assert _uploads(s3_server, url) == []  # the multipart upload was aborted
    assert read_commit_marker(fs, path) == old_marker  # no new marker
    assert io.is_complete(url) and io.latest_complete(s3_url) == url
    assert io.load_checkpoint(url)["global_step"] == 1


def _save_then_exit(io: TorchCheckpointIO, checkpoint: dict[str, Any], url: str) -> None:
    """The forked child's whole life: one save, then exit without running pytest's cleanup."""
    try:
        io.save_checkpoint(checkpoint, url)
    finally:
        os._exit(0)


@pytest.mark.timeout(60)
def test_writer_killed_mid_upload_leaves_previous_checkpoint_and_next_save_cleans_up(
    s3_server, s3_url
) -> None:
    io = TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=2)
    url = f"{s3_url}/last.ckpt"
    io.save_checkpoint(_checkpoint(step=1, numel=1000), url)
    big = _checkpoint(
        step=2, numel=10 * MiB
    )  # 40 MiB: five parts, the writer is killed after the first starts
    pid = os.fork()
    if pid == 0:
        _save_then_exit(io, big, url)
    try:
        deadline = time.monotonic() + 30
        while not _uploads(s3_server, url):
            assert time.monotonic() < deadline, "the child never started its upload"
            time.sleep(0.02)
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert io.is_complete(url) and io.load_checkpoint(url)["global_step"] == 1
    assert len(_uploads(s3_server, url)) == 1  # the dead writer's parts, unseen by readers

    io.save_checkpoint(_checkpoint(step=3, numel=1000), url)  # the next save of the path removes them
    assert _uploads(s3_server, url) == [] and io.load_checkpoint(url)["global_step"] == 3


def test_failed_download_loads_nothing_and_leaves_no_file(s3_server, s3_url, tmp_path, monkeypatch) -> None:
    url = f"{s3_url}/last.ckpt"
    TorchCheckpointIO(storage_options=s3_server.storage_options).save_checkpoint(_checkpoint(step=1), url)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    _recording_s3("faildl", fail_range=2)
    io = TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=2)
    with pytest.raises(
        CheckpointError, match=r"Could not download the checkpoint .*last\.ckpt.*connection reset"
    ):
        io.load_checkpoint(url.replace("s3://", "faildl://"))
    assert list(tmp_path.iterdir()) == []  # the partial download was removed

    # An object replaced while it is downloaded fails the download (If-Match) instead of mixing two files.
    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    replaced = _checkpoint(step=2, numel=1000)
    original = fs.info

    def info_then_replace(p: str, **kwargs: Any) -> dict[str, Any]:
        details = original(p, **kwargs)
        TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=1).save_checkpoint(
            replaced, url
        )
        return details

    monkeypatch.setattr(fs, "info", info_then_replace)
    with pytest.raises(TransferError, match="replaced while it was being read"):
        download_to_local(fs, path, str(tmp_path / "x.ckpt"), chunk_size=MiB)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_retention_on_the_store_keeps_the_last_complete_checkpoint_when_a_save_fails(
    s3_server, s3_url
) -> None:
    """save_top_k=1 deletes the replaced checkpoint on the store only once its successor is complete.

    (That it deletes on the store at all is tests/callbacks/test_model_checkpoint.py's s3 tests.)
    """
    from boring import BoringModel, fast_trainer, random_loader

    from trainer_core.callbacks.base import Callback
    from trainer_core.callbacks.model_checkpoint import ModelCheckpoint

    store = _recording_s3("retains3")
    base = s3_url.replace("s3://", "retains3://")
    io = TorchCheckpointIO(storage_options=s3_server.storage_options, transfer_concurrency=2)

    class StoreFailsFrom(Callback):
        def __init__(self, epoch: int) -> None:
            self.epoch = epoch

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            store.fail_checkpoint_puts = trainer.current_epoch >= self.epoch

    def run(max_epochs: int, fail_from: int) -> Any:
        callback = ModelCheckpoint(dirpath=base, save_top_k=1)
        trainer = fast_trainer(
            max_epochs=max_epochs,
            enable_checkpointing=True,
            callbacks=[callback, StoreFailsFrom(fail_from)],
            plugins=[io],
        )
        trainer.fit(BoringModel(), random_loader(4, 4, batch_size=2))
        return callback

    with pytest.raises(CheckpointError, match=r"epoch=1-step=4\.ckpt.*connection reset"):
        run(max_epochs=2, fail_from=1)  # epoch 0 saved, epoch 1's save fails
    store.fail_checkpoint_puts = False
    complete = io.list_complete(base)
    assert [Path(p).name for p in complete] == ["epoch=0-step=2.ckpt"]  # the last complete one was kept
    assert io.load_checkpoint(complete[0])["global_step"] == 2
    assert _uploads(s3_server, f"{s3_url}/epoch=1-step=4.ckpt") == []


def test_sharded_folder_on_the_store_is_written_and_read_as_parallel_files(s3_server, s3_url) -> None:
    tensors = {
        f"layer{i}": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)
    }
    checkpoint = {
        "format_version": 1,
        "epoch": 0,
        "global_step": 5,
        "loops": {},
        "state_dict": tensors,
        "optimizer_states": [],
    }
    url = f"{s3_url}/sharded.ckpt"
    io = DistributedCheckpointIO(storage_options=s3_server.storage_options)
    io.save_checkpoint(checkpoint, url)
    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    shards = sorted(Path(p).name for p in fs.ls(path, detail=False) if p.endswith(".distcp"))
    assert len(shards) == SHARD_IO_THREADS  # one file per writer thread of rank 0, uploaded at once
    loaded = io.load_checkpoint(url)
    for name, value in tensors.items():
        assert torch.equal(loaded["state_dict"][name], value), name


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_shard_file_failing_in_a_writer_thread_fails_the_save_and_publishes_no_metadata(
    s3_server, s3_url
) -> None:
    """DCP drops the exceptions of its extra writer threads; the save must still fail, with no .metadata."""
    _recording_s3("shardfails3", fail_key=f"__0_{SHARD_IO_THREADS - 1}.distcp")
    tensors = {f"layer{i}": torch.randn(64 * 1024) for i in range(8)}
    checkpoint = {"format_version": 1, "epoch": 0, "global_step": 5, "loops": {}, "state_dict": tensors}
    url = f"{s3_url}/sharded.ckpt"
    io = DistributedCheckpointIO(storage_options=s3_server.storage_options)
    with pytest.raises(CheckpointError, match=r"sharded\.ckpt.*connection reset"):
        io.save_checkpoint(checkpoint, url.replace("s3://", "shardfails3://"))
    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    assert not fs.exists(f"{path}/.metadata") and not io.is_complete(url)
