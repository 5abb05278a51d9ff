"""``consolidate SRC --to safetensors OUT_DIR`` and ``load_safetensors``: Hugging Face's layout, bit for bit.

Sources are real checkpoint files and sharded folders of a module with every common dtype, a
non-contiguous buffer and a tied weight. Files are read back with the ``safetensors`` library and
compared bit for bit; a single file is byte-identical to what the library's own ``save`` writes.
Bad folders (missing or truncated shards, an index that does not match, a header the library
refuses, negative or non-finite sizes) are one error naming the file, with the module unchanged.
``--force`` writes only our own file names into an existing folder: a model card, a tokenizer, a
link to a folder elsewhere and a link named like our file (its target) all survive; an output that
is, holds or lies inside the source is refused with nothing written or deleted.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from trainer_core.checkpoint.cli import main
from trainer_core.checkpoint.safetensors import load_safetensors
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
from trainer_core.plugins.io.torch_io import TorchCheckpointIO

safetensors_torch = pytest.importorskip("safetensors.torch")


class Net(nn.Module):
    """The bare network: what a Hugging Face user loads weights into."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.encoder = nn.Linear(6, 5)
        self.decoder = nn.Linear(5, 6)
        self.decoder.weight = nn.Parameter(torch.randn(6, 5, generator=generator))
        self.tied = nn.Linear(5, 6, bias=False)
        self.tied.weight = self.decoder.weight  # one storage, two names
        self.register_buffer("bf16", torch.randn(5, 3, generator=generator).to(torch.bfloat16))
        self.register_buffer("fp16", torch.randn(7, generator=generator).to(torch.float16))
        self.register_buffer("steps", torch.arange(6, dtype=torch.int64) * (seed + 1))
        self.register_buffer("mask", torch.tensor([True, False, seed % 2 == 0]))
        self.register_buffer("counts", (torch.arange(4) + seed).to(torch.uint16))
        self.register_buffer("scalar", torch.tensor(2.5 + seed))
        self.register_buffer("empty", torch.zeros(0, 3))
        self.register_buffer("transposed", torch.randn(3, 4, generator=generator).t())
        with torch.no_grad():
            for parameter in (self.encoder.weight, self.encoder.bias, self.decoder.bias):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


