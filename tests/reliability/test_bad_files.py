"""Part 3 of the reliability suite: a table of bad checkpoints, and random structures that round-trip.

Every bad file is handed to ``Trainer.fit(ckpt_path=...)``, the way a user meets it: each must give
its own clear ``CheckpointError`` (naming the file and what is wrong), run no code, open nothing
outside the checkpoint, and leave the model exactly as it was. The IO-level cases of
tests/checkpoint/test_io.py (``test_bad_file_gives_one_clear_error``) check the same files one
layer down; this table adds what only shows at resume time or in sharded folders.

The property-based test (hypothesis) builds random modules and optimizers, trains them a step,
and checks that the checkpoint of each round-trips bit for bit and resumes the optimizer exactly.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from boring import BoringModel, quiet_trainer, random_loader
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from malicious import RunsShell, metadata_with_shard_name
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import Trainer, seed_everything
from trainer_core.checkpoint import (
    FORMAT_VERSION,
    KEY_FORMAT_VERSION,
    KEY_OPTIMIZER_STATES,
    KEY_STATE_DICT,
    optimizer_state_from_names,
    optimizer_state_to_names,
    parameter_names,
)
from trainer_core.checkpoint.format import NEWEST_FORMAT_VERSION
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO


def _loader() -> DataLoader:
    return random_loader(16, 4, batch_size=4)


def _trainer(max_steps: int, io: Any = None) -> Trainer:
    return quiet_trainer(max_steps=max_steps, plugins=[io] if io is not None else None)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real single-file checkpoint and a real sharded folder of a trained ``BoringModel``."""
    folder = tmp_path_factory.mktemp("good")
    seed_everything(0, verbose=False)
    trainer = _trainer(3)
    trainer.fit(BoringModel(), _loader())
    trainer.save_checkpoint(folder / "good.ckpt")
    trainer.plugin.checkpoint_io = DistributedCheckpointIO()
    trainer.save_checkpoint(folder / "sharded.ckpt")
    return {"file": folder / "good.ckpt", "sharded": folder / "sharded.ckpt"}


def _edited(good: dict[str, Path], path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    checkpoint = torch.load(good["file"], weights_only=True)
    torch.save(edit(checkpoint), path)


def _truncated(at: Callable[[int], int]) -> Callable[[dict[str, Path], Path], None]:
    def make(good: dict[str, Path], path: Path) -> None:
        data = good["file"].read_bytes()
        path.write_bytes(data[: at(len(data))])

    return make


def _sharded(edit: Callable[[Path], None]) -> Callable[[dict[str, Path], Path], None]:
    def make(good: dict[str, Path], path: Path) -> None:
        shutil.copytree(good["sharded"], path)
        edit(path)

    return make


def _state_dict_edit(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[dict[str, Any]], Any]:
    def edit(checkpoint: dict[str, Any]) -> dict[str, Any]:
        change(checkpoint[KEY_STATE_DICT])
        return checkpoint

    return edit


def _flip_a_weight_bit(good: dict[str, Path], path: Path) -> None:
    data = bytearray(good["file"].read_bytes())
    weight = torch.load(good["file"], weights_only=True)[KEY_STATE_DICT]["net.0.weight"]
    at = bytes(data).find(weight.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))


