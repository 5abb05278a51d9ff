"""The reader table (``plugins/io/readers.py``): what a path holds, who reads it, and the IO import rule.

Each IO class reads and writes its own kind of checkpoint; a path of the other kind goes to that
kind's reader, so every IO loads both. Removing a sharded folder (one helper in the base, shared with
unpublishing a folder on an object store) makes it incomplete first and keeps what it did not write.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fsspec
import pytest
import torch

from trainer_core.checkpoint.rng import collect_rng_states
from trainer_core.paths import resolve
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO
from trainer_core.plugins.io.readers import FILE, SHARDED, is_sharded_checkpoint, kind_of

ROOT = Path(__file__).resolve().parents[2]
# Modules that hold an IO class; a wrapper may import the IO it wraps by default (TorchCheckpointIO).
IO_CLASS_MODULES = {"torch_io", "distributed_io", "async_io", "frozen_io"}
WRAPPER_DEFAULT = "trainer_core.plugins.io.torch_io"


def _checkpoint() -> dict:
    return {
        "format_version": 1,
        "trainer_core_version": "0",
        "epoch": 0,
        "global_step": 3,
        "state_dict": {"net.weight": torch.arange(12.0).reshape(3, 4), "net.bias": torch.ones(3)},
        "optimizer_states": [],
        "lr_schedulers": [],
        "loops": {},
        "callbacks": {},
        "rng_states": collect_rng_states(),
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("readers")
    paths = {"file": str(folder / "one.ckpt"), "sharded": str(folder / "sharded.ckpt")}
    TorchCheckpointIO().save_checkpoint(_checkpoint(), paths["file"])
    DistributedCheckpointIO().save_checkpoint(_checkpoint(), paths["sharded"])
    (folder / "plain").mkdir()
    paths["plain"], paths["missing"] = str(folder / "plain"), str(folder / "missing.ckpt")
    return paths


def test_kind_of_says_what_each_writer_wrote(written: dict[str, str]) -> None:
    kinds = {name: kind_of(*resolve(path)) for name, path in written.items()}
    assert kinds == {"file": FILE, "sharded": SHARDED, "plain": None, "missing": None}
    assert [is_sharded_checkpoint(path) for path in written.values()] == [False, True, False, False]


@pytest.mark.parametrize("io", [TorchCheckpointIO(), DistributedCheckpointIO()], ids=["torch", "distributed"])
def test_every_io_reads_both_kinds_the_same(io: object, written: dict[str, str]) -> None:
    for kind in ("file", "sharded"):
        loaded = io.load_checkpoint(written[kind])  # type: ignore[attr-defined]
        assert loaded["global_step"] == 3
        assert torch.equal(loaded["state_dict"]["net.weight"], torch.arange(12.0).reshape(3, 4))
        assert torch.equal(loaded["state_dict"]["net.bias"], torch.ones(3))


def test_a_path_of_neither_kind_is_reported_in_the_asking_ios_words(written: dict[str, str]) -> None:
    from trainer_core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="is a folder, not a checkpoint file or a sharded checkpoint"):
        TorchCheckpointIO().load_checkpoint(written["plain"])
    with pytest.raises(
        CheckpointError, match=r"is not a sharded trainer-core checkpoint \(no trainer_state.pt"
    ):
        DistributedCheckpointIO().load_checkpoint(written["plain"])
    with pytest.raises(CheckpointError, match="Checkpoint not found"):
        TorchCheckpointIO().load_checkpoint(written["missing"])
    with pytest.raises(CheckpointError, match="does not exist; pass the folder of a sharded checkpoint"):
        DistributedCheckpointIO().load_checkpoint(written["missing"])


def test_removing_a_sharded_folder_makes_it_incomplete_first_and_keeps_foreign_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "sharded.ckpt"
    DistributedCheckpointIO().save_checkpoint(_checkpoint(), str(folder))
    (folder / "notes.txt").write_text("mine")
    removed: list[str] = []
    local = type(fsspec.filesystem("file"))
    rm = local.rm

    def recording_rm(self: object, path: object, *args: object, **kwargs: object) -> None:
        removed.extend(Path(p).name for p in (path if isinstance(path, list) else [path]))
        rm(self, path, *args, **kwargs)

    monkeypatch.setattr(local, "rm", recording_rm)
    with pytest.warns(UserWarning, match="notes.txt, which trainer-core did not write"):
        TorchCheckpointIO().remove_checkpoint(str(folder))
    assert removed[0] == ".metadata" and removed[-1] == "trainer_state.pt"
    assert any(name.endswith(".distcp") for name in removed)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_no_io_class_imports_another_and_the_checkpoint_code_imports_none() -> None:
    """The import knot stays untied: formats meet in the reader table, never in each other's modules."""
    io_classes = {f"trainer_core.plugins.io.{name}" for name in IO_CLASS_MODULES}
    crossing = {
        name: sorted((_imports(ROOT / "plugins" / "io" / f"{name}.py") & io_classes) - {WRAPPER_DEFAULT})
        for name in IO_CLASS_MODULES
    }
    assert crossing == {name: [] for name in IO_CLASS_MODULES}
    for name in ("stream", "safetensors"):
        reached = {
            m for m in _imports(ROOT / "trainer_core" / "checkpoint" / f"{name}.py") if "plugins.io" in m
        }
        assert not reached & (io_classes | {"trainer_core.plugins.io.checkpoint_io"}), name
        assert not [m for m in reached if m.rsplit(".", 1)[-1].startswith("_")], name
