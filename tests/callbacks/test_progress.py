"""The progress bars on real runs: what the training and validation bars count and show.

(Rank zero only under 2 ranks is checked in tests/plugins/test_distributed.py::test_sync_dist_and_rank_zero_logging.)
"""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
import torch
from boring import random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, RichProgressBar, TQDMProgressBar
from trainer_core.errors import MisconfigurationException

BATCHES = 13


class Logged(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("hidden_metric", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n: int) -> DataLoader:
    return random_loader(n, 4)


class Probe(Callback):
    """Reads the bar's counters right after the bar handled each batch (it runs after the bar)."""

    def __init__(self, bar: TQDMProgressBar) -> None:
        self.bar = bar
        self.train_counts: list[int] = []
        self.val_counts: list[tuple[str, int, int]] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.train_counts.append(self.bar.train_progress_bar.n)

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        bar = self.bar.val_progress_bar
        self.val_counts.append((bar.desc, bar.n, bar.total))


def _fit(bar: Callback, *extra: Callback, **kwargs: Any) -> Trainer:
    seed_everything(0)
    trainer = Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=3,
        callbacks=[bar, *extra],
        **kwargs,
    )
    trainer.fit(Logged(), _loader(BATCHES), _loader(5))
    return trainer


def test_tqdm_refresh_rate_counts_and_validation_bar() -> None:
    out = io.StringIO()
    bar = TQDMProgressBar(refresh_rate=5, file=out)
    probe = Probe(bar)
    trainer = _fit(bar, probe, num_sanity_val_steps=1)
    assert trainer.progress_bar_callback is bar
    # Updated every 5 batches and at the last one.
    assert probe.train_counts == [0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10, 10, 13]
    # A sanity-check bar of 1 batch, then the epoch's validation bar of 3 batches, drawn at its last
    # (named per dataloader, as Lightning's).
    assert probe.val_counts == [
        ("Sanity Checking DataLoader 0: ", 1, 1),
        ("Validation DataLoader 0: ", 0, 3),
        ("Validation DataLoader 0: ", 0, 3),
        ("Validation DataLoader 0: ", 3, 3),
    ]
    text = out.getvalue()
    assert "Epoch 0" in text and "13/13" in text
    # The postfix shows the prog_bar metrics only, with their latest values.
    final = text.rsplit("Epoch 0", 1)[1]
    assert f"train_loss={trainer.progress_bar_metrics['train_loss']:.3g}" in final
    assert f"val_loss={trainer.progress_bar_metrics['val_loss']:.3g}" in final
    assert "hidden_metric" not in text


def test_tqdm_validation_bar_counts_every_batch_at_refresh_rate_one() -> None:
    bar = TQDMProgressBar(refresh_rate=1, file=io.StringIO())
    probe = Probe(bar)
    _fit(bar, probe, num_sanity_val_steps=0)
    assert probe.train_counts == list(range(1, BATCHES + 1))
    assert probe.val_counts == [("Validation DataLoader 0: ", n, 3) for n in (1, 2, 3)]


def test_tqdm_refresh_rate_zero_draws_nothing() -> None:
    out = io.StringIO()
    _fit(TQDMProgressBar(refresh_rate=0, file=out))
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="refresh_rate=-1"):
        TQDMProgressBar(refresh_rate=-1)


def test_rich_bar_draws_training_validation_and_metrics() -> None:
    pytest.importorskip("rich")
    out = io.StringIO()
    bar = RichProgressBar(console_kwargs={"file": out, "force_terminal": True, "width": 160})
    trainer = _fit(bar, num_sanity_val_steps=0)
    # The rich bar replaces the default one: no tqdm bar was added.
    assert trainer.progress_bar_callback is bar
    assert not any(isinstance(cb, TQDMProgressBar) for cb in trainer.callbacks)
    text = out.getvalue()
    assert "Epoch 0" in text and f"{BATCHES}/{BATCHES}" in text
    assert "Validation" in text and "3/3" in text
    assert f"train_loss: {trainer.progress_bar_metrics['train_loss']:.3f}" in text  # Lightning's format
    assert "hidden_metric" not in text
    assert bar.progress is None  # stopped at the end of training


def test_rich_bar_without_rich_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if rich were not installed: importing it fails.
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        MisconfigurationException, match=r"RichProgressBar needs the `rich` package.*pip install rich"
    ):
        RichProgressBar()


def test_rich_bar_bad_refresh_rate() -> None:
    pytest.importorskip("rich")
    with pytest.raises(MisconfigurationException, match="refresh_rate=-2"):
        RichProgressBar(refresh_rate=-2)
