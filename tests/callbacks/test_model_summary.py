"""ModelSummary / RichModelSummary: Lightning's table, shown once when ``fit`` starts, from a dry run that
leaves the module as it was.

Compared with Lightning's own ``summarize`` on the same module (the table text, character for
character), and with a run without a summary (the weights a fit ends with).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from boring import fast_trainer, random_loader
from pytorch_lightning.utilities.model_summary import summarize as lightning_summarize
from torch import nn

from trainer_core import LightningModule
from trainer_core.callbacks.model_summary import ModelSummary, RichModelSummary
from trainer_core.errors import MisconfigurationException
from trainer_core.summary import summarize


def _module(base: type, example: bool = True) -> Any:
    """The same module under either framework: nested layers, a frozen head, a stray parameter, an eval layer."""

    class Net(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 16))
            self.norm = nn.BatchNorm1d(16)
            self.head = nn.Linear(16, 1)
            self.head.requires_grad_(False)
            self.scale = nn.Parameter(torch.ones(3))
            self.norm.eval()
            if example:
                self.example_input_array = torch.zeros(5, 4)
            self.forward_calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.forward_calls += 1
            return self.head(self.norm(self.encoder(x))) * self.scale[0]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


@pytest.mark.parametrize("max_depth", [1, 2, -1, 0])
@pytest.mark.parametrize("example", [True, False])
def test_table_is_lightnings(max_depth: int, example: bool) -> None:
    ours = str(summarize(_module(LightningModule, example), max_depth=max_depth))
    theirs = str(lightning_summarize(_module(pl.LightningModule, example), max_depth=max_depth))
    assert ours == theirs
    if example and max_depth == 1:
        assert (
            "0 | encoder      | Sequential  | 688    | train | 6.4 K | [5, 4]   | [5, 16]" in ours
        )  # encoder's in and out sizes
        assert "other params" in ours  # ``scale`` belongs to no layer


def test_numbers_of_the_summary() -> None:
    module = _module(LightningModule)
    summary = summarize(module, max_depth=-1)
    assert summary.layer_names == [
        "encoder",
        "encoder.0",
        "encoder.1",
        "encoder.2",
        "encoder.3",
        "norm",
        "head",
    ]
    assert summary.param_nums == [4 * 32 + 32 + 32 * 16 + 16, 160, 0, 0, 528, 32, 17]
    assert summary.in_sizes[0] == [5, 4] and summary.out_sizes[-1] == [5, 1]
    assert summary.training_modes == [True, True, True, True, True, False, True]
    total = 160 + 528 + 32 + 17 + 3
    assert summary.total_parameters == total and summary.trainable_parameters == total - 17
    assert summary.model_size == pytest.approx(total * 4e-6)
    # Linear layers: 2 * in * out FLOPs per sample.
    assert summary.total_flops == 2 * 5 * (4 * 32 + 32 * 16 + 16 * 1)
    # The parameters' bytes follow the precision (bf16 keeps 2 bytes a parameter).
    from trainer_core.summary import ModelSummary as Summary

    assert Summary(module, max_depth=1, precision="bf16-true").model_size == pytest.approx(total * 2e-6)


def test_dry_run_leaves_the_module_and_the_run_unchanged() -> None:
    torch.manual_seed(0)
    with_summary = _module(LightningModule)
    fast_trainer(callbacks=[ModelSummary(max_depth=-1)], limit_train_batches=4).fit(
        with_summary, random_loader(8, 4, batch_size=2)
    )
    torch.manual_seed(0)
    without = _module(LightningModule)
    fast_trainer(limit_train_batches=4).fit(without, random_loader(8, 4, batch_size=2))
    # One forward more (the dry run), then the same training: dropout's RNG, BN statistics, weights.
    assert with_summary.forward_calls == without.forward_calls + 1
    for (name, a), b in zip(with_summary.state_dict().items(), without.state_dict().values()):
        assert torch.equal(a, b), name
    # Each layer's mode as it was before the dry run (norm stays in eval); no gradients, BN statistics kept.
    module = _module(LightningModule)
    stats = module.norm.running_mean.clone()
    summarize(module, max_depth=-1)
    assert [m.training for m in module.modules()] == [True, True, True, True, True, True, False, True]
    assert all(p.grad is None for p in module.parameters())
    assert torch.equal(module.norm.running_mean, stats) and module.forward_calls == 1


def test_default_summary_is_added_once() -> None:
    from trainer_core import Trainer

    defaults = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False).callbacks
    assert [type(cb) for cb in defaults] == [RichModelSummary]  # rich is installed: Lightning's choice
    assert not any(
        isinstance(cb, ModelSummary)
        for cb in Trainer(logger=False, enable_checkpointing=False, enable_model_summary=False).callbacks
    )
    mine = ModelSummary(max_depth=2)
    given = Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[mine]
    ).callbacks
    assert given == [mine]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def trainer_core_log() -> Iterator[list[str]]:
    """What the ``trainer_core`` logger says during the test (the summary is logged at INFO, as Lightning's)."""
    handler = _Records()
    logger = logging.getLogger("trainer_core")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_plain_summary_logged_once_at_fit_start(trainer_core_log: list[str]) -> None:
    expected = str(summarize(_module(LightningModule), max_depth=2))
    fast_trainer(callbacks=[ModelSummary(max_depth=2)], limit_train_batches=1).fit(
        _module(LightningModule), random_loader(4, 4, batch_size=2)
    )
    tables = [m for m in trainer_core_log if "Total params" in m]
    assert tables == ["\n" + expected]


def test_rich_summary_printed_at_fit_start(capfd: pytest.CaptureFixture[str]) -> None:
    import rich

    rich.get_console().width = 160  # one line per row
    fast_trainer(callbacks=[RichModelSummary()], limit_train_batches=1).fit(
        _module(LightningModule), random_loader(4, 4, batch_size=2)
    )
    out = capfd.readouterr().out
    for text in ("In sizes", "Out sizes", "[5, 4]", "encoder", "Sequential", "Total params: 740", "eval"):
        assert text in out, text
    assert "Trainable params: 723" in out and "Non-trainable params: 17" in out


def test_max_depth_zero_shows_nothing(trainer_core_log: list[str]) -> None:
    fast_trainer(callbacks=[ModelSummary(max_depth=0)], limit_train_batches=1).fit(
        _module(LightningModule), random_loader(4, 4, batch_size=2)
    )
    assert not any("Total params" in m for m in trainer_core_log)


def test_bad_depth_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"ModelSummary\(max_depth=-2\)"):
        ModelSummary(max_depth=-2)


