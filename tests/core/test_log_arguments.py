"""Every argument ``self.log``, ``self.log_dict`` and ``load_from_checkpoint`` accept does what Lightning's does.

``add_dataloader_idx=False`` keeps a name as written with several evaluation dataloaders, and that
name belongs to the dataloader that logged it; ``sync_dist_group`` reduces over the given process
group only, as ``all_gather(group=...)`` gathers from it only (a real 2-rank gloo run, where each
rank's group is itself); ``rank_zero_only=True`` is
never reduced, so logging it on rank 0 alone cannot hang the run; ``metric_attribute``, which only
serves to log a ``torchmetrics.Metric`` object (not accepted here), is refused with what to do
instead; ``hparams_file`` (YAML or Lightning's CSV) replaces the checkpoint's values of the names it
holds, and keyword arguments win over both.

Run as a script (``python test_log_arguments.py --out DIR``), this file is the 2-rank job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import launch
import pytest
import torch
import torch.distributed as dist
from boring import fast_trainer, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import CSVLogger


def _loader(n: int) -> DataLoader:
    return random_loader(n, features=3, batch_size=4)


class Net(LightningModule):
    """``val_log(module, batch_idx, dataloader_idx)`` runs in ``validation_step``."""

    def __init__(
        self,
        hidden: int = 4,
        lr: float = 0.1,
        val_log: Optional[Callable[..., None]] = None,
        train_log: Optional[Callable[..., None]] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters("hidden", "lr")
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.val_log = val_log
        self.train_log = train_log

    def training_step(self, batch, batch_idx):
        if self.train_log is not None:
            self.train_log(self, batch_idx)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if self.val_log is not None:
            self.val_log(self, batch_idx, dataloader_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


# ---------------------------------------------------------------------- add_dataloader_idx
def _validate_two_loaders(val_log: Callable[..., None]) -> list[dict[str, float]]:
    # 8 samples in loader 0, 4 in loader 1: each logs its batch index, so the epoch means differ.
    return fast_trainer().validate(Net(val_log=val_log), dataloaders=[_loader(8), _loader(4)], verbose=False)


def _log_per_loader(module: LightningModule, batch_idx: int, dataloader_idx: int) -> None:
    module.log(f"own_{dataloader_idx}", float(batch_idx + 10 * dataloader_idx), add_dataloader_idx=False)
    module.log("shared", float(batch_idx))


def test_add_dataloader_idx_false_keeps_the_name_as_logged():
    results = _validate_two_loaders(_log_per_loader)
    # Loader 0: batch indices 0, 1 -> 0.5; loader 1: one batch, 10 + 0.
    assert results[0]["own_0"] == pytest.approx(0.5)
    assert results[1]["own_1"] == pytest.approx(10.0)
    # The default still appends the index.
    assert results[0]["shared/dataloader_idx_0"] == pytest.approx(0.5)
    assert results[1]["shared/dataloader_idx_1"] == pytest.approx(0.0)
    assert not any(key.startswith("own_") and "/dataloader_idx_" in key for res in results for key in res)


def test_a_name_without_the_index_belongs_to_the_dataloader_that_logged_it():
    results = _validate_two_loaders(_log_per_loader)
    assert results == [
        {"own_0": pytest.approx(0.5), "shared/dataloader_idx_0": pytest.approx(0.5)},
        {"own_1": pytest.approx(10.0), "shared/dataloader_idx_1": pytest.approx(0.0)},
    ]


def test_log_dict_passes_add_dataloader_idx_on():
    def val_log(module: LightningModule, batch_idx: int, dataloader_idx: int) -> None:
        module.log_dict({f"d{dataloader_idx}": float(dataloader_idx)}, add_dataloader_idx=False)

    results = _validate_two_loaders(val_log)
    assert results[0]["d0"] == pytest.approx(0.0)
    assert results[1]["d1"] == pytest.approx(1.0)


def test_one_name_without_the_index_from_two_dataloaders_is_refused():
    def val_log(module: LightningModule, batch_idx: int, dataloader_idx: int) -> None:
        module.log("loss", 1.0, add_dataloader_idx=False)

    with pytest.raises(MisconfigurationException, match=r"'loss'.*two dataloaders.*dataloader_idx_0"):
        _validate_two_loaders(val_log)


# ---------------------------------------------------------------------- metric_attribute
def test_metric_attribute_is_accepted_as_in_lightning():
    # Lightning uses it to find a logged torchmetrics Metric again; nothing here needs it, so it changes nothing
    # (tests/core/test_torchmetrics.py covers logging Metric objects).
    def train_log(module: LightningModule, batch_idx: int) -> None:
        module.log("acc", 0.5, metric_attribute="train_acc")

    trainer = fast_trainer(max_steps=1)
    trainer.fit(Net(train_log=train_log), _loader(8))
    assert float(trainer.callback_metrics["acc"]) == 0.5


# ---------------------------------------------------------------------- hparams_file
@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A checkpoint of ``Net(hidden=4, lr=0.1)`` after one step."""
    trainer = fast_trainer(max_steps=1)
    trainer.fit(Net(hidden=4, lr=0.1), _loader(8))
    path = tmp_path / "net.ckpt"
    trainer.save_checkpoint(path)
    return path


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_hparams_file_yaml_overrides_the_checkpoint(checkpoint: Path, tmp_path: Path):
    pytest.importorskip("yaml")
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("# tuned after the run\nlr: 0.5\n")
    model = Net.load_from_checkpoint(checkpoint, hparams_file=hparams)
    assert model.hparams.lr == 0.5
    assert model.hparams.hidden == 4  # a name the file does not hold keeps the checkpoint's value
    assert _same_weights(model, Net.load_from_checkpoint(checkpoint))
    # Keyword arguments win over the file.
    assert Net.load_from_checkpoint(checkpoint, hparams_file=hparams, lr=0.7).hparams.lr == 0.7


