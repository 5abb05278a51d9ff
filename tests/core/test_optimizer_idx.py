"""A ``training_step(batch, batch_idx, optimizer_idx)`` (Lightning 1.x's several optimizers) is refused before a
step, under both frameworks, whether it has one optimizer or two; a keyword-only ``optimizer_idx`` is not."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import trainer_core as tc
from trainer_core.errors import MisconfigurationException


def module(framework: Any, keyword_only: bool = False) -> Any:
    class Legacy(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        if keyword_only:

            def training_step(self, batch: Any, batch_idx: int, *, optimizer_idx: int = 0) -> Any:
                return self.layer(batch).sum()
        else:

            def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int = 0) -> Any:
                return self.layer(batch).sum()

        def train_dataloader(self) -> Any:
            return DataLoader(torch.randn(8, 2, generator=torch.Generator().manual_seed(1)), batch_size=4)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Legacy()


def fit(framework: Any, model: Any, root: Any) -> None:
    framework.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    ).fit(model)


def test_an_optimizer_idx_argument_is_refused_before_any_step(tmp_path: Any) -> None:
    theirs = module(pl)
    before = theirs.layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match="optimizer_idx"):
        fit(pl, theirs, tmp_path / "pl")
    ours = module(tc)
    ours_before = ours.layer.weight.detach().clone()
    with pytest.raises(MisconfigurationException) as caught:
        fit(tc, ours, tmp_path / "tc")
    message = str(caught.value)
    assert "Legacy.training_step takes `optimizer_idx`" in message
    assert "self.automatic_optimization = False" in message
    assert torch.equal(ours.layer.weight, ours_before) and torch.equal(theirs.layer.weight, before)


def test_a_keyword_only_optimizer_idx_trains_as_in_lightning(tmp_path: Any) -> None:
    torch.manual_seed(0)
    theirs = module(pl, keyword_only=True)
    ours = module(tc, keyword_only=True)
    ours.load_state_dict(theirs.state_dict())
    fit(pl, theirs, tmp_path / "pl")
    fit(tc, ours, tmp_path / "tc")
    assert torch.equal(ours.layer.weight, theirs.layer.weight)
