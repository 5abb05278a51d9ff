"""ModelCheckpoint on real runs: which files exist afterwards, which are deleted, and what resumes."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
import torch
from resume_job import ResumeModule, dataloader, trainer_kwargs

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint
from trainer_core.errors import CheckpointError, MisconfigurationException


class ScoredModule(ResumeModule):
    """Logs a validation score that follows a fixed schedule, so the top-k set is known in advance."""

    SCORES = [0.5, 0.2, 0.9, 0.1, 0.7]

    def validation_step(self, batch, batch_idx):
        self.log("score", self.SCORES[self.current_epoch])


def _fit(model, callbacks, **kwargs):
    trainer = Trainer(**trainer_kwargs(enable_checkpointing=True, **kwargs), callbacks=callbacks)
    trainer.fit(model, dataloader(), dataloader(shuffle=False))
    return trainer


def _names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def test_top_k_keeps_the_best_and_deletes_the_rest(tmp_path: Path) -> None:
    seed_everything(0)
    cb = ModelCheckpoint(
        dirpath=tmp_path, monitor="score", mode="min", save_top_k=2, filename="{epoch}-{score:.2f}"
    )
    _fit(ScoredModule(), [cb], max_epochs=5)
    assert _names(tmp_path) == {"epoch=1-score=0.20.ckpt", "epoch=3-score=0.10.ckpt"}
    assert cb.best_model_path == str(tmp_path / "epoch=3-score=0.10.ckpt")
    assert float(cb.best_model_score) == pytest.approx(0.1)
    assert set(cb.best_k_models) == {str(tmp_path / n) for n in _names(tmp_path)}

    seed_everything(0)
    cb_max = ModelCheckpoint(
        dirpath=tmp_path / "max", monitor="score", mode="max", save_top_k=1, save_last=True
    )
    _fit(ScoredModule(), [cb_max], max_epochs=5)
    assert _names(tmp_path / "max") == {"epoch=2-step=39.ckpt", "last.ckpt"}


def test_never_deletes_files_it_did_not_write(tmp_path: Path) -> None:
    foreign = tmp_path / "epoch=0-step=13.ckpt"
    foreign.write_bytes(b"another run's checkpoint")
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path)  # keeps only the latest of its own
    _fit(ResumeModule(), [cb], max_epochs=3)
    assert foreign.read_bytes() == b"another run's checkpoint"
    assert other.read_text() == "keep me"
    # Its own first file took the name "-v1" instead of overwriting the foreign one, then was replaced.
    assert _names(tmp_path) == {"epoch=0-step=13.ckpt", "notes.txt", "epoch=2-step=39.ckpt"}


def test_every_n_train_steps_and_weights_only(tmp_path: Path) -> None:
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, save_weights_only=True)
    _fit(ResumeModule(), [cb], max_epochs=2)
    assert _names(tmp_path) == {f"epoch={s // 13}-step={s}.ckpt" for s in (5, 10, 15, 20, 25)}
    checkpoint = torch.load(tmp_path / "epoch=1-step=25.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 25 and "optimizer_states" not in checkpoint


def test_top_k_state_survives_a_resume(tmp_path: Path) -> None:
    seed_everything(0)
    first = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=2, save_last=True)
    _fit(ScoredModule(), [first], max_epochs=3)
    assert set(first.best_k_models) == {
        str(tmp_path / "epoch=0-step=13.ckpt"),
        str(tmp_path / "epoch=1-step=26.ckpt"),
    }

    second = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=2, save_last=True)
    trainer = Trainer(**trainer_kwargs(enable_checkpointing=True, max_epochs=5), callbacks=[second])
    trainer.fit(ScoredModule(), dataloader(), dataloader(shuffle=False), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "last.ckpt")
    # Epoch 3 (0.1) beats the restored 0.5 of epoch 0, whose file (written by the first run) is removed.
    assert _names(tmp_path) == {"epoch=1-step=26.ckpt", "epoch=3-step=52.ckpt", "last.ckpt"}
    assert second.best_model_path == str(tmp_path / "epoch=3-step=52.ckpt")


def test_last_resumes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    seed_everything(0)
    _fit(
        ResumeModule(),
        [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)],
        max_epochs=1,
    )
    trainer = Trainer(
        **trainer_kwargs(enable_checkpointing=True, max_epochs=2),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)],
    )
    trainer.fit(ResumeModule(), dataloader(), ckpt_path="last")
    assert trainer.ckpt_path.endswith("epoch=0-step=12.ckpt")
    assert trainer.global_step == 26


def test_missing_monitor_names_the_metric(tmp_path: Path) -> None:
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_acc")
    with pytest.raises(MisconfigurationException, match=r"val_acc.*val_loss"):
        _fit(ResumeModule(), [cb], max_epochs=1)


def test_memory_url(tmp_path: Path) -> None:
    url = "memory://ckpt-test/run"
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=url, monitor="score", save_top_k=1, save_last=True)
    _fit(ScoredModule(), [cb], max_epochs=2)
    fs = fsspec.filesystem("memory")
    names = {os.path.basename(p) for p in fs.ls("/ckpt-test/run", detail=False)}
    assert {"epoch=1-step=26.ckpt", "last.ckpt"} <= names
    assert not any(n.startswith("epoch=0") for n in names)
    loaded = ResumeModule.load_from_checkpoint(cb.best_model_path)
    assert loaded.hparams.hidden == 16


@pytest.mark.timeout(120)
def test_s3_dirpath_against_a_real_server(s3_url: str) -> None:
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=s3_url, monitor="score", save_top_k=1, save_last=True)
    _fit(ScoredModule(), [cb], max_epochs=2)
    fs, root = fsspec.core.url_to_fs(s3_url)
    names = {os.path.basename(p) for p in fs.ls(root, detail=False)}
    assert "epoch=1-step=26.ckpt" in names and "last.ckpt" in names
    assert not any(n.startswith("epoch=0") and n.endswith(".ckpt") for n in names)
    trainer = Trainer(
        **trainer_kwargs(enable_checkpointing=True, max_epochs=3),
        callbacks=[ModelCheckpoint(dirpath=s3_url, monitor="score", save_top_k=1, save_last=True)],
    )
    trainer.fit(ScoredModule(), dataloader(), dataloader(shuffle=False), ckpt_path="last")
    assert trainer.ckpt_path.endswith("last.ckpt") and trainer.global_step == 39


def test_evaluation_without_a_model_uses_the_best_checkpoint(tmp_path: Path) -> None:
    seed_everything(0)
    model = ScoredModule()
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="score", mode="min")
    trainer = _fit(model, [cb], max_epochs=3)
    best = ResumeModule.load_from_checkpoint(cb.best_model_path)
    assert cb.best_model_path.endswith("epoch=1-step=26.ckpt")
    # The final weights differ from the best epoch's; validate() without a model loads the best ones.
    assert not torch.equal(best.net[0].weight, model.net[0].weight)
    trainer.validate(dataloaders=dataloader(shuffle=False), verbose=False)
    assert trainer.ckpt_path == cb.best_model_path
    assert torch.equal(trainer.lightning_module.net[0].weight, best.net[0].weight)
    with pytest.raises(CheckpointError, match="best"):
        Trainer(**trainer_kwargs()).validate(model, dataloader(), ckpt_path="best")