# kind: (how to make it, the error it must give, the IO that reads it)
BAD: dict[str, tuple[Callable[[dict[str, Path], Path], None], str]] = {
    "empty": (lambda good, p: p.write_bytes(b""), "truncated, corrupt or not a PyTorch checkpoint"),
    "truncated_at_16_bytes": (_truncated(lambda n: 16), "truncated, corrupt"),
    "truncated_at_half": (_truncated(lambda n: n // 2), "truncated, corrupt"),
    "truncated_100_bytes_short": (_truncated(lambda n: n - 100), "truncated, corrupt"),
    "random_bytes": (lambda good, p: p.write_bytes(random.Random(0).randbytes(5000)), "truncated, corrupt"),
    "zip_not_a_checkpoint": (
        lambda good, p: zipfile.ZipFile(p, "w").writestr("notes.txt", "hello") or None,
        "truncated, corrupt",
    ),
    "plain_state_dict": (lambda good, p: torch.save(BoringModel().state_dict(), p), "plain state_dict"),
    "newer_format_version": (
        lambda good, p: _edited(good, p, lambda c: {**c, KEY_FORMAT_VERSION: NEWEST_FORMAT_VERSION + 1}),
        "newer trainer-core.*Upgrade",
    ),
    "invalid_format_version": (
        lambda good, p: _edited(good, p, lambda c: {**c, KEY_FORMAT_VERSION: "1"}),
        "invalid 'format_version'",
    ),
    "missing_keys": (
        lambda good, p: _edited(good, p, lambda c: {k: v for k, v in c.items() if k != KEY_STATE_DICT}),
        r"lacks the keys \[state_dict\]",
    ),
    "weights_only_checkpoint": (
        lambda good, p: _edited(good, p, lambda c: {k: v for k, v in c.items() if k != KEY_OPTIMIZER_STATES}),
        "holds only the model weights",
    ),
    "extra_keys": (
        lambda good, p: _edited(good, p, _state_dict_edit(lambda sd: sd.update(extra=torch.zeros(3)))),
        r"unexpected in the checkpoint \(1\): extra",
    ),
    "wrong_shapes": (
        lambda good, p: _edited(
            good, p, _state_dict_edit(lambda sd: sd.update({"net.0.bias": torch.zeros(9)}))
        ),
        r"shape mismatch \(1\): net.0.bias: checkpoint \(9,\) vs model \(8,\)",
    ),
    "wrong_dtypes": (
        lambda good, p: _edited(
            good, p, _state_dict_edit(lambda sd: sd.update({"net.0.bias": torch.zeros(8, dtype=torch.int64)}))
        ),
        r"dtype mismatch \(1\): net.0.bias: checkpoint torch.int64 vs model torch.float32",
    ),
    "nan_weights": (
        lambda good, p: _edited(good, p, _state_dict_edit(lambda sd: sd["net.2.weight"].fill_(float("nan")))),
        r"NaN weights \(1\): net.2.weight.*diverged",
    ),
    "different_model": (
        lambda good, p: _edited(
            good, p, lambda c: {**c, KEY_STATE_DICT: nn.Sequential(nn.Linear(4, 2)).state_dict()}
        ),
        r"does not match the model:.*missing in the checkpoint \(4\).*unexpected in the checkpoint \(2\)",
    ),
    "pickle_that_runs_code": (
        lambda good, p: p.write_bytes(pickle.dumps(RunsShell(str(p.parent / "PWNED")))),
        r"Refused to load .*posix.system",
    ),
    "zip_that_runs_code": (
        lambda good, p: _edited(
            good, p, lambda c: {**c, "hyper_parameters": RunsShell(str(p.parent / "PWNED"))}
        ),
        r"Refused to load .*posix.system",
    ),
    "sharded_without_metadata": (
        _sharded(lambda d: (d / ".metadata").unlink()),
        r"incomplete sharded checkpoint: it has no .metadata",
    ),
    "sharded_shard_missing": (
        _sharded(lambda d: [f.unlink() for f in d.glob("*.distcp")] and None),
        r"a shard is missing, truncated or does not match",
    ),
    "sharded_metadata_runs_code": (
        _sharded(lambda d: (d / ".metadata").write_bytes(pickle.dumps(RunsShell(str(d.parent / "PWNED"))))),
        r"Refused to load .*\.metadata asks to call or construct posix.system",
    ),
    "sharded_shard_outside_the_folder": (
        _sharded(lambda d: metadata_with_shard_name(d, "../outside.distcp")),
        r"names shard files outside the folder \('../outside.distcp'\)",
    ),
    "bit_flip_in_weights": (_flip_a_weight_bit, r"Checksum mismatch .*net.0.weight|Checksum mismatch"),
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_checkpoint_gives_its_own_clear_error(
    kind: str, good: dict[str, Path], tmp_path: Path
) -> None:
    make, expected = BAD[kind]
    path = tmp_path / f"{kind}.ckpt"
    make(good, path)
    (tmp_path / "outside.distcp").write_bytes(b"never to be opened")
    seed_everything(1, verbose=False)
    model = BoringModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Checksums are checked only when asked for (they cost a second read of the file).
    trainer = _trainer(5, TorchCheckpointIO(verify_checksums=True) if kind == "bit_flip_in_weights" else None)

    with pytest.raises(CheckpointError) as error:
        trainer.fit(model, _loader(), ckpt_path=str(path))

    message = str(error.value)
    assert str(path) in message, message
    assert re.search(expected, message, re.S), message
    assert "weights_only` set to `False`" not in message  # never advise running the file's code
    assert not (tmp_path / "PWNED").exists(), "the checkpoint ran code"
    assert trainer.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model was changed"


def test_the_table_has_one_message_per_kind(good: dict[str, Path], tmp_path: Path) -> None:
    assert len(BAD) >= 15
    assert len({expected for _, expected in BAD.values()}) >= 15  # own words for at least 15 kinds


def test_without_verification_a_bit_flip_is_not_detected(good: dict[str, Path], tmp_path: Path) -> None:
    """What RELIABILITY.md states: torch.load itself does not check the CRCs it wrote."""
    path = tmp_path / "flipped.ckpt"
    _flip_a_weight_bit(good, path)
    loaded = TorchCheckpointIO().load_checkpoint(str(path))
    original = TorchCheckpointIO().load_checkpoint(str(good["file"]))
    assert not torch.equal(loaded[KEY_STATE_DICT]["net.0.weight"], original[KEY_STATE_DICT]["net.0.weight"])


# ---------------------------------------------------------------------- property-based round trips
LAYERS = {
    "linear": lambda width: nn.Linear(width, width),
    "linear_no_bias": lambda width: nn.Linear(width, width, bias=False),
    "layernorm": lambda width: nn.LayerNorm(width),
    "batchnorm": lambda width: nn.BatchNorm1d(width),
    "tanh": lambda width: nn.Tanh(),
}
OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, centered=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
}


def _build(
    layers: list[str], width: int, optimizer: str, split: bool, dtype: torch.dtype, seed: int
) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, width), *(LAYERS[kind](width) for kind in layers), nn.Linear(width, 1))
    model.to(dtype)
    params = list(model.parameters())
    groups: Any = [{"params": params[::2]}, {"params": params[1::2], "lr": 0.003}] if split else params
    return model, OPTIMIZERS[optimizer](groups)