class LitNet(nn.Module):
    """How a LightningModule holds it: ``self.model``, plus a tensor of its own (a loss weight)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model = Net(seed)
        self.register_buffer("loss_weight", torch.tensor([0.5, 2.0]))


def _bits(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert _bits(got[name]) == _bits(tensor), name


def _library_read(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(file))
    return tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same weights as a checkpoint file and as a sharded folder (weights-only checkpoints)."""
    root = tmp_path_factory.mktemp("safetensors")
    module = LitNet()
    checkpoint = {"format_version": 1, "epoch": 0, "global_step": 3, "state_dict": module.state_dict()}
    TorchCheckpointIO().save_checkpoint(checkpoint, root / "single.ckpt")
    DistributedCheckpointIO().save_checkpoint(checkpoint, root / "sharded.ckpt")
    return {"file": root / "single.ckpt", "folder": root / "sharded.ckpt", "state_dict": module.state_dict()}


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_round_trip_bit_for_bit_and_byte_identical_to_the_library(
    sources: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    out = tmp_path / "hf"
    assert main(["consolidate", str(sources[kind]), "--to", "safetensors", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    want = sources["state_dict"]
    _assert_bit_equal(_library_read(out), want)
    # The library's own writer, given the same tensors (it refuses shared ones: tied names as copies).
    library_bytes = safetensors_torch.save(
        {name: tensor.contiguous().clone() for name, tensor in want.items()}, metadata={"format": "pt"}
    )
    assert (out / "model.safetensors").read_bytes() == library_bytes

    module = LitNet(seed=1)
    assert load_safetensors(module, out) == ([], [])
    _assert_bit_equal(module.state_dict(), want)
    assert module.model.tied.weight is module.model.decoder.weight  # still tied, both names loaded


def test_shards_and_index_as_hugging_face_lays_them_out(sources: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    limit = 128  # bytes: several shards; the 120-byte decoder/tied weights alone
    assert (
        main(
            [
                "consolidate",
                str(sources["folder"]),
                "--to",
                "safetensors",
                "--max-shard-size",
                "128B",
                str(out),
            ]
        )
        == 0
    )
    want = sources["state_dict"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    count = len(shards)
    assert count >= 3 and shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in want.values())}
    assert sorted(index["weight_map"]) == sorted(want) and set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        held = safetensors_torch.load_file(out / shard)
        assert {n for n, f in index["weight_map"].items() if f == shard} == set(held)
        sizes = [t.numel() * t.element_size() for t in held.values()]
        assert sum(sizes) <= limit or len(sizes) == 1
    _assert_bit_equal(_library_read(out), want)

    module = LitNet(seed=2)
    load_safetensors(module, out / "model.safetensors.index.json")
    _assert_bit_equal(module.state_dict(), want)


def test_strip_prefix_loads_into_the_bare_network(
    sources: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bare"
    assert (
        main(
            ["consolidate", str(sources["file"]), "--to", "safetensors", "--strip-prefix", "model.", str(out)]
        )
        == 0
    )
    assert "1 tensors left out (not under --strip-prefix 'model.'): loss_weight" in capsys.readouterr().out
    net = Net(seed=5)
    assert load_safetensors(net, out, strict=True) == ([], [])
    want = {
        name[len("model.") :]: t for name, t in sources["state_dict"].items() if name.startswith("model.")
    }
    _assert_bit_equal(net.state_dict(), want)

    assert (
        main(
            [
                "consolidate",
                str(sources["file"]),
                "--to",
                "safetensors",
                "--strip-prefix",
                "net.",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "no weight of" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_missing_and_unexpected_names(sources: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert (
        main(
            ["consolidate", str(sources["file"]), "--to", "safetensors", "--strip-prefix", "model.", str(out)]
        )
        == 0
    )

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(6, 5)
            self.extra = nn.Linear(2, 2)

    module = Other()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_safetensors(module, out)
    message = str(err.value)
    assert "missing in the checkpoint (2): extra.bias, extra.weight" in message
    assert "unexpected in the checkpoint (11)" in message and "decoder.weight" in message
    _assert_bit_equal(module.state_dict(), before)  # strict: nothing loaded

    result = load_safetensors(module, out, strict=False)
    assert result.missing_keys == ["extra.weight", "extra.bias"]
    assert "tied.weight" in result.unexpected_keys and len(result.unexpected_keys) == 11
    assert torch.equal(module.encoder.weight, sources["state_dict"]["model.encoder.weight"])

    wrong = nn.Module()
    wrong.encoder = nn.Linear(6, 4)
    with pytest.raises(CheckpointError, match=r"shape mismatch \(2\): encoder.bias"):
        load_safetensors(wrong, out, strict=False)


def _break(folder: Path, case: str) -> Path:
    """Damage the sharded safetensors ``folder`` as ``case`` says; return the file the error must name."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    if case == "missing shard":
        (folder / first).unlink()
        return folder / first
    if case == "index names a key its shard lacks":
        index["weight_map"]["model.ghost"] = first
        index_path.write_text(json.dumps(index))
        return folder / first
    if case == "shard holds a key the index lacks":
        name = next(n for n, f in index["weight_map"].items() if f == first)
        del index["weight_map"][name]
        index_path.write_text(json.dumps(index))
        return folder / first
    if case == "truncated shard":
        data = (folder / first).read_bytes()
        (folder / first).write_bytes(data[:-3])
        return folder / first
    if case == "garbage index":
        index_path.write_text("{not json")
        return index_path
    raise AssertionError(case)


_BAD_CASES = [
    "missing shard",
    "index names a key its shard lacks",
    "shard holds a key the index lacks",
    "truncated shard",
    "garbage index",
]


def test_bad_folders_are_one_error_naming_the_file_and_leave_the_module(
    sources: dict[str, Any], tmp_path: Path
) -> None:
    good = tmp_path / "good"
    assert (
        main(
            [
                "consolidate",
                str(sources["folder"]),
                "--to",
                "safetensors",
                "--max-shard-size",
                "200",
                str(good),
            ]
        )
        == 0
    )
    module = LitNet(seed=7)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for case in _BAD_CASES:
        folder = tmp_path / case.replace(" ", "_")
        shutil.copytree(good, folder)
        named = _break(folder, case)
        with pytest.raises(CheckpointError) as err:
            load_safetensors(module, folder)
        assert str(named) in str(err.value), (case, str(err.value))
        _assert_bit_equal(module.state_dict(), before)

    single = tmp_path / "single"
    assert main(["consolidate", str(sources["file"]), "--to", "safetensors", str(single)]) == 0
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors is not a readable safetensors file.*truncated"
    ):
        load_safetensors(module, single)
    with pytest.raises(CheckpointError, match=r"single.ckpt is neither a folder nor a .safetensors file"):
        load_safetensors(module, sources["file"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty holds neither model.safetensors nor"):
        load_safetensors(module, tmp_path / "empty")
    _assert_bit_equal(module.state_dict(), before)


def test_memory_urls_and_the_previous_output_kept(sources: dict[str, Any], tmp_path: Path) -> None:
    url = "memory://safetensors-test/hf"
    assert (
        main(["consolidate", str(sources["folder"]), "--to", "safetensors", "--max-shard-size", "300", url])
        == 0
    )
    fs = fsspec.filesystem("memory")
    assert fs.exists("/safetensors-test/hf.complete")  # the folder's commit marker, written last
    module = LitNet(seed=3)
    load_safetensors(module, url)  # ranged reads through fsspec
    _assert_bit_equal(module.state_dict(), sources["state_dict"])
    # A remote single file: downloaded to a temporary file and mapped, never read whole into memory.
    fs.put(str(sources["file"]), "/safetensors-test/single.ckpt")
    single_out = "memory://safetensors-test/single-hf"
    assert (
        main(["consolidate", "memory://safetensors-test/single.ckpt", "--to", "safetensors", single_out]) == 0
    )
    module = LitNet(seed=4)
    load_safetensors(module, f"{single_out}/model.safetensors")
    _assert_bit_equal(module.state_dict(), sources["state_dict"])

    out = tmp_path / "hf"
    assert main(["consolidate", str(sources["file"]), "--to", "safetensors", str(out)]) == 0
    previous = (out / "model.safetensors").read_bytes()
    assert (
        main(["consolidate", str(sources["file"]), "--to", "safetensors", str(out)]) == 2
    )  # exists, no --force
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(sources["folder"], broken)
    for shard in broken.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:-40])
    assert main(["consolidate", str(broken), "--to", "safetensors", "--force", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.ckpt", "hf"]  # no temporary folder left


def _rewrite_header(path: Path, change: Callable[[dict[str, Any], str], str]) -> None:
    """Replace the JSON header of the safetensors file ``path`` by ``change(header, name)``, keeping the data;
    ``name`` is a tensor of the file with a non-empty shape."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(
        n for n, info in header.items() if n != "__metadata__" and info["shape"] and all(info["shape"])
    )
    text = change(header, name).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


def _with(header: dict[str, Any], name: str, **fields: Any) -> str:
    return json.dumps({**header, name: {**header[name], **fields}})


# Headers the check before this fix accepted (or crashed on with a raw error), while the library refuses them.
_LAX_HEADERS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "shape as strings": lambda h, n: _with(h, n, shape=[str(s) for s in h[n]["shape"]]),
    "shape as floats": lambda h, n: _with(h, n, shape=[float(s) for s in h[n]["shape"]]),
    "metadata not strings": lambda h, n: json.dumps({**h, "__metadata__": {"format": 1}}),
    "negative sizes": lambda h, n: _with(h, n, shape=[-1, -math.prod(h[n]["shape"])]),
    "non-finite size": lambda h, n: _with(h, n, shape=["HUGE"]).replace('"HUGE"', "1e309"),
    "NaN size": lambda h, n: _with(h, n, shape=["NAN"]).replace('"NAN"', "NaN"),
    "huge sizes": lambda h, n: _with(h, n, shape=[0, 2**62, 2**62]),
    "negative offsets": lambda h, n: _with(
        h, n, data_offsets=[h[n]["data_offsets"][0] - 2**70, h[n]["data_offsets"][1] - 2**70]
    ),
    "three offsets": lambda h, n: _with(h, n, data_offsets=[*h[n]["data_offsets"], 0]),
    "repeated name": lambda h, n: json.dumps(h)[:-1] + f", {json.dumps(n)}: {json.dumps(h[n])}}}",
    "not starting with a brace": lambda h, n: " " + json.dumps(h),
    "deep nesting": lambda h, n: json.dumps({**h, "__metadata__": "NEST"}).replace(
        '"NEST"', "[" * 100_000 + "]" * 100_000
    ),
}

# The library (0.8) reads these (the last of a repeated name wins); refusing them costs nothing.
_STRICTER_THAN_THE_LIBRARY = {"repeated name", "not starting with a brace"}


@pytest.fixture(scope="module")
def two_shards(sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A sharded safetensors folder and the shard to damage: one the load does not copy first."""
    folder = tmp_path_factory.mktemp("lax") / "hf"
    assert (
        main(
            [
                "consolidate",
                str(sources["folder"]),
                "--to",
                "safetensors",
                "--max-shard-size",
                "200",
                str(folder),
            ]
        )
        == 0
    )
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    first = next(iter(weight_map.values()))  # the shard the load reads and copies first
    later = [
        file
        for file in sorted(set(weight_map.values()) - {first})
        if any(
            all(s > 0 for s in t.shape) and t.dim() > 0
            for t in safetensors_torch.load_file(folder / file).values()
        )
    ]
    return {"folder": folder, "damaged": later[-1]}


@pytest.mark.parametrize("case", list(_LAX_HEADERS))
def test_a_later_shard_the_library_refuses_is_refused_before_any_tensor_moves(
    two_shards: dict[str, Any], tmp_path: Path, case: str
) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(two_shards["folder"], folder)
    damaged = folder / two_shards["damaged"]
    _rewrite_header(damaged, _LAX_HEADERS[case])
    if case not in _STRICTER_THAN_THE_LIBRARY:
        with pytest.raises(
            Exception
        ) as library_error:  # the damage is real: the library refuses the file too
            safetensors_torch.load_file(damaged)
        assert not isinstance(library_error.value, CheckpointError)

    module = LitNet(seed=9)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_safetensors(module, folder)
    assert f"{damaged} is not a readable safetensors file" in str(err.value), str(err.value)
    assert len(str(err.value)) < 1000  # a huge hostile header is not echoed back
    _assert_bit_equal(module.state_dict(), before)


def test_remote_folders_are_checked_whole_before_any_tensor_moves(
    two_shards: dict[str, Any], sources: dict[str, Any], tmp_path: Path
) -> None:
    from faulty_fs import register as register_faulty_fs

    # A flaky mount (every read returns half of what was asked): downloaded whole, then loaded bit for bit.
    register_faulty_fs()
    module = LitNet(seed=10)
    load_safetensors(module, f"faulty://{two_shards['folder']}", storage_options={"short_reads": True})
    _assert_bit_equal(module.state_dict(), sources["state_dict"])

    # memory:// with a later shard the library refuses: one error naming it, the module unchanged.
    folder = tmp_path / "hf"
    shutil.copytree(two_shards["folder"], folder)
    _rewrite_header(folder / two_shards["damaged"], _LAX_HEADERS["shape as strings"])
    url = f"memory://lax-{os.urandom(4).hex()}/hf"
    fsspec.filesystem("memory").put(str(folder), url.removeprefix("memory://"), recursive=True)
    module = LitNet(seed=11)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=rf"{url}/{two_shards['damaged']} is not a readable safetensors file"
    ):
        load_safetensors(module, url)
    _assert_bit_equal(module.state_dict(), before)


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: a link's target, a file's bytes, ``None`` for a folder (links not followed)."""
    found: dict[str, Any] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            key = str(path.relative_to(root))
            found[key] = (
                ("link", os.readlink(path))
                if path.is_symlink()
                else None
                if path.is_dir()
                else path.read_bytes()
            )
    return found


def _ours(folder: Path) -> list[str]:
    return sorted(
        p.name for p in folder.iterdir() if p.name.startswith("model") and p.name != "model-notes.txt"
    )


def test_force_writes_only_our_files_and_keeps_everything_else(
    sources: dict[str, Any], tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"another run's file")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("# model card\n")
    (out / "tokenizer.json").write_text('{"vocab": {}}')
    (out / "model-notes.txt").write_text("notes")
    (out / "shared").symlink_to(outside, target_is_directory=True)
    kept = {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith("hf/model.")}

    def consolidate(*options: str) -> None:
        args = ["consolidate", str(sources["folder"]), "--to", "safetensors", *options, "--force", str(out)]
        assert main(args) == 0

    consolidate("--max-shard-size", "128B")
    many = _ours(out)
    count = len(many) - 1
    assert count >= 3 and many[-1] == "model.safetensors.index.json"
    consolidate("--max-shard-size", "400B")
    fewer = _ours(out)
    assert 2 <= len(fewer) - 1 < count, fewer
    assert fewer == sorted(
        [f"model-{i:05d}-of-{len(fewer) - 1:05d}.safetensors" for i in range(1, len(fewer))]
        + ["model.safetensors.index.json"]
    )  # the shards of the other count are gone
    module = LitNet(seed=12)
    load_safetensors(module, out)
    _assert_bit_equal(module.state_dict(), sources["state_dict"])

    consolidate()  # one file: the index and every shard of ours go, the rest stays
    assert _ours(out) == ["model.safetensors"]
    _assert_bit_equal(_library_read(out), sources["state_dict"])
    after = _snapshot(tmp_path)
    assert {k: after.get(k) for k in kept} == kept  # card, tokenizer, notes, the link and its folder's file
    assert sorted(after) == sorted([*kept, "hf/model.safetensors"])  # no temporary left


def test_a_link_named_like_our_file_is_replaced_not_written_through(
    sources: dict[str, Any], tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"someone else's weights")
    (outside / "index.json").write_bytes(b"someone else's index")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").symlink_to(outside / "weights.bin")
    (out / "model.safetensors.index.json").symlink_to(outside / "index.json")  # ours by name, stale after
    (out / "elsewhere").symlink_to(outside, target_is_directory=True)

    assert main(["consolidate", str(sources["file"]), "--to", "safetensors", "--force", str(out)]) == 0
    assert not (out / "model.safetensors").is_symlink()  # the link itself replaced
    assert not os.path.lexists(out / "model.safetensors.index.json")  # a stale name of ours: the link removed
    _assert_bit_equal(safetensors_torch.load_file(out / "model.safetensors"), sources["state_dict"])
    assert _snapshot(outside) == {
        "weights.bin": b"someone else's weights",
        "index.json": b"someone else's index",
    }
    assert os.readlink(out / "elsewhere") == str(outside)

    # A folder under one of our names is never replaced: refused before anything is written.
    blocked = tmp_path / "blocked"
    (blocked / "model.safetensors").mkdir(parents=True)
    (blocked / "model.safetensors" / "inside.txt").write_text("mine")
    assert main(["consolidate", str(sources["file"]), "--to", "safetensors", "--force", str(blocked)]) == 2
    assert _snapshot(blocked) == {"model.safetensors": None, "model.safetensors/inside.txt": b"mine"}


def test_an_output_that_is_holds_or_lies_inside_the_source_is_refused(
    sources: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(sources["file"], run / "last.ckpt")
    shutil.copytree(sources["folder"], run / "sharded.ckpt")
    (run / "README.md").write_text("the run's notes")
    (tmp_path / "link").symlink_to(run, target_is_directory=True)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(run)
    to_st = ["--to", "safetensors", "--force"]
    cases = [
        (["consolidate", "last.ckpt", *to_st, "."], "it holds the source last.ckpt"),  # the working directory
        (["consolidate", str(run / "last.ckpt"), *to_st, str(run)], "it holds the source"),
        (
            ["consolidate", "last.ckpt", *to_st, str(tmp_path / "link")],
            "it holds the source",
        ),  # through a link
        (["consolidate", "sharded.ckpt", *to_st, "sharded.ckpt"], "it is the source itself"),
        (["consolidate", "sharded.ckpt", *to_st, "sharded.ckpt/hf"], "it is inside the source sharded.ckpt"),
        (["consolidate", "sharded.ckpt", *to_st, "."], "it holds the source"),
        (["consolidate", "sharded.ckpt", "--force", "."], "it holds the source"),  # to one file
        (["consolidate", "sharded.ckpt", "--force", "sharded.ckpt"], "it is the source itself"),
        (["consolidate", "sharded.ckpt", "--force", "sharded.ckpt/.metadata"], "it is inside the source"),
        (["consolidate", "sharded.ckpt", "--force", "../link/sharded.ckpt/x.pt"], "it is inside the source"),
    ]
    for args, why in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"Refused to write {args[-1]}: {why}" in err and "nothing was written" in err, (args, err)
    assert _snapshot(tmp_path) == before  # nothing written, nothing deleted

    url = f"memory://nested-{os.urandom(4).hex()}"
    fsspec.filesystem("memory").put(
        str(sources["folder"]), f"{url.removeprefix('memory://')}/sharded.ckpt", recursive=True
    )
    assert main(["consolidate", f"{url}/sharded.ckpt", *to_st, url]) == 2
    assert "it holds the source" in capsys.readouterr().err
