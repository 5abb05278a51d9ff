"""``TensorBoardLogger(log_graph=...)``: Lightning's argument, and the graph drawn at each stage's start as Lightning
draws it (the project template's TensorBoard config passes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

import trainer_core as tc
from trainer_core.loggers import TensorBoardLogger


def module(framework: Any, example: bool) -> Any:
    class Net(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            if example:
                self.example_input_array = torch.zeros(2, 3)

        def forward(self, x: Any) -> Any:
            return self.layer(x)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self(batch[0]).sum()
            self.log("loss", loss)
            return loss

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", self(batch[0]).sum())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


def run(
    framework: Any, logger_cls: Any, root: Path, log_graph: bool, example: bool
) -> list[tuple[str, bool]]:
    """Fit then test; for each events file the run wrote (by folder), whether it holds a graph."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4)
    trainer = framework.Trainer(
        max_epochs=1,
        logger=logger_cls(root, name="tb", version=0, log_graph=log_graph),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    model = module(framework, example)
    trainer.fit(model, data)
    trainer.test(model, data, verbose=False)
    found = []
    for path in sorted(root.rglob("events.out.tfevents*")):
        events = EventAccumulator(str(path))
        events.Reload()
        found.append((path.parent.relative_to(root).as_posix(), events.Tags()["graph"]))
    return found


@pytest.mark.parametrize(("log_graph", "example"), [(True, True), (False, True), (True, False)])
def test_the_graph_is_drawn_when_lightning_draws_it(tmp_path: Path, log_graph: bool, example: bool) -> None:
    theirs = run(pl, pl.loggers.TensorBoardLogger, tmp_path / "pl", log_graph, example)
    ours = run(tc, TensorBoardLogger, tmp_path / "tc", log_graph, example)
    # Lightning starts a second events file for the test (its writer is closed at fit's end): one folder here.
    assert {folder for folder, _ in ours} == {folder for folder, _ in theirs} == {"tb/version_0"}
    assert any(graph for _, graph in ours) == any(graph for _, graph in theirs) == (log_graph and example)
