"""Part 6 of the reliability suite: a checkpoint is data, never code, and never a key to other files.

* Every way in (``fit``/``validate`` with ``ckpt_path``, ``load_from_checkpoint``, the CLI) loads
  with ``weights_only=True``: a file that would run code is refused and runs nothing. A scan of the
  package's source checks that no load anywhere bypasses this.
* A path stored in a checkpoint (a callback's ``best_model_path``, the files it may delete, a
  sharded folder's shard names) never makes trainer-core open or delete a file outside the run's
  checkpoint folder.
* fsspec credentials (``storage_options``) never end up in a checkpoint, a log or an error message.
"""

from __future__ import annotations

import ast
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from boring import BoringModel, quiet_trainer, random_loader
from launch import ROOT
from malicious import RunsShell, metadata_with_shard_name
from torch.utils.data import DataLoader

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint
from trainer_core.errors import CheckpointError
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO

PACKAGE_FOLDERS = ("trainer_core", "plugins", "callbacks")
# The full unpickles in the package: the outcome ddp_spawn's rank 0 hands its parent, written moments
# before by our own process into a private (0700) temporary folder; and the torch-file reader, whole
# only inside trusted_unpickling (the user's explicit weights_only=False for one file).
TRUSTED_FULL_LOADS = {
    ("plugins/launchers.py", "SpawnLauncher.launch"),
    ("plugins/io/torch_file.py", "load_torch_file"),
}


def _loader() -> DataLoader:
    return random_loader(16, 4, batch_size=4)


@pytest.fixture
def malicious(tmp_path: Path) -> tuple[Path, Path]:
    """A real checkpoint whose hyper-parameters would run ``touch PWNED`` when unpickled."""
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(BoringModel(), _loader())
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    checkpoint = torch.load(good, weights_only=True)
    checkpoint["hyper_parameters"] = {"hidden": RunsShell(str(tmp_path / "PWNED"))}
    bad = tmp_path / "bad.ckpt"
    torch.save(checkpoint, bad)
    return bad, tmp_path / "PWNED"


# ---------------------------------------------------------------------- weights_only everywhere
def _calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """``(enclosing Class.function, call)`` for every call in ``tree``."""
    found = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
            else:
                if isinstance(child, ast.Call):
                    found.append((".".join(scope), child))
                visit(child, scope)

    visit(tree, [])
    return found


def test_no_load_in_the_package_can_run_code() -> None:
    unsafe = []
    for folder in PACKAGE_FOLDERS:
        for file in sorted((ROOT / folder).rglob("*.py")):
            relative = file.relative_to(ROOT).as_posix()
            for scope, call in _calls(ast.parse(file.read_text())):
                func = call.func
                name = ast.unparse(func)
                if name in ("torch.load", "pickle.load", "pickle.loads", "pickle.Unpickler"):
                    weights_only = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
                    safe = (
                        name == "torch.load" and isinstance(weights_only, ast.Constant) and weights_only.value
                    )
                    if not safe and (relative, scope) not in TRUSTED_FULL_LOADS:
                        unsafe.append(f"{relative}:{call.lineno} {scope}: {ast.unparse(call)}")
    assert not unsafe, "loads that could run a checkpoint's code:\n" + "\n".join(unsafe)


