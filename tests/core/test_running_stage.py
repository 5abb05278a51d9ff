"""``trainer.training``, ``trainer.validating``, ``trainer.sanity_checking`` and ``trainer.state`` at every hook equal
Lightning's: one running stage at a time (a module that picks its outputs list by ``trainer.training`` reads the
right one)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import trainer_core as tc

HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_validation_start",
    "on_validation_epoch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "on_test_start",
    "on_predict_start",
)


def state(trainer: Any) -> tuple[Any, ...]:
    st = trainer.state
    names = tuple(None if v is None else v.value for v in (st.fn, st.stage, st.status))
    return (*names, st.finished, st.stopped)


def flags_seen(framework: Any, root: Any) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []

    def note(module: Any, where: str) -> None:
        t = module.trainer
        seen.append((where, t.training, t.validating, t.sanity_checking, t.testing, t.predicting, state(t)))

    class Net(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            note(self, "training_step")
            return self.layer(batch).sum()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            note(self, "validation_step")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            note(self, "test_step")

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            note(self, "predict_step")
            return self.layer(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for hook in HOOKS:
        setattr(Net, hook, lambda self, hook=hook: note(self, hook))
    data = DataLoader(torch.randn(4, 2), batch_size=2)
    trainer = framework.Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    model = Net()
    seen.append(("built", state(trainer)))
    trainer.fit(model, data, data)
    seen.append(("after fit", trainer.training, trainer.validating, trainer.sanity_checking, state(trainer)))
    trainer.validate(model, data, verbose=False)
    seen.append(
        ("after validate", trainer.training, trainer.validating, trainer.sanity_checking, state(trainer))
    )
    trainer.test(model, data, verbose=False)
    trainer.predict(model, data)
    seen.append(("after predict", state(trainer)))
    model.test_step = lambda batch, batch_idx: 1 / 0
    try:
        trainer.test(model, data, verbose=False)
    except ZeroDivisionError:
        seen.append(("after an error", state(trainer)))
    return seen


def test_the_running_stage_flags_equal_lightnings_at_every_hook(tmp_path: Any) -> None:
    ours = flags_seen(tc, tmp_path / "tc")
    theirs = flags_seen(pl, tmp_path / "pl")
    assert ours == theirs
    sanity = ("fit", "sanity_check", "running", False, False)
    assert ("validation_step", False, False, True, False, False, sanity) in ours
    assert (
        "validation_step",
        False,
        True,
        False,
        False,
        False,
        ("fit", "validate", "running", False, False),
    ) in ours
    assert ours[-1] == ("after an error", ("test", None, "interrupted", False, True))
