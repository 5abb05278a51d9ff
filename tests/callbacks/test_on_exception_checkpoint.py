"""OnExceptionCheckpoint: a run that fails at batch k leaves a full checkpoint, and the run resumed from it
ends with the weights, optimizer state and learning rate of a run that never failed, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from boring import BoringModel, fast_trainer, random_data
from torch.utils.data import DataLoader

from trainer_core import seed_everything
from trainer_core.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from trainer_core.errors import MisconfigurationException

EPOCHS = 3
BATCHES = 5  # per epoch


class Crash(RuntimeError):
    pass


class Model(BoringModel):
    """Adam and a per-step schedule, so that a resume that lost the optimizer or scheduler state shows."""

    def __init__(self, fail_at: Optional[int] = None) -> None:
        super().__init__()
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.total_batch_idx == self.fail_at:
            raise Crash(f"failed at batch {self.fail_at}")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader() -> DataLoader:
    # Shuffled: the resumed epoch must draw the same order and skip the batches already done.
    return DataLoader(random_data(BATCHES * 2, 4), batch_size=2, shuffle=True)


def _fit(model: Model, callbacks: list[Any], ckpt_path: Optional[Path] = None) -> Any:
    trainer = fast_trainer(max_epochs=EPOCHS, callbacks=callbacks)
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("fail_at", [7, BATCHES, 0])  # mid-epoch; an epoch's first batch; the run's first
def test_resume_from_the_exception_checkpoint_is_exact(tmp_path: Path, fail_at: int) -> None:
    seed_everything(1)
    reference = Model()
    ref_trainer = _fit(reference, [])

    seed_everything(1)
    failing = Model(fail_at=fail_at)
    callback = OnExceptionCheckpoint(tmp_path)
    with pytest.raises(Crash):
        _fit(failing, [callback])
    path = tmp_path / "on_exception.ckpt"
    assert callback.ckpt_path == str(path) and path.is_file()
    saved = torch.load(path, weights_only=False)
    # A full checkpoint at the failure: the batch that raised is not done.
    assert saved["global_step"] == fail_at and saved["optimizer_states"] and saved["lr_schedulers"]

    seed_everything(123)  # a fresh process would start from other generators: the checkpoint brings them back
    resumed = Model()
    trainer = _fit(resumed, [OnExceptionCheckpoint(tmp_path)], ckpt_path=path)
    assert trainer.global_step == ref_trainer.global_step == EPOCHS * BATCHES
    for (name, a), b in zip(resumed.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(trainer.optimizers[0].state.values(), ref_trainer.optimizers[0].state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert trainer.optimizers[0].param_groups[0]["lr"] == ref_trainer.optimizers[0].param_groups[0]["lr"]
    # A run that ends without an error removes the file (Lightning's behaviour): it exists only after a failure.
    assert not path.exists()


def test_custom_file_name_and_no_file_without_a_failure(tmp_path: Path) -> None:
    callback = OnExceptionCheckpoint(tmp_path / "sub", filename="crash")
    assert callback.ckpt_path == str(tmp_path / "sub" / "crash.ckpt")
    _fit(Model(), [callback])
    assert not (tmp_path / "sub" / "crash.ckpt").exists()


def test_a_failing_save_does_not_hide_the_error(tmp_path: Path) -> None:
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the folder should be")
    # The save fails too; the user sees the run's own error, and the save's as a warning.
    with pytest.warns(UserWarning, match="OnExceptionCheckpoint could not save"), pytest.raises(Crash):
        _fit(Model(fail_at=2), [OnExceptionCheckpoint(blocked)])


def test_empty_file_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException, match="filename=''"):
        OnExceptionCheckpoint(tmp_path, filename="")
