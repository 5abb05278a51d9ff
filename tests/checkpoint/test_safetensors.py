"""``consolidate SRC --to safetensors OUT_DIR`` and ``load_safetensors``: Hugging Face's layout, bit for bit.

Sources are real checkpoint files and sharded folders of a module with every common dtype, a
non-contiguous buffer and a tied weight. Files are read back with the ``safetensors`` library and
compared bit for bit; a single file is byte-identical to what the library's own ``save`` writes.
Bad folders (missing or truncated shards, an index that does not match) are one error naming the
file, with the module unchanged.
"""

from __future__ import annotations

import json
import shutil
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
