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


# ---------------------------------------------------------------------------------------------- LightningCLI
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from trainer_core.callbacks import Callback  # noqa: E402
from trainer_core.cli import LightningCLI, ReduceLROnPlateau, SaveConfigCallback  # noqa: E402
from trainer_core.datamodule import LightningDataModule  # noqa: E402
from trainer_core.module import LightningModule  # noqa: E402

pl = pytest.importorskip("pytorch_lightning")
import pytorch_lightning.cli as pl_cli  # noqa: E402


def _make(module_base: type, data_base: type) -> tuple[type, type]:
    """One model and data module, written once for either framework (the way a user's code is)."""

    class CLIModel(module_base):
        def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    class CLIData(data_base):
        def __init__(self, n: int = 16, batch_size: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()

        def _data(self, seed: int) -> TensorDataset:
            gen = torch.Generator().manual_seed(seed)
            n = self.hparams.n
            return TensorDataset(torch.randn(n, 3, generator=gen), torch.randn(n, 1, generator=gen))

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self._data(0), batch_size=self.hparams.batch_size)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self._data(1), batch_size=self.hparams.batch_size)

    return CLIModel, CLIData


CLIModel, CLIData = _make(LightningModule, LightningDataModule)
PLModel, PLData = _make(pl.LightningModule, pl.LightningDataModule)
QUIET_ARGS = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.logger=false",
]


@pytest.fixture
def no_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a script started without arguments: ``args=`` is the whole command line."""
    monkeypatch.setattr(sys, "argv", ["main.py"])


def _run_config(path: Path, root: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "seed_everything": 7,
                "trainer": {"max_epochs": 2, "default_root_dir": str(root), "limit_val_batches": 2},
                "model": {"hidden": 5, "lr": 0.2},
                "data": {"batch_size": 4},
                "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.5}},
                "lr_scheduler": {
                    "class_path": "torch.optim.lr_scheduler.StepLR",
                    "init_args": {"step_size": 1},
                },
            }
        )
    )
    return path


@pytest.mark.timeout(120)
def test_lightning_cli_runs_a_config_file_as_lightnings_does(tmp_path: Path, no_argv: None) -> None:
    """The same YAML under both CLIs: the same parsed values, the same seed, the same trained weights."""
    config = _run_config(tmp_path / "run.yaml", tmp_path)
    ours = LightningCLI(
        CLIModel,
        CLIData,
        args=["fit", "--config", str(config), *QUIET_ARGS, f"--trainer.default_root_dir={tmp_path / 'ours'}"],
    )
    theirs = pl_cli.LightningCLI(
        PLModel,
        PLData,
        args=["fit", "--config", str(config), *QUIET_ARGS, f"--trainer.default_root_dir={tmp_path / 'pl'}"],
    )
    for key in ("seed_everything", "model", "data", "optimizer", "lr_scheduler", "ckpt_path"):
        assert _plain(ours.config.fit[key]) == _plain(theirs.config.fit[key]), key
    assert ours.config.fit.model.hidden == 5 and ours.model.hparams.hidden == 5
    # configure_optimizers came from the config: SGD(lr=0.05, momentum=0.5) with StepLR(step_size=1).
    optimizer = ours.trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["momentum"] == 0.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.1**2)  # two epochs, two scheduler steps
    assert ours.trainer.global_step == theirs.trainer.global_step == 8
    for a, b in zip(ours.model.parameters(), theirs.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Both record the run's configuration in the log folder; the model/data/optimizer parts are the same.
    ours_saved = yaml.safe_load((tmp_path / "ours" / "config.yaml").read_text())
    theirs_saved = yaml.safe_load((tmp_path / "pl" / "config.yaml").read_text())
    for key in ("seed_everything", "model", "data", "optimizer", "lr_scheduler"):
        assert ours_saved[key] == theirs_saved[key], key


def _plain(value: Any) -> Any:
    return value.as_dict() if hasattr(value, "as_dict") else value


@pytest.mark.timeout(120)
def test_print_config_matches_lightnings_for_the_shared_parts(
    tmp_path: Path, no_argv: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _run_config(tmp_path / "run.yaml", tmp_path)
    printed = []
    for cli_class, model, data in ((LightningCLI, CLIModel, CLIData), (pl_cli.LightningCLI, PLModel, PLData)):
        with pytest.raises(SystemExit) as exit_info:
            cli_class(
                model, data, args=["fit", "--config", str(config), "--model.lr", "0.3", "--print_config"]
            )
        assert exit_info.value.code == 0
        printed.append(yaml.safe_load(capsys.readouterr().out))
    ours, theirs = printed
    for key in ("seed_everything", "model", "data", "optimizer", "lr_scheduler", "ckpt_path"):
        assert ours[key] == theirs[key], key
    assert ours["model"] == {"hidden": 5, "lr": 0.3}
    shared = set(ours["trainer"]) & set(theirs["trainer"])
    assert {"max_epochs", "limit_val_batches", "accumulate_grad_batches", "precision"} <= shared
    for key in ("max_epochs", "limit_val_batches", "default_root_dir"):
        assert ours["trainer"][key] == theirs["trainer"][key]


@pytest.mark.timeout(120)
def test_run_false_builds_the_objects_and_runs_nothing(tmp_path: Path, no_argv: None) -> None:
    cli = LightningCLI(
        CLIModel,
        CLIData,
        run=False,
        args=[
            "--model.hidden=3",
            "--data.n=8",
            "--trainer.max_epochs=1",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        trainer_defaults={"enable_progress_bar": False, "logger": False},
        seed_everything_default=11,
    )
    assert cli.subcommand is None and cli.config.model.hidden == 3 and cli.config.seed_everything == 11
    assert cli.trainer.global_step == 0 and cli.trainer.max_epochs == 1
    assert not (tmp_path / "config.yaml").exists()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2  # 8 samples, batch 4
    assert (tmp_path / "config.yaml").exists()  # written when the run set up


class _Recording(LightningCLI):
    """Uses each extension point a Lightning CLI subclass uses."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--notes", default="none")
        parser.link_arguments("data.batch_size", "model.hidden")  # a link, as Lightning's docs show
        parser.add_lightning_class_args(_StepCounter, "counter")

    def before_fit(self) -> None:
        self.calls = [("before_fit", self.trainer.global_step)]

    def after_fit(self) -> None:
        self.calls.append(("after_fit", self.trainer.global_step))


