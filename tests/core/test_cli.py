"""``python -m trainer_core fit --config run.yaml``: the demo run from its configuration file.

``--print_config`` must give a complete configuration that runs as a config itself, and every run
writes that same configuration (with the seed it used) into its log folder.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import ROOT

pytest.importorskip("jsonargparse", reason="the CLI needs jsonargparse (extra 'cli' or 'test')")
pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn (extra 'demo' or 'test')")
import yaml

from trainer_core.cli import main

CONFIG = ROOT / "examples" / "digits.yaml"
SHORT = (
    "--trainer.max_epochs",
    "2",
    "--trainer.limit_train_batches",
    "8",
    "--trainer.enable_progress_bar",
    "false",
)


@pytest.fixture
def in_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Relative paths of the config land in ``tmp_path``; ``examples.digits`` imports from the repository root."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    return tmp_path


@pytest.mark.timeout(120)
def test_print_config_round_trips_and_the_run_records_it(in_run_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_core", "fit", "--config", str(CONFIG), *SHORT, "--print_config"],
        cwd=in_run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = yaml.safe_load(proc.stdout)
    # Complete: the defaults the file left out are there, and the overrides.
    assert printed["trainer"]["max_epochs"] == 2 and printed["trainer"]["accumulate_grad_batches"] == 1
    assert printed["model"]["class_path"] == "examples.digits.DigitsClassifier"
    assert printed["model"]["init_args"]["lr"] == 0.003
    assert printed["data"]["init_args"]["val_fraction"] == 0.15
    full = in_run_dir / "full.yaml"
    full.write_text(proc.stdout)

    assert main(["fit", "--config", str(full)]) == 0

    log_dir = in_run_dir / "demo_runs" / "lightning_logs" / "version_0"
    assert yaml.safe_load((log_dir / "config.yaml").read_text()) == printed
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    val_acc = [float(r["val_acc"]) for r in rows if r["val_acc"]]
    assert len(val_acc) == 2 and val_acc[-1] > 0.2  # 16 steps: well above chance (0.1)
    last = torch.load(log_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (1, 16)
    assert last["hyper_parameters"]["lr"] == 0.003


@pytest.mark.timeout(120)
def test_a_recorded_config_repeats_the_run_exactly(in_run_dir: Path) -> None:
    """The seed drawn for ``seed_everything: true`` is written down, so the record reproduces the weights."""
    args = ["fit", "--config", str(CONFIG), *SHORT, "--trainer.max_epochs", "1", "--seed_everything", "true"]
    assert main(args) == 0
    first = in_run_dir / "demo_runs" / "lightning_logs" / "version_0"
    recorded = yaml.safe_load((first / "config.yaml").read_text())
    assert isinstance(recorded["seed_everything"], int) and recorded["seed_everything"] is not True

    assert main(["fit", "--config", str(first / "config.yaml")]) == 0
    second = in_run_dir / "demo_runs" / "lightning_logs" / "version_1"
    weights = [
        torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for d in (first, second)
    ]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_a_wrong_class_path_is_one_clear_error(in_run_dir: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--model", "examples.digits.NoSuchModel"])
    assert exit_info.value.code == 2
    assert "NoSuchModel" in capsys.readouterr().err
    assert not (in_run_dir / "demo_runs").exists()
