"""``python -m trainer_core.checkpoint`` on real checkpoints: a 1-process file and a 2-rank FSDP sharded folder.

The CLI runs in a subprocess as a user runs it; its reports are checked against the numbers read
from the same checkpoints in this process, and the consolidated file is resumed by a real fit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import quiet_trainer
from dist_job import Net, data
from launch import JOBS, job_env
from torch.utils.data import DataLoader

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import Callback
from trainer_core.checkpoint.cli import main
from trainer_core.plugins.io import TorchCheckpointIO

STEPS_PER_EPOCH = 8  # data() has 64 samples, batches of 8
# The FSDP job: 2 ranks split the 64 samples, so 4 steps per epoch; its last folder is after 2 epochs.
SHARDED_STEP = 2 * 4


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _cli_all([list(args)], cwd)[0]


def _cli_all(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run the CLI once per argument list, all at once (most of each run is importing torch)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer_core.checkpoint", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    results = []
    for args, proc in zip(commands, procs):
        try:
            stdout, stderr = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return results


def _inspect_json(path: Path) -> dict[str, Any]:
    result = _cli("inspect", "--json", str(path), cwd=path.parent)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _tensor_totals(obj: Any) -> tuple[int, int]:
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    totals = [_tensor_totals(value) for value in values]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in ``obj`` by its path of keys."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


def _trainer(root: Path, max_epochs: int, callbacks: list[Callback] | None = None) -> Trainer:
    return quiet_trainer(max_epochs=max_epochs, default_root_dir=str(root), callbacks=callbacks or [])


@pytest.fixture(scope="module")
def single_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer]:
    """A checkpoint file written by a 1-process fit of one epoch (Adam)."""
    root = tmp_path_factory.mktemp("single")
    seed_everything(0, verbose=False)
    trainer = _trainer(root, max_epochs=1)
    trainer.fit(Net(), DataLoader(data(), batch_size=8))
    path = root / "single.ckpt"
    trainer.save_checkpoint(str(path))
    return path, trainer


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last folder a 2-rank FSDP job (sharded state dict, Adam) saved: 2 epochs, step 8."""
    tmp = tmp_path_factory.mktemp("fsdp")
    cmd = [sys.executable, str(JOBS / "dist_job.py"), "--plugin", "fsdp_sharded", "--devices", "2"]
    result = subprocess.run(
        [*cmd, "--out", "out", "--ckpt-every-epoch"],
        cwd=tmp,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp / "out" / "ckpts" / f"epoch=1-step={SHARDED_STEP}.ckpt"
    assert (folder / ".metadata").is_file(), sorted(p.name for p in (tmp / "out" / "ckpts").iterdir())
    return folder


def test_help_lists_both_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = _cli("--help", cwd=tmp_path)
    assert top.returncode == 0 and "inspect" in top.stdout and "consolidate" in top.stdout
    for command in ("inspect", "consolidate"):  # in this process: the same parser, without a torch import
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: python -m trainer_core.checkpoint {command}" in capsys.readouterr().out


def test_inspect_single_file(single_file: tuple[Path, Trainer]) -> None:
    path, trainer = single_file
    saved = TorchCheckpointIO().load_checkpoint(path)
    report = _inspect_json(path)

    assert report["global_step"] == STEPS_PER_EPOCH
    assert report["epoch"] == saved["epoch"] == trainer.current_epoch
    assert report["plugin"] == {
        "name": trainer.plugin.name,
        "world_size": 1,
        "layout": {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1},
        "precision": "32-true",
    }
    assert report["sharded"] is False and report["shard_files"] is None
    assert report["resumable"] is True
    assert report["keys"] == list(saved)
    # Net: two Linear layers = 4 parameters; Adam keeps exp_avg, exp_avg_sq and step for each.
    assert report["model"] == dict(zip(("tensors", "bytes"), _tensor_totals(saved["state_dict"])))
    assert report["model"]["tensors"] == 4
    assert report["optimizer"] == dict(zip(("tensors", "bytes"), _tensor_totals(saved["optimizer_states"])))
    assert report["optimizer"]["tensors"] == 12
    assert report["parameter_names"] == 4
    assert (report["optimizers"], report["lr_schedulers"]) == (1, 0)
    assert report["callbacks"] == list(saved.get("callbacks", {}))

    text = _cli("inspect", str(path), cwd=path.parent)
    assert text.returncode == 0, text.stderr
    assert re.search(rf"^global_step\s+{STEPS_PER_EPOCH}$", text.stdout, re.M)
    assert re.search(r"^sharded\s+no", text.stdout, re.M)
    assert re.search(rf"^model\s+4 tensors, {report['model']['bytes']} B", text.stdout, re.M)


@pytest.mark.timeout(180)
def test_inspect_sharded_folder(sharded_folder: Path) -> None:
    whole = TorchCheckpointIO().load_checkpoint(sharded_folder)
    report = _inspect_json(sharded_folder)

    assert report["global_step"] == SHARDED_STEP
    assert report["plugin"] == {
        "name": "fsdp",
        "world_size": 2,
        "layout": {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1},
        "precision": "32-true",
    }
    assert report["sharded"] is True
    assert report["shard_files"] == len(list(sharded_folder.glob("*.distcp"))) == 2
    assert report["model"] == {"tensors": 4, "bytes": _tensor_totals(whole["state_dict"])[1]}
    assert report["optimizer"] == {"tensors": 12, "bytes": _tensor_totals(whole["optimizer_states"])[1]}
    assert (report["parameter_names"], report["optimizers"]) == (4, 1)

    text = _cli("inspect", str(sharded_folder), cwd=sharded_folder.parent)
    assert text.returncode == 0, text.stderr
    assert re.search(r"^plugin\s+fsdp \(world size 2, layout \[dp=2\]\)$", text.stdout, re.M)
    assert re.search(r"^sharded\s+yes \(2 shard files\)$", text.stdout, re.M)
    assert re.search(rf"^global_step\s+{SHARDED_STEP}$", text.stdout, re.M)


class _RecordStart(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.global_step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.timeout(180)
def test_consolidate_writes_a_file_any_plugin_resumes(sharded_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "consolidated.ckpt"
    result = _cli("consolidate", str(sharded_folder), str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.is_file() and str(out) in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left behind

    folder = TorchCheckpointIO().load_checkpoint(sharded_folder)
    single = torch.load(out, weights_only=True)
    assert single["global_step"] == folder["global_step"] == SHARDED_STEP
    assert single["plugin"] == {
        "name": "fsdp",
        "world_size": 2,
        "layout": {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1},
        "precision": "32-true",
    }  # where it came from
    for part in ("state_dict", "optimizer_states"):
        expected, written = _tensors(folder[part]), _tensors(single[part])
        assert expected.keys() == written.keys() and expected
        for name, tensor in expected.items():
            assert torch.equal(written[name], tensor), f"{part}{name}"
    report = _inspect_json(out)
    assert report["sharded"] is False and report["global_step"] == SHARDED_STEP
    assert report["model"]["tensors"] == 4 and report["optimizer"]["tensors"] == 12

    # Resumed by a 1-process fit of the same module (the job ran "fsdp" on 2 ranks).
    start = _RecordStart()
    trainer = _trainer(tmp_path / "resume", max_epochs=3, callbacks=[start])
    trainer.fit(Net(), DataLoader(data(), batch_size=8), ckpt_path=str(out))
    assert start.global_step == SHARDED_STEP
    for name, tensor in single["state_dict"].items():
        assert torch.equal(start.weights[name], tensor), name
    assert trainer.global_step == SHARDED_STEP + STEPS_PER_EPOCH  # epoch 2 of 3, alone


@pytest.mark.timeout(180)
def test_bad_inputs_exit_2_with_one_line_naming_the_path(
    sharded_folder: Path,
    single_file: tuple[Path, Trainer],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = tmp_path / "missing.ckpt"
    weights = tmp_path / "weights.pt"  # a plain state_dict, not a trainer-core checkpoint
    torch.save(Net().state_dict(), weights)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all\n" * 10)
    folder = tmp_path / "some_folder"
    folder.mkdir()
    incomplete = tmp_path / "incomplete.ckpt"  # a save interrupted before .metadata was written
    shutil.copytree(sharded_folder, incomplete)
    (incomplete / ".metadata").unlink()
    single, _ = single_file
    out = tmp_path / "out.ckpt"
    existing = tmp_path / "existing.ckpt"
    existing.write_bytes(b"precious")

    cases = [
        (["inspect", str(missing)], missing),
        (["consolidate", str(missing), str(out)], missing),
        (["inspect", str(weights)], weights),
        (["inspect", str(garbage)], garbage),
        (["inspect", str(folder)], folder),
        (["inspect", str(incomplete)], incomplete),
        (["consolidate", str(incomplete), str(out)], incomplete),
        (["consolidate", str(single), str(out)], single),  # a file: nothing to consolidate
        (["consolidate", str(sharded_folder), str(existing)], existing),
    ]
    # A few as the user runs them (what reaches the terminal), every case through the same main().
    in_subprocess = [cases[0], cases[3], cases[6], cases[8]]
    for (args, path), result in zip(in_subprocess, _cli_all([args for args, _ in in_subprocess], tmp_path)):
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (args, result.stderr)
        assert str(path) in lines[0], (args, lines[0])
    for args, path in cases:
        assert main(args) == 2, args
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0], (args, captured.err)
        assert lines[0].startswith("python -m trainer_core.checkpoint: error: ")
    assert not out.exists()
    assert existing.read_bytes() == b"precious"

    assert main(["consolidate", "--force", str(sharded_folder), str(existing)]) == 0
    assert torch.load(existing, weights_only=True)["global_step"] == SHARDED_STEP
