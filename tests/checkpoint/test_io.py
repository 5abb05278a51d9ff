"""Checkpoint IO, format checks and name-keyed optimizer state, against real files and a real S3 server.

What a user relies on: a checkpoint round-trips on every kind of URL; a crashed or failed save never
costs them the previous checkpoint and is never picked by ``ckpt_path="last"``; a bad file gives one
error naming it, and a malicious one runs nothing; optimizer state saved by name resumes training
exactly, whatever order the optimizer lists its groups in.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import random
import re
import resource
import signal
import time
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from malicious import RunsShell
from torch import nn

from trainer_core.checkpoint import (
    FORMAT_VERSION,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_STATE_DICT,
    check_state_dict_matches,
    optimizer_state_from_names,
    optimizer_state_to_names,
    parameter_names,
    register_safe_globals,
    validate_checkpoint,
)
from trainer_core.checkpoint import format as ckpt_format
from trainer_core.checkpoint.format import NEWEST_FORMAT_VERSION
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io import COMMIT_MARKER_SUFFIX, TorchCheckpointIO

# ---------------------------------------------------------------------------------------------- helpers


def make_checkpoint(step: int = 0, numel: int = 1000) -> dict[str, Any]:
    """A checkpoint shaped like the Trainer's, with every kind of value the format holds."""
    random.seed(step)
    np.random.seed(step)
    return {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        "trainer_core_version": "0.1.0",
        KEY_EPOCH: 1,
        KEY_GLOBAL_STEP: step,
        KEY_STATE_DICT: OrderedDict(
            [
                ("net.0.weight", torch.arange(numel, dtype=torch.float32) + step),
                ("net.0.bias", torch.randn(7, dtype=torch.bfloat16)),
                ("buffer", torch.tensor([step], dtype=torch.int64)),
            ]
        ),
        "optimizer_states": [{"state": {"net.0.weight": {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "lr_schedulers": [{"last_epoch": 3, "_last_lr": [0.1, 0.01], "base_lrs": (0.1, 0.01)}],
        "loops": {"fit_loop": {"batches_seen": 12, "done": False, "ratio": 0.5, "name": None}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss'}": {"best_k_models": {"a.ckpt": torch.tensor(0.3)}}
        },
        "rng_states": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "hyper_parameters": {"lr": 0.1, "layers": [4, 4], "np_scalar": np.float64(2.5)},
        "precision": {"scaler": None},
    }


def assert_same(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Deep equality where tensors and arrays must match in dtype and value."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, where
        assert np.array_equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected and type(actual) is type(expected), where


@pytest.fixture(params=["local", "file", "memory", "s3"])
def ckpt_dir(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh folder URL on each kind of storage."""
    if request.param == "local":
        yield str(tmp_path / "ckpts")
    elif request.param == "file":
        yield f"file://{tmp_path}/ckpts"
    elif request.param == "s3":
        yield request.getfixturevalue("s3_url")
    else:
        url = f"memory://test-{os.urandom(6).hex()}"
        yield url
        fs, path = fsspec.core.url_to_fs(url)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)


# ---------------------------------------------------------------------------------------------- round trip


def test_round_trip_every_key(ckpt_dir: str) -> None:
    io = TorchCheckpointIO()
    url = f"{ckpt_dir}/epoch=1-step=5.ckpt"
    checkpoint = make_checkpoint(step=5)
    io.save_checkpoint(checkpoint, url)

    assert io.is_complete(url)
    assert io.list_complete(ckpt_dir) == [url]
    assert_same(io.load_checkpoint(url), checkpoint)


def test_overwrite_replaces_and_lists_newest_last(ckpt_dir: str) -> None:
    io = TorchCheckpointIO()
    for name, step in [("b.ckpt", 1), ("a.ckpt", 2), ("b.ckpt", 3)]:
        io.save_checkpoint(make_checkpoint(step), f"{ckpt_dir}/{name}")
        time.sleep(0.01)

    assert io.list_complete(ckpt_dir) == [f"{ckpt_dir}/a.ckpt", f"{ckpt_dir}/b.ckpt"]
    assert io.latest_complete(ckpt_dir) == f"{ckpt_dir}/b.ckpt"
    assert io.load_checkpoint(f"{ckpt_dir}/b.ckpt")[KEY_GLOBAL_STEP] == 3


def test_remove_checkpoint(ckpt_dir: str) -> None:
    io = TorchCheckpointIO()
    url = f"{ckpt_dir}/a.ckpt"
    io.save_checkpoint(make_checkpoint(), url)
    io.remove_checkpoint(url)

    fs, path = fsspec.core.url_to_fs(url)
    assert not fs.exists(path) and not fs.exists(path + COMMIT_MARKER_SUFFIX)
    assert not io.is_complete(url) and io.list_complete(ckpt_dir) == []
    io.remove_checkpoint(url)  # removing what is gone is not an error


def test_list_complete_of_missing_folder_is_empty(tmp_path) -> None:
    assert TorchCheckpointIO().list_complete(str(tmp_path / "nope")) == []
    assert TorchCheckpointIO().latest_complete("memory://no-such-folder") is None


# ---------------------------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_object_without_marker_is_not_complete(kind: str, request: pytest.FixtureRequest) -> None:
    base = request.getfixturevalue("s3_url") if kind == "s3" else f"memory://nomarker-{os.urandom(4).hex()}"
    io = TorchCheckpointIO()
    fs, path = fsspec.core.url_to_fs(f"{base}/a.ckpt")
    with fs.open(path, "wb") as f:  # what a writer killed before its marker leaves behind
        torch.save(make_checkpoint(), f)

    assert not io.is_complete(f"{base}/a.ckpt")
    assert io.list_complete(base) == []
    # a file named explicitly is still read: one copied in by hand has no marker either
    assert io.load_checkpoint(f"{base}/a.ckpt")[KEY_GLOBAL_STEP] == 0


def test_marker_of_another_object_does_not_vouch_for_a_torn_one() -> None:
    io = TorchCheckpointIO()
    url = f"memory://torn-{os.urandom(4).hex()}/a.ckpt"
    io.save_checkpoint(make_checkpoint(), url)
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, fs.cat_file(path)[:100])  # an in-place, non-atomic overwrite cut short

    assert not io.is_complete(url)


def test_temporary_files_are_never_complete(tmp_path) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint(make_checkpoint(), str(tmp_path / "a.ckpt"))
    (tmp_path / ".b.ckpt.tmp-123456").write_bytes(b"half")

    assert not io.is_complete(str(tmp_path / ".b.ckpt.tmp-123456"))
    assert io.list_complete(str(tmp_path), suffix=None) == [str(tmp_path / "a.ckpt")]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_failed_save_keeps_previous_checkpoint(kind: str, tmp_path) -> None:
    folder = str(tmp_path) if kind == "local" else f"memory://failed-{os.urandom(4).hex()}"
    url = f"{folder}/last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(make_checkpoint(step=1), url)
    broken = make_checkpoint(step=2)
    broken["hyper_parameters"]["fn"] = lambda x: x  # cannot be pickled: the save fails after opening the file

    with pytest.raises(CheckpointError, match=re.escape(url) + ".*(pickle|lambda)"):
        io.save_checkpoint(broken, url)

    assert io.load_checkpoint(url)[KEY_GLOBAL_STEP] == 1
    assert io.list_complete(folder, suffix=None) == [url]
    if kind == "local":
        assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # the temporary file is gone


def test_disk_full_mid_write_keeps_previous_checkpoint(tmp_path) -> None:
    """A real write error part-way through the file: the file size limit makes write() fail with EFBIG."""
    url = str(tmp_path / "last.ckpt")
    io = TorchCheckpointIO()
    io.save_checkpoint(make_checkpoint(step=1), url)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, hard))
    try:
        with pytest.raises(CheckpointError, match=re.escape(url) + ".*File too large"):
            io.save_checkpoint(make_checkpoint(step=2, numel=2_000_000), url)  # 8 MB > 2 MB limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)

    assert io.load_checkpoint(url)[KEY_GLOBAL_STEP] == 1
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def _flaky_s3_filesystem() -> type:
    """An s3fs filesystem whose uploads fail after 12 MB, like a connection dropped mid-upload.

    The failure is injected at the request that carries the bytes (``upload_part``), so it hits the
    sequential upload (s3fs's own file) and the parallel one (``object_store``) alike.
    """
    from s3fs import S3FileSystem

    class FlakyS3FileSystem(S3FileSystem):
        protocol = ("flakys3",)
        fail_after = 12 * 2**20
        uploaded = 0

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "upload_part":
                type(self).uploaded += memoryview(kwargs["Body"]).nbytes
                if type(self).uploaded > self.fail_after:
                    raise ConnectionResetError("connection reset by peer")
            return await super()._call_s3(method, *args, **kwargs)

        # s3fs's synchronous ``call_s3`` (used by its own files) wraps the base class's coroutine.
        call_s3 = fsspec.asyn.sync_wrapper(_call_s3)

    return FlakyS3FileSystem


def test_failed_upload_keeps_previous_object_and_aborts_upload(s3_server, s3_url: str) -> None:
    fsspec.register_implementation("flakys3", _flaky_s3_filesystem(), clobber=True)
    io = TorchCheckpointIO(storage_options=s3_server.storage_options)
    url = f"{s3_url}/last.ckpt"
    io.save_checkpoint(make_checkpoint(step=1), url)

    with pytest.raises(CheckpointError, match=re.escape("last.ckpt") + ".*connection reset"):
        # 20 MB: the first 8 MB part is uploaded before the write fails at 12 MB
        io.save_checkpoint(make_checkpoint(step=2, numel=5_000_000), url.replace("s3://", "flakys3://"))

    assert io.is_complete(url) and io.load_checkpoint(url)[KEY_GLOBAL_STEP] == 1
    fs, path = fsspec.core.url_to_fs(url, **s3_server.storage_options)
    uploads = fs.list_multipart_uploads(s3_server.bucket)
    assert [u for u in uploads if u["Key"] == path.split("/", 1)[1]] == []


def _save_then_exit(io: TorchCheckpointIO, checkpoint: dict[str, Any], url: str) -> None:
    """The forked child's whole life: one save, then exit without running pytest's cleanup."""
    try:
        io.save_checkpoint(checkpoint, url)
    finally:
        os._exit(0)


@pytest.mark.timeout(60)
def test_sigkill_during_save_leaves_old_or_new_checkpoint(tmp_path) -> None:
    """20 saves killed with SIGKILL at random moments: "last" always finds a checkpoint that loads."""
    io = TorchCheckpointIO()
    url = str(tmp_path / "last.ckpt")
    numel = 4_000_000  # 16 MB: the write takes long enough to be hit mid-way
    io.save_checkpoint(make_checkpoint(step=0, numel=numel), url)
    started = time.perf_counter()
    io.save_checkpoint(make_checkpoint(step=0, numel=numel), url)
    save_seconds = time.perf_counter() - started
    rng = random.Random(1234)
    current, outcomes = 0, {"old": 0, "new": 0}
    for trial in range(1, 21):
        checkpoint = make_checkpoint(step=trial, numel=numel)
        pid = os.fork()
        if pid == 0:
            _save_then_exit(io, checkpoint, url)
        time.sleep(rng.uniform(0.0, 1.3 * save_seconds))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

        assert io.list_complete(str(tmp_path)) == [url]
        loaded = io.load_checkpoint(io.latest_complete(str(tmp_path)))
        assert loaded[KEY_GLOBAL_STEP] in (current, trial)
        expected = torch.arange(numel, dtype=torch.float32) + loaded[KEY_GLOBAL_STEP]
        assert torch.equal(loaded[KEY_STATE_DICT]["net.0.weight"], expected)
        outcomes["new" if loaded[KEY_GLOBAL_STEP] == trial else "old"] += 1
        current = loaded[KEY_GLOBAL_STEP]
    print(f"SIGKILL outcomes: {outcomes}, temporary files left: {len(os.listdir(tmp_path)) - 1}")


# ---------------------------------------------------------------------------------------------- bad input


def _write_bad_file(kind: str, path: str, tmp_path) -> None:
    good = make_checkpoint()
    if kind == "truncated":
        torch.save(good, path)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
    elif kind == "garbage":
        with open(path, "wb") as f:
            f.write(random.Random(0).randbytes(4096))
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "random_zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "not a checkpoint")
    elif kind == "plain_state_dict":
        torch.save(nn.Linear(2, 2).state_dict(), path)
    elif kind == "lightning_checkpoint":
        torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": {}, "epoch": 0}, path)
    elif kind == "not_a_dict":
        torch.save([torch.zeros(2)], path)
    elif kind == "bad_format_version":
        torch.save({**good, KEY_FORMAT_VERSION: "one"}, path)
    elif kind == "missing_keys":
        torch.save({KEY_FORMAT_VERSION: FORMAT_VERSION, KEY_EPOCH: 0}, path)
    elif kind == "newer_format":
        torch.save(
            {**good, KEY_FORMAT_VERSION: NEWEST_FORMAT_VERSION + 1, "trainer_core_version": "9.9.9"}, path
        )
    elif kind == "runs_code_zip":
        torch.save({**good, "hyper_parameters": RunsShell(str(tmp_path / "PWNED"))}, path)
    elif kind == "runs_code_pickle":
        with open(path, "wb") as f:
            pickle.dump(RunsShell(str(tmp_path / "PWNED")), f)
    else:
        raise AssertionError(kind)


BAD_FILES = {
    "truncated": "truncated, corrupt",
    "garbage": "truncated, corrupt",
    "empty": "truncated, corrupt",
    "random_zip": "truncated, corrupt",
    "plain_state_dict": "plain state_dict",
    "lightning_checkpoint": "PyTorch Lightning checkpoint",
    "not_a_dict": "not a trainer-core checkpoint",
    "bad_format_version": "invalid 'format_version'",
    "missing_keys": "lacks the keys",
    "newer_format": "newer trainer-core .*9.9.9.*Upgrade",
    "runs_code_zip": "Refused .*posix.system",
    "runs_code_pickle": "Refused .*posix.system",
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_gives_one_clear_error(kind: str, tmp_path) -> None:
    path = str(tmp_path / f"bad-{kind}.ckpt")
    _write_bad_file(kind, path, tmp_path)

    with pytest.raises(CheckpointError, match=re.escape(path)) as error:
        TorchCheckpointIO().load_checkpoint(path)

    assert re.search(BAD_FILES[kind], str(error.value)), str(error.value)
    assert "weights_only` set to `False`" not in str(error.value)  # never advise running the code
    assert not (tmp_path / "PWNED").exists()


def test_missing_path_and_folder(tmp_path) -> None:
    io = TorchCheckpointIO()
    with pytest.raises(CheckpointError, match="not found: " + re.escape(str(tmp_path / "nope.ckpt"))):
        io.load_checkpoint(str(tmp_path / "nope.ckpt"))
    with pytest.raises(CheckpointError, match=re.escape("Checkpoint not found: memory://absent/x.ckpt")):
        io.load_checkpoint("memory://absent/x.ckpt")
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path)) + " is a folder"):
        io.load_checkpoint(str(tmp_path))


class Settings:
    """A user's own class in the hyper-parameters: refused until the user registers it."""

    def __init__(self, width: int) -> None:
        self.width = width


def test_user_class_needs_registering(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_format, "_user_safe_globals", [])
    path = str(tmp_path / "hparams.ckpt")
    torch.save({**make_checkpoint(), "hyper_parameters": {"settings": Settings(width=3)}}, path)

    with pytest.raises(CheckpointError, match=re.escape(path) + ".*Settings.*register_safe_globals"):
        TorchCheckpointIO().load_checkpoint(path)
    register_safe_globals(Settings)
    assert TorchCheckpointIO().load_checkpoint(path)["hyper_parameters"]["settings"].width == 3


def test_weights_only_checkpoint_cannot_resume() -> None:
    weights_only = {k: v for k, v in make_checkpoint().items() if k != "optimizer_states"}
    validate_checkpoint(weights_only, "w.ckpt")
    with pytest.raises(CheckpointError, match=r"w\.ckpt holds only the model weights.*optimizer_states"):
        validate_checkpoint(weights_only, "w.ckpt", for_resume=True)


def test_state_dict_mismatch_lists_every_name() -> None:
    model = {"a.weight": torch.zeros(4, 4), "b.weight": torch.zeros(2), "c.bias": torch.zeros(1)}
    loaded = {"a.weight": torch.zeros(3, 4), "b.weight": torch.zeros(2), "d.bias": torch.zeros(1)}

    with pytest.raises(CheckpointError) as error:
        check_state_dict_matches(model, loaded, "run/last.ckpt")
    message = str(error.value)
    assert message.startswith("run/last.ckpt does not match the model")
    assert "missing in the checkpoint (1): c.bias" in message
    assert "unexpected in the checkpoint (1): d.bias" in message
    assert "a.weight: checkpoint (3, 4) vs model (4, 4)" in message

    with pytest.raises(CheckpointError, match=r"a\.weight: checkpoint \(3, 4\) vs model \(4, 4\)"):
        check_state_dict_matches(model, loaded, "run/last.ckpt", strict=False)
    check_state_dict_matches(model, {"a.weight": torch.ones(4, 4)}, "run/last.ckpt", strict=False)
    check_state_dict_matches(model, copy.deepcopy(model), "run/last.ckpt")


# ---------------------------------------------------------------------------------------------- optimizer state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _optimizer(kind: str, model: nn.Module, swap_groups: bool = False) -> torch.optim.Optimizer:
    """Two param groups with different learning rates, optionally listed in the other order."""
    groups = [
        {"params": list(model[0].parameters()), "lr": 0.1},
        {"params": list(model[2].parameters()), "lr": 0.01},
    ]
    if swap_groups:
        groups = [groups[1], {**groups[0], "params": groups[0]["params"][::-1]}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.1)
    return torch.optim.AdamW(groups, lr=0.1, weight_decay=0.05)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_name_keyed_state_round_trips_tensor_for_tensor(kind: str) -> None:
    model = _model()
    optimizer = _optimizer(kind, model)
    _train(model, optimizer, steps=3, seed=1)
    original = optimizer.state_dict()
    names = parameter_names(model)

    named = optimizer_state_to_names(original, optimizer, names)
    assert set(named["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert [g["params"] for g in named["param_groups"]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert_same(optimizer_state_from_names(named, optimizer, names), original)
    # a list of names in parameter order is the same mapping
    assert_same(optimizer_state_to_names(original, optimizer, list(names.values())), named)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_resumed_optimizer_steps_like_the_original(kind: str, tmp_path) -> None:
    """Saved by name through the real IO, loaded into an optimizer with its groups in the other order."""
    model = _model()
    optimizer = _optimizer(kind, model)
    _train(model, optimizer, steps=3, seed=1)
    checkpoint = make_checkpoint()
    checkpoint["optimizer_states"] = [
        optimizer_state_to_names(optimizer.state_dict(), optimizer, parameter_names(model))
    ]
    checkpoint[KEY_STATE_DICT] = model.state_dict()
    io = TorchCheckpointIO()
    io.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))

    loaded = io.load_checkpoint(str(tmp_path / "a.ckpt"))
    resumed_model = _model()
    resumed_model.load_state_dict(loaded[KEY_STATE_DICT])
    resumed = _optimizer(kind, resumed_model, swap_groups=True)
    resumed.load_state_dict(
        optimizer_state_from_names(
            loaded["optimizer_states"][0], resumed, parameter_names(resumed_model), "a.ckpt"
        )
    )
    assert resumed.param_groups[0]["lr"] == 0.01 and resumed.param_groups[1]["lr"] == 0.1

    _train(model, optimizer, steps=3, seed=2)
    _train(resumed_model, resumed, steps=3, seed=2)
    for (name, expected), actual in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(actual, expected), name


def test_name_mismatch_lists_missing_and_unexpected() -> None:
    model = _model()
    optimizer = _optimizer("adam", model)
    _train(model, optimizer, steps=1, seed=1)
    named = optimizer_state_to_names(optimizer.state_dict(), optimizer, parameter_names(model))
    renamed = {p: n.replace("2.", "head.") for p, n in parameter_names(model).items()}

    with pytest.raises(
        CheckpointError,
        match=r"(?s)in last\.ckpt.*lacks \(2\): head\.weight, head\.bias.*lacks \(2\): 2\.bias, 2\.weight",
    ):
        optimizer_state_from_names(named, optimizer, renamed, path="last.ckpt")


def test_group_mixing_two_saved_groups_is_an_error() -> None:
    model = _model()
    optimizer = _optimizer("sgd", model)
    named = optimizer_state_to_names(optimizer.state_dict(), optimizer, parameter_names(model))
    one_group = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    with pytest.raises(CheckpointError, match="2 different saved groups"):
        optimizer_state_from_names(named, one_group, parameter_names(model))


def test_empty_state_of_sharded_rank_passes_through() -> None:
    model = _model()
    optimizer = _optimizer("adam", model)
    assert optimizer_state_to_names({}, optimizer, parameter_names(model)) == {}
    assert optimizer_state_from_names({}, optimizer, parameter_names(model)) == {}