def _step(model: nn.Module, optimizer: Any, seed: int) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed)).to(dtype)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.lists(st.sampled_from(sorted(LAYERS)), max_size=4),
    width=st.integers(min_value=1, max_value=6),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    split=st.booleans(),
    steps=st.integers(min_value=0, max_value=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    sharded=st.booleans(),
)
# Found by this test: DCP stores no empty container, so an optimizer without state came back
# without its "state" key and the resume failed with a KeyError.
@example(layers=[], width=2, optimizer="adam", split=False, steps=0, dtype=torch.float32, sharded=True)
def test_random_modules_and_optimizers_round_trip(
    tmp_path: Path,
    layers: list[str],
    width: int,
    optimizer: str,
    split: bool,
    steps: int,
    dtype: torch.dtype,
    sharded: bool,
) -> None:
    model, opt = _build(layers, width, optimizer, split, dtype, seed=1)
    for step in range(steps):
        _step(model, opt, step)
    names = parameter_names(model)
    checkpoint = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        "epoch": 0,
        "global_step": steps,
        KEY_STATE_DICT: model.state_dict(),
        KEY_OPTIMIZER_STATES: [optimizer_state_to_names(opt.state_dict(), opt, names)],
    }
    url = str(tmp_path / f"{os.urandom(4).hex()}.ckpt")
    # A single file, or a DCP folder (whose non-tensor entries load through the safe planner).
    io = DistributedCheckpointIO() if sharded else TorchCheckpointIO()
    io.save_checkpoint(checkpoint, url)
    loaded = io.load_checkpoint(url)

    assert list(loaded[KEY_STATE_DICT]) == list(checkpoint[KEY_STATE_DICT])
    for name, tensor in checkpoint[KEY_STATE_DICT].items():
        assert loaded[KEY_STATE_DICT][name].dtype == tensor.dtype and torch.equal(
            loaded[KEY_STATE_DICT][name], tensor
        )

    # Into a fresh model and optimizer: the next step is the same as the original's, bit for bit.
    fresh, fresh_opt = _build(layers, width, optimizer, split, dtype, seed=2)
    fresh.load_state_dict(loaded[KEY_STATE_DICT])
    fresh_opt.load_state_dict(
        optimizer_state_from_names(loaded[KEY_OPTIMIZER_STATES][0], fresh_opt, parameter_names(fresh))
    )
    _step(model, opt, 99)
    _step(fresh, fresh_opt, 99)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_dict_check_passes_over_meta_tensors() -> None:
    """Layers a pipeline rank does not hold live on the meta device: they have shapes but no values."""
    from trainer_core.checkpoint.format import check_state_dict_matches

    real = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    meta = {"w": torch.empty(2, 3, device="meta"), "b": torch.zeros(3)}
    check_state_dict_matches(real, meta, "x.ckpt")
    check_state_dict_matches(meta, meta, "x.ckpt")
    with pytest.raises(CheckpointError, match="NaN"):
        check_state_dict_matches(real, {**meta, "b": torch.full((3,), float("nan"))}, "x.ckpt")