class _StepCounter(Callback):
    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.steps = 0

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps += 1


@pytest.mark.timeout(120)
def test_cli_hooks_links_and_added_callbacks(tmp_path: Path, no_argv: None) -> None:
    cli = _Recording(
        CLIModel,
        CLIData,
        args=["fit", "--data.batch_size=2", "--data.n=8", "--notes=hello", "--counter.every=3", "--trainer.max_epochs=1",
              f"--trainer.default_root_dir={tmp_path}", *QUIET_ARGS],
    )  # fmt: skip
    assert cli.calls == [("before_fit", 0), ("after_fit", 4)]
    assert cli.config.fit.notes == "hello"
    assert cli.model.hparams.hidden == 2  # linked from data.batch_size
    counters = [cb for cb in cli.trainer.callbacks if isinstance(cb, _StepCounter)]
    assert len(counters) == 1 and counters[0].every == 3 and counters[0].steps == 4
    assert any(isinstance(cb, SaveConfigCallback) for cb in cli.trainer.callbacks)


@pytest.mark.timeout(120)
def test_save_config_refuses_to_overwrite_another_runs_record(tmp_path: Path, no_argv: None) -> None:
    args = [
        "fit",
        "--data.n=4",
        "--trainer.max_epochs=1",
        f"--trainer.default_root_dir={tmp_path}",
        *QUIET_ARGS,
    ]
    LightningCLI(CLIModel, CLIData, args=args)
    first = (tmp_path / "config.yaml").read_text()
    with pytest.raises(RuntimeError, match="overwrite"):
        LightningCLI(CLIModel, CLIData, args=[*args, "--model.hidden=2"])
    LightningCLI(CLIModel, CLIData, args=[*args, "--model.hidden=2"], save_config_kwargs={"overwrite": True})
    second = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert second["model"]["hidden"] == 2 and first != (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").unlink()
    LightningCLI(CLIModel, CLIData, args=args, save_config_callback=None)
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.timeout(120)
def test_ckpt_path_brings_the_saved_hyperparameters(tmp_path: Path, no_argv: None) -> None:
    common = [f"--trainer.default_root_dir={tmp_path}", *QUIET_ARGS]
    fit = LightningCLI(
        CLIModel, CLIData, args=["fit", "--model.hidden=3", "--data.n=8", "--trainer.max_epochs=1", *common],
        save_config_callback=None,
    )  # fmt: skip
    path = tmp_path / "fit.ckpt"
    fit.trainer.save_checkpoint(path)
    validate = LightningCLI(
        CLIModel,
        CLIData,
        args=["validate", f"--ckpt_path={path}", "--data.n=8", *common],
        save_config_callback=None,
    )
    assert validate.model.hparams.hidden == 3  # not the default 8: the checkpoint's value
    for a, b in zip(validate.model.parameters(), fit.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reduce_lr_on_plateau_from_the_config_watches_its_monitor(tmp_path: Path, no_argv: None) -> None:
    cli = LightningCLI(
        CLIModel,
        CLIData,
        run=False,
        args=["--optimizer=SGD", "--optimizer.lr=0.1", "--lr_scheduler=trainer_core.cli.ReduceLROnPlateau",
              "--lr_scheduler.monitor=val_loss", f"--trainer.default_root_dir={tmp_path}"],
    )  # fmt: skip
    configured = cli.model.configure_optimizers()
    assert isinstance(configured["lr_scheduler"]["scheduler"], ReduceLROnPlateau)
    assert configured["lr_scheduler"]["monitor"] == "val_loss"


def test_without_jsonargparse_the_cli_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import trainer_core.cli as cli_module

    monkeypatch.setattr(cli_module, "_JSONARGPARSE_AVAILABLE", False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'trainer-core\[cli\]'"):
        LightningCLI(CLIModel, args=["fit"])
    assert main(["fit"]) == 2
    assert "pip install 'trainer-core[cli]'" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_ckpt_path_of_a_lightning_cli_run_brings_its_hyperparameters(tmp_path: Path, no_argv: None) -> None:
    """A checkpoint written under Lightning's own CLI (its hyper-parameters carry ``_instantiator``) validates here."""
    common = [f"--trainer.default_root_dir={tmp_path}", *QUIET_ARGS]
    theirs = pl_cli.LightningCLI(
        PLModel, PLData, args=["fit", "--model.hidden=3", "--data.n=8", "--trainer.max_epochs=1", *common],
        save_config_callback=None,
    )  # fmt: skip
    path = tmp_path / "pl.ckpt"
    theirs.trainer.save_checkpoint(path)
    assert "_instantiator" in torch.load(path, weights_only=True)["hyper_parameters"]
    ours = LightningCLI(
        CLIModel,
        CLIData,
        args=["validate", f"--ckpt_path={path}", "--data.n=8", *common],
        save_config_callback=None,
    )
    assert ours.model.hparams.hidden == 3
    for a, b in zip(ours.model.parameters(), theirs.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
