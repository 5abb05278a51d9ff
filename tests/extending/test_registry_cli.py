"""A user's plugin registered by name and chosen from a LightningCLI YAML file, as a user does it.

The user writes a ``DDPPlugin`` subclass with a setting of its own, registers it under a name, and
chooses it from the YAML file, by that name or by ``class_path`` with the setting under ``init_args``.
Each run is a real two-rank run (gloo) of the user's script; both must use the user's class with
the setting the YAML (or the registration) gave, and train to exactly the weights of the same run
given the plugin object directly. ``override=True`` replaces a built-in name (checked in process,
where the registry is restored afterwards: it is global to the process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import job_env

pytest.importorskip("jsonargparse", reason="the CLI needs jsonargparse (extra 'cli' or 'test')")
import yaml

from trainer_core import LightningModule, Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import DDPPlugin, plugin_from_name, register_plugin

USER_PLUGINS = '''
from typing import Any

from trainer_core.plugins import DDPPlugin


class TaggedDDP(DDPPlugin):
    """DDP with one setting of the user's own."""

    def __init__(self, tag: str = "untagged", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag
'''

SCRIPT = """
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer
from trainer_core.cli import LightningCLI
from trainer_core.plugins import register_plugin
from trainer_core.seed import seed_everything
from user_plugins import TaggedDDP

register_plugin("tagged_ddp", TaggedDDP, tag="registered")


class Model(LightningModule):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def on_fit_start(self) -> None:
        torch.save(self.state_dict(), f"initial{self.global_rank}.pt")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 3, generator=gen), torch.randn(16, 1, generator=gen))
        return DataLoader(data, batch_size=2)


def record(trainer):
    plugin = trainer.strategy
    seen = {"class": type(plugin).__name__, "tag": plugin.tag, "world_size": trainer.world_size,
            "step": trainer.global_step}
    Path(f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))
    torch.save(trainer.lightning_module.state_dict(), f"rank{trainer.global_rank}.pt")


if sys.argv[1] == "direct":
    seed_everything(7)
    trainer = Trainer(strategy=TaggedDDP(tag=sys.argv[2]), **json.loads(sys.argv[3]))
    trainer.fit(Model())
    record(trainer)
else:
    record(LightningCLI(Model, save_config_callback=None).trainer)
"""

TRAINER = {
    "devices": 2,
    "accelerator": "cpu",
    "max_steps": 4,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _run(folder: Path, *args: str) -> list[dict[str, Any]]:
    """Run the user's script in ``folder`` (two ranks); what each rank recorded, with its weights."""
    folder.mkdir()
    proc = subprocess.run(
        [sys.executable, str(folder.parent / "train.py"), *args],
        cwd=folder,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = []
    for rank in range(2):
        seen = json.loads((folder / f"rank{rank}.json").read_text())
        seen["weights"] = torch.load(folder / f"rank{rank}.pt", weights_only=True)
        seen["initial"] = torch.load(folder / f"initial{rank}.pt", weights_only=True)
        ranks.append(seen)
    return ranks


def _config(folder: Path, name: str, strategy: Any) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 7, "trainer": {**TRAINER, "strategy": strategy}}))
    return path


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's module and script in ``tmp_path``; the module importable here too, for the YAML's class_path."""
    (tmp_path / "user_plugins.py").write_text(USER_PLUGINS)
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("user_plugins", None)


@pytest.mark.timeout(360)
def test_a_registered_name_chosen_in_the_yaml_runs_the_users_plugin(user_code: Path) -> None:
    by_name = _config(user_code, "by_name", "tagged_ddp")
    runs = {
        "by_name": _run(user_code / "by_name", "fit", "--config", str(by_name)),
        "direct": _run(user_code / "direct", "direct", "registered", json.dumps(TRAINER)),
    }
    # The user's class, with the registration's value, on both ranks of both runs.
    expected = {"class": "TaggedDDP", "tag": "registered", "world_size": 2, "step": 4}
    for ranks in runs.values():
        for seen in ranks:
            assert {key: seen[key] for key in expected} == expected
    reference, initial = runs["direct"][0]["weights"], runs["direct"][0]["initial"]
    assert any(not torch.equal(reference[key], initial[key]) for key in reference)  # it trained
    for run, ranks in runs.items():
        for rank, seen in enumerate(ranks):
            assert seen["weights"].keys() == reference.keys()
            for key in reference:
                assert torch.equal(seen["weights"][key], reference[key]), (run, rank, key)


def test_the_yaml_gives_the_users_plugin_its_argument(
    user_code: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``class_path`` with ``init_args``: the user's class with the YAML's value (built, not run: no process)."""
    from trainer_core.cli import LightningCLI

    by_class = _config(
        user_code, "by_class", {"class_path": "user_plugins.TaggedDDP", "init_args": {"tag": "from-yaml"}}
    )
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = LightningCLI(_Model, run=False, args=["--config", str(by_class)], save_config_callback=None)
    plugin = cli.trainer.strategy
    assert f"{type(plugin).__module__}.{type(plugin).__name__}" == "user_plugins.TaggedDDP"
    assert plugin.tag == "from-yaml"
    assert isinstance(plugin, DDPPlugin) and cli.trainer.world_size == 2
    assert cli.config.trainer.strategy.init_args.tag == "from-yaml"


class _Model(LightningModule):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, hidden)


class _OverridingDDP(DDPPlugin):
    def __init__(self, tag: str = "untagged", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag


def test_override_replaces_a_built_in_name() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"'ddp' already builds DDPPlugin\(start_method='popen'\)"
    ):
        register_plugin("ddp", _OverridingDDP, tag="mine")
    try:
        register_plugin("ddp", _OverridingDDP, override=True, tag="mine")
        trainer = Trainer(strategy="ddp", devices=2, logger=False, enable_progress_bar=False)
        assert type(trainer.strategy) is _OverridingDDP and trainer.strategy.tag == "mine"
        assert trainer.world_size == 2
        # The name is now the user's: its defaults are the user's, and arguments still reach the class.
        assert plugin_from_name("ddp", tag="given").tag == "given"
    finally:
        register_plugin("ddp", DDPPlugin, override=True, start_method="popen")
    restored = plugin_from_name("ddp")
    assert type(restored) is DDPPlugin and restored.start_method == "popen"