def test_hparams_file_csv_overrides_the_checkpoint(checkpoint: Path, tmp_path: Path):
    hparams = tmp_path / "tags.csv"
    hparams.write_text("key,value\nlr,0.25\n")
    model = Net.load_from_checkpoint(checkpoint, hparams_file=str(hparams))
    assert model.hparams.lr == 0.25 and isinstance(model.hparams.lr, float)
    assert model.hparams.hidden == 4


def test_the_hparams_file_a_logger_wrote_is_read_back_even_without_pyyaml(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # With PyYAML a logger writes Lightning's YAML; without it JSON (YAML too), which reads back without it.
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` fails, as without PyYAML
    logger = CSVLogger(tmp_path / "logs")
    logger.log_hyperparams({"hidden": 4, "lr": 0.3})
    written = Path(logger.log_dir) / "hparams.yaml"
    assert Net.load_from_checkpoint(checkpoint, hparams_file=written).hparams.lr == 0.3


def test_yaml_without_pyyaml_is_refused_naming_the_package(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("lr: 0.5\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(MisconfigurationException, match=r"hparams\.yaml.*pip install pyyaml"):
        Net.load_from_checkpoint(checkpoint, hparams_file=hparams)


@pytest.mark.parametrize(
    ("name", "content", "error", "match"),
    [
        ("hparams.json", "{}", MisconfigurationException, r"hparams\.json.*\.yaml, \.yml or \.csv"),
        ("missing.yaml", None, FileNotFoundError, r"missing\.yaml.*no such file"),
        ("list.yaml", "[1, 2]", MisconfigurationException, r"list\.yaml.*holds a list"),
    ],
)
def test_a_bad_hparams_file_is_refused_naming_it(
    checkpoint: Path, tmp_path: Path, name: str, content: Optional[str], error: type, match: str
):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(error, match=match):
        Net.load_from_checkpoint(checkpoint, hparams_file=path)


# ---------------------------------------------------------------------- sync_dist_group, on 2 ranks
class GroupLogNet(LightningModule):
    """Rank r logs ``10 * (r + 1) + batch_idx``: over its own group, over all ranks, and on rank 0 alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.own_group: Any = None
        self.gathered: dict[str, list] = {}

    def setup(self, stage: str) -> None:
        # Every rank takes part in creating every group (torch's rule); each then logs over its own.
        groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
        self.own_group = groups[dist.get_rank()]

    def training_step(self, batch, batch_idx):
        value = torch.tensor(10.0 * (self.global_rank + 1) + batch_idx)
        self.log("own", value, sync_dist=True, sync_dist_group=self.own_group, on_step=False, on_epoch=True)
        self.log("own_step", value, sync_dist=True, sync_dist_group=self.own_group)
        self.log("world", value, sync_dist=True, on_step=False, on_epoch=True)
        if self.global_rank == 0:
            self.log("zero", value, sync_dist=True, rank_zero_only=True, on_step=False, on_epoch=True)
        if batch_idx == 0:
            rank = torch.tensor([float(self.global_rank)])
            self.gathered = {
                "own": self.all_gather(rank, group=self.own_group).tolist(),
                "world": self.all_gather(rank).tolist(),
            }
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _job(out: Path) -> None:
    trainer = fast_trainer(plugins="ddp", devices=2, accelerator="cpu")
    # 16 samples in batches of 4 over 2 ranks: batch indices 0 and 1 on each.
    module = GroupLogNet()
    trainer.fit(module, _loader(16))
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    result = {"metrics": metrics, "gathered": module.gathered}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(180)
def test_sync_dist_group_and_all_gather_group_use_that_group_only(tmp_path: Path):
    env = launch.job_env()
    # The job imports the shared helpers as this file does under pytest.
    helpers = str(Path(launch.__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (helpers, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, "--out", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    rank0, rank1 = (result["metrics"] for result in results)
    # Over its own group a rank keeps its own numbers: the mean of 10, 11 and of 20, 21.
    assert rank0["own"] == pytest.approx(10.5)
    assert rank1["own"] == pytest.approx(20.5)
    assert (rank0["own_step"], rank1["own_step"]) == (pytest.approx(11.0), pytest.approx(21.0))
    # Over all ranks (no group): the mean of all four values, on both ranks.
    assert rank0["world"] == rank1["world"] == pytest.approx(15.5)
    # Logged on rank 0 alone with sync_dist=True: not reduced (it would wait for rank 1 forever).
    assert rank0["zero"] == pytest.approx(10.5)
    assert "zero" not in rank1
    # all_gather(group=...) gathers from the group's ranks only.
    for rank, result in enumerate(results):
        assert result["gathered"] == {"own": [[float(rank)]], "world": [[0.0], [1.0]]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    _job(parser.parse_args().out)