def test_load_from_checkpoint_and_evaluation_refuse_code(malicious: tuple[Path, Path]) -> None:
    bad, pwned = malicious
    with pytest.raises(CheckpointError, match=r"Refused to load .*bad\.ckpt.*posix\.system"):
        BoringModel.load_from_checkpoint(bad)
    trainer = quiet_trainer()
    with pytest.raises(CheckpointError, match="Refused to load"):
        trainer.validate(BoringModel(), _loader(), ckpt_path=str(bad))
    assert not pwned.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_cli_refuses_code_in_files_and_sharded_folders(
    malicious: tuple[Path, Path], tmp_path: Path
) -> None:
    bad, pwned = malicious
    trainer = quiet_trainer(max_steps=1, plugins=[DistributedCheckpointIO()])
    trainer.fit(BoringModel(), _loader())
    folder = tmp_path / "sharded.ckpt"
    trainer.save_checkpoint(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(RunsShell(str(pwned))))

    for args in (["inspect", str(bad)], ["consolidate", str(folder), str(tmp_path / "out.ckpt")]):
        proc = subprocess.run(
            [sys.executable, "-m", "trainer_core.checkpoint", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Refused to load" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not pwned.exists()
    assert not (tmp_path / "out.ckpt").exists()


# ---------------------------------------------------------------------- paths inside a checkpoint
def test_paths_in_a_checkpoint_never_reach_files_outside_its_folder(tmp_path: Path) -> None:
    """A crafted ModelCheckpoint state names a file outside the folder as a checkpoint it wrote."""
    victim = tmp_path / "precious.txt"
    victim.write_text("not a checkpoint")
    folder = tmp_path / "ckpts"

    def callback() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=str(folder), monitor="step", mode="max", save_top_k=2, every_n_train_steps=1
        )

    seed_everything(0, verbose=False)
    first = quiet_trainer(max_steps=2, enable_checkpointing=True, callbacks=[callback()])
    first.fit(BoringModel(), _loader())
    checkpoint = torch.load(folder / "epoch=0-step=2.ckpt", weights_only=True)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("ModelCheckpoint")]
    state = checkpoint["callbacks"][key]
    # The worst of the top k, and "written by this callback": the next save would delete it.
    state["best_k_models"][str(victim)] = torch.tensor(-1.0)
    state["written"] = [*state["written"], str(victim)]
    crafted = folder / "crafted.ckpt"
    torch.save(checkpoint, crafted)
    state["best_model_path"] = str(victim)  # what ckpt_path="best" would open
    torch.save(checkpoint, folder / "crafted-best.ckpt")

    resumed = quiet_trainer(max_steps=6, enable_checkpointing=True, callbacks=[callback()])
    resumed.fit(BoringModel(), _loader(), ckpt_path=str(crafted))
    assert victim.read_text() == "not a checkpoint"
    assert str(victim) not in resumed.checkpoint_callback.best_k_models

    restored = quiet_trainer(max_steps=2, enable_checkpointing=True, callbacks=[callback()])
    restored.fit(BoringModel(), _loader(), ckpt_path=str(folder / "crafted-best.ckpt"))
    best = restored.checkpoint_callback.best_model_path
    assert best != str(victim) and (not best or Path(best).parent == folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_shard_names_cannot_point_outside_the_folder(tmp_path: Path) -> None:
    trainer = quiet_trainer(max_steps=1, plugins=[DistributedCheckpointIO()])
    trainer.fit(BoringModel(), _loader())
    folder = tmp_path / "run" / "sharded.ckpt"
    trainer.save_checkpoint(folder)
    # A real shard, moved next to the folder: reading it would "work", which is exactly the danger.
    (shard,) = folder.glob("*.distcp")
    shutil.move(shard, tmp_path / "run" / "elsewhere.distcp")
    metadata_with_shard_name(folder, "../elsewhere.distcp")
    with pytest.raises(CheckpointError, match="outside the folder"):
        DistributedCheckpointIO().load_checkpoint(str(folder))
    metadata_with_shard_name(folder, str(tmp_path / "run" / "elsewhere.distcp"))  # an absolute path
    with pytest.raises(CheckpointError, match="outside the folder"):
        TorchCheckpointIO().load_checkpoint(str(folder))


# ---------------------------------------------------------------------- credentials
@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("io_kind", ["monolithic", "sharded"])
def test_storage_credentials_never_reach_checkpoints_logs_or_errors(
    io_kind: str, s3_server: Any, s3_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    key, secret = f"AKIA{uuid.uuid4().hex[:16].upper()}", f"s3cr3t-{uuid.uuid4().hex}"
    options = {"endpoint_url": s3_server.endpoint_url, "key": key, "secret": secret}
    io = (
        TorchCheckpointIO(storage_options=options)
        if io_kind == "monolithic"
        else DistributedCheckpointIO(options)
    )
    from trainer_core.loggers import CSVLogger

    seed_everything(0, verbose=False)
    trainer = Trainer(
        max_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        logger=CSVLogger(str(tmp_path / "logs")),
        log_every_n_steps=1,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=s3_url, every_n_train_steps=2, save_top_k=-1, save_last=True)],
    )
    trainer.fit(BoringModel(), _loader())
    resumed = Trainer(
        max_steps=6,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=s3_url, every_n_train_steps=2, save_top_k=-1, save_last=True)],
    )
    resumed.fit(BoringModel(), _loader(), ckpt_path="last")
    # A failing load reports the error without the credentials either.
    with pytest.raises(CheckpointError) as error:
        resumed.fit(BoringModel(), _loader(), ckpt_path=f"{s3_url}/missing.ckpt")

    fs = fsspec.filesystem("s3", **options)
    written = [fs.cat_file(path) for path in fs.find(s3_url)]
    written += [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    printed = capfd.readouterr()
    assert written and resumed.global_step == 6
    for blob in [*written, (printed.out + printed.err + str(error.value)).encode()]:
        assert secret.encode() not in blob and key.encode() not in blob


# ---------------------------------------------------------------------- the .metadata of a sharded folder
_META = "torch.distributed.checkpoint.metadata"


def _build_on_class() -> bytes:
    """GLOBAL Metadata, then BUILD with a slot state: ``setattr(Metadata, "planner_data", ...)`` on the class."""
    return (
        b"\x80\x04c" + _META.encode() + b"\nMetadata\n"
        b"N}\x8c\x0cplanner_data\x8c\x05PWNEDs\x86b."  # (None, {"planner_data": "PWNED"}) BUILD STOP
    )


def _build_on_enum_member() -> bytes:
    """REDUCE ``_MEM_FORMAT_ENCODING(0)`` (the process's one member), then BUILD ``{"_value_": 7}`` on it."""
    return b"\x80\x04c" + _META.encode() + b"\n_MEM_FORMAT_ENCODING\nK\x00\x85R}\x8c\x07_value_K\x07sb."


def _inst_opcode() -> bytes:
    """Protocol 0's INST: construct a class by calling it with arguments from the stream."""
    return b"(i" + _META.encode() + b"\nStorageMeta\n."


@pytest.fixture
def sharded_folder(tmp_path: Path) -> Path:
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(max_steps=1, plugins=[DistributedCheckpointIO()])
    trainer.fit(BoringModel(), _loader())
    folder = tmp_path / "sharded.ckpt"
    trainer.save_checkpoint(folder)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_cannot_set_attributes_on_allowed_classes(sharded_folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    class_state = dict(Metadata.__dict__)
    member = _MEM_FORMAT_ENCODING(0)
    member_state = dict(member.__dict__)
    for payload, refused in (
        (_build_on_class(), r"set attributes of torch\.distributed\.checkpoint\.metadata\.Metadata"),
        (_build_on_enum_member(), r"set attributes of a _MEM_FORMAT_ENCODING"),
        (_inst_opcode(), r"use the pickle opcode INST"),
    ):
        (sharded_folder / ".metadata").write_bytes(payload)
        with pytest.raises(
            CheckpointError, match=rf"Refused to load {sharded_folder}: its \.metadata asks to {refused}"
        ):
            DistributedCheckpointIO().load_checkpoint(str(sharded_folder))
        assert dict(Metadata.__dict__) == class_state and "PWNED" not in repr(Metadata.__dict__)
        assert dict(member.__dict__) == member_state and member.value == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_of_the_wrong_type_is_one_clear_error(sharded_folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    from trainer_core.checkpoint.stream import ShardedSource

    real = (sharded_folder / ".metadata").read_bytes()
    seed_everything(1, verbose=False)
    model = BoringModel()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    for wrong, described in (
        ([1, 2], "it holds a list, not a Metadata"),
        ({"state_dict_metadata": {}}, "it holds a dict"),
        (7, "it holds a int"),
        (
            Metadata(state_dict_metadata={}, storage_data=["__0_0.distcp"]),
            "storage_data is a list, not a dict",
        ),
    ):
        (sharded_folder / ".metadata").write_bytes(pickle.dumps(wrong))
        message = rf"Could not read {sharded_folder}/\.metadata: it is not the metadata of a sharded checkpoint \({described}"
        with pytest.raises(CheckpointError, match=message):
            DistributedCheckpointIO().load_checkpoint(str(sharded_folder))
        with pytest.raises(CheckpointError, match=message):
            ShardedSource(str(sharded_folder))  # what consolidate reads with
    with pytest.raises(CheckpointError, match=r"sharded\.ckpt/\.metadata: it is not the metadata"):
        quiet_trainer(max_steps=2).fit(model, _loader(), ckpt_path=str(sharded_folder))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    (sharded_folder / ".metadata").write_bytes(real)  # the real one still loads, through the checked reader
    assert DistributedCheckpointIO().load_checkpoint(str(sharded_folder))["global_step"] == 1