_RANDOM_AFTER_SEED = """
import hashlib, random, sys
import torch
if sys.argv[1] == "lightning":
    import pytorch_lightning as fw
else:
    import trainer_core as fw

def digest():
    return hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:12]

class Net(fw.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def on_fit_start(self):
        print("on_fit_start", digest())
    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2)

fw.seed_everything(3)
print("seeded", digest())
fw.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
           enable_progress_bar=False, default_root_dir=sys.argv[2]).fit(Net())
print("end", digest())
"""


def test_rich_summary_leaves_python_random_as_lightning(tmp_path: Any) -> None:
    """``rich.style`` draws from Python's ``random`` when first imported; Lightning imports rich with itself,
    before a program seeds, so a seeded program's draws do not move. The default (rich) summary at ``fit``
    must leave them where Lightning does (a fresh interpreter: rich not yet imported)."""
    import subprocess
    import sys

    from launch import job_env

    outputs = {}
    for framework in ("lightning", "trainer_core"):
        done = subprocess.run(
            [sys.executable, "-c", _RANDOM_AFTER_SEED, framework, str(tmp_path / framework)],
            env=job_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[framework] = [
            line
            for line in done.stdout.splitlines()
            if line.split(" ")[0] in ("seeded", "on_fit_start", "end")
        ]
    assert outputs["trainer_core"] == outputs["lightning"]
    assert len({line.split(" ")[1] for line in outputs["lightning"]}) == 1
