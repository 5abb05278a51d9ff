"""ModelCheckpoint on real runs: which files exist afterwards, which are deleted, and what resumes."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import fsspec
import pytest
import torch
from resume_job import ResumeModule, dataloader, trainer_kwargs

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import ModelCheckpoint
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO


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


# ---------------------------------------------------------------------- the options, one by one
class SlowModule(ResumeModule):
    def training_step(self, batch, batch_idx):
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


def test_train_time_interval_saves_by_wall_clock(tmp_path: Path) -> None:
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(seconds=0.05), save_top_k=-1)
    trainer = _fit(SlowModule(), [cb], max_epochs=2)
    saved = sorted(tmp_path.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    # 26 steps of at least 10 ms: several saves, each at least 50 ms after the one before.
    assert len(saved) >= 2
    times = [p.stat().st_mtime for p in saved]
    assert all(b - a >= 0.04 for a, b in zip(times, times[1:])), times
    steps = [torch.load(p, weights_only=True)["global_step"] for p in saved]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert trainer.global_step == 26
    with pytest.raises(MisconfigurationException, match="exclude each other"):
        ModelCheckpoint(train_time_interval=timedelta(minutes=1), every_n_train_steps=10)
    with pytest.raises(MisconfigurationException, match="train_time_interval=30"):
        ModelCheckpoint(train_time_interval=30)


@pytest.mark.parametrize("on_epoch_end, expected", [(None, {6, 12}), (True, {13})])
def test_save_on_train_epoch_end(tmp_path: Path, on_epoch_end, expected) -> None:
    """Validating twice per epoch saves after each validation, unless told to save at the epoch end."""
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_on_train_epoch_end=on_epoch_end)
    _fit(ScoredModule(), [cb], max_epochs=1, val_check_interval=0.5)
    assert _names(tmp_path) == {f"epoch=0-step={s}.ckpt" for s in expected}


def test_version_counter_off_overwrites_and_on_versions_last(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").write_bytes(b"another run's last")
    (tmp_path / "epoch=0-step=13.ckpt").write_bytes(b"another run's epoch 0")
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1)
    _fit(ResumeModule(), [cb], max_epochs=2)
    # Versioned, never overwritten or deleted: the other run's files are untouched.
    assert (tmp_path / "last.ckpt").read_bytes() == b"another run's last"
    assert cb.last_model_path == str(tmp_path / "last-v1.ckpt")
    assert torch.load(tmp_path / "last-v1.ckpt", weights_only=True)["global_step"] == 26
    assert (tmp_path / "epoch=0-step=13.ckpt").read_bytes() == b"another run's epoch 0"
    assert {"epoch=0-step=13-v1.ckpt", "epoch=1-step=26.ckpt"} <= _names(tmp_path)

    seed_everything(0)
    off = ModelCheckpoint(dirpath=tmp_path / "off", enable_version_counter=False, save_top_k=-1)
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "epoch=0-step=13.ckpt").write_bytes(b"stale")
    _fit(ResumeModule(), [off], max_epochs=1)
    assert torch.load(tmp_path / "off" / "epoch=0-step=13.ckpt", weights_only=True)["global_step"] == 13


def test_auto_insert_metric_name(tmp_path: Path) -> None:
    metrics = {"epoch": torch.tensor(3), "val/loss": torch.tensor(0.12345), "epoch_acc": torch.tensor(0.9)}
    on = ModelCheckpoint(dirpath=tmp_path, filename="{epoch:02d}-{epoch_acc:.1f}-{val/loss:.3f}")
    assert on.format_checkpoint_name(metrics) == str(tmp_path / "epoch=03-epoch_acc=0.9-val/loss=0.123.ckpt")
    off = ModelCheckpoint(
        dirpath=tmp_path, filename="e{epoch}-loss{val/loss:.2f}-{missing}", auto_insert_metric_name=False
    )
    assert off.format_checkpoint_name(metrics) == str(tmp_path / "e3-loss0.12-0.ckpt")
    assert off.format_checkpoint_name(metrics, ver=2) == str(tmp_path / "e3-loss0.12-0-v2.ckpt")

    seed_everything(0)
    cb = ModelCheckpoint(
        dirpath=tmp_path / "run",
        filename="ep{epoch}_score{score:.1f}",
        monitor="score",
        auto_insert_metric_name=False,
    )
    _fit(ScoredModule(), [cb], max_epochs=2)
    assert _names(tmp_path / "run") == {"ep1_score0.2.ckpt"}


def test_save_last_link_points_at_the_newest_checkpoint(tmp_path: Path) -> None:
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=1, save_last="link")
    _fit(ScoredModule(), [cb], max_epochs=4)
    # Epoch 3 (0.1) is the best and the newest: last.ckpt is a relative link to it, no second copy.
    assert _names(tmp_path) == {"epoch=3-step=52.ckpt", "last.ckpt"}
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=3-step=52.ckpt"
    assert cb.last_model_path == str(tmp_path / "last.ckpt")

    # Epoch 4 (0.7) is not in the top 1: last.ckpt then holds that newest state itself.
    seed_everything(0)
    trainer = Trainer(
        **trainer_kwargs(enable_checkpointing=True, max_epochs=5),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=1, save_last="link")],
    )
    trainer.fit(ScoredModule(), dataloader(), dataloader(shuffle=False), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "last.ckpt")
    assert not os.path.islink(tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 65
    assert _names(tmp_path) == {"epoch=3-step=52.ckpt", "last.ckpt"}
    with pytest.raises(MisconfigurationException, match="save_last='copy'"):
        ModelCheckpoint(save_last="copy")


def test_never_removes_the_checkpoint_the_run_resumed_from(tmp_path: Path) -> None:
    seed_everything(0)
    first = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=1)
    _fit(ScoredModule(), [first], max_epochs=1)
    start = tmp_path / "epoch=0-step=13.ckpt"
    assert _names(tmp_path) == {start.name}
    second = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=1)
    trainer = Trainer(**trainer_kwargs(enable_checkpointing=True, max_epochs=2), callbacks=[second])
    trainer.fit(ScoredModule(), dataloader(), dataloader(shuffle=False), ckpt_path=str(start))
    # Epoch 1 (0.2) replaced epoch 0 (0.5) in the top 1, yet the file the run started from stays.
    assert second.best_model_path == str(tmp_path / "epoch=1-step=26.ckpt")
    assert _names(tmp_path) == {start.name, "epoch=1-step=26.ckpt"}


@pytest.mark.timeout(120)
def test_s3_link_version_counter_and_foreign_files(s3_url: str) -> None:
    fs, root = fsspec.core.url_to_fs(s3_url)
    foreign = f"{root}/epoch=0-step=13.ckpt"
    fs.pipe(foreign, b"another run's checkpoint")
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=s3_url, monitor="score", save_top_k=1, save_last="link")
    _fit(ScoredModule(), [cb], max_epochs=4)
    names = {os.path.basename(p) for p in fs.ls(root, detail=False)}
    # The other run's object is untouched; this run's epoch 0 went to "-v1" and was replaced by epoch 1, then 3.
    assert fs.cat(foreign) == b"another run's checkpoint"
    assert {n for n in names if n.endswith(".ckpt")} == {
        "epoch=0-step=13.ckpt",
        "epoch=3-step=52.ckpt",
        "last.ckpt",
    }
    # No links on an object store: last.ckpt is a server-side copy, published with its commit marker.
    io = TorchCheckpointIO()
    assert io.is_complete(f"{s3_url}/last.ckpt")
    last = io.load_checkpoint(f"{s3_url}/last.ckpt")
    assert last["global_step"] == 52
    assert fs.size(f"{root}/last.ckpt") == fs.size(f"{root}/epoch=3-step=52.ckpt")
    assert io.latest_complete(s3_url) == f"{s3_url}/last.ckpt"


@pytest.mark.timeout(120)
def test_s3_sharded_folders_and_their_last_copy(s3_url: str) -> None:
    """Sharded (folder) checkpoints on an object store: replaced folders removed, `last` a complete copy."""
    seed_everything(0)
    cb = ModelCheckpoint(dirpath=s3_url, monitor="score", save_top_k=1, save_last="link")
    trainer = Trainer(
        **trainer_kwargs(enable_checkpointing=True, max_epochs=4),
        plugins=[DistributedCheckpointIO()],
        callbacks=[cb],
    )
    trainer.fit(ScoredModule(), dataloader(), dataloader(shuffle=False))
    fs, root = fsspec.core.url_to_fs(s3_url)
    assert {os.path.basename(p) for p in fs.ls(root, detail=False)} == {"epoch=3-step=52.ckpt", "last.ckpt"}
    io = DistributedCheckpointIO()
    assert io.is_complete(f"{s3_url}/last.ckpt") and fs.isfile(f"{root}/last.ckpt/.metadata")
    best, last = (io.load_checkpoint(f"{s3_url}/{n}") for n in ("epoch=3-step=52.ckpt", "last.ckpt"))
    assert last["global_step"] == best["global_step"] == 52
    for name, value in best["state_dict"].items():
        assert torch.equal(last["state_dict"][name], value)


def test_last_finds_the_previous_version_under_the_default_logger(tmp_path: Path) -> None:
    """A requeued job logs to version_1, yet ckpt_path="last" continues the run saved in version_0."""
    from trainer_core.loggers import CSVLogger

    def run(max_steps: int, ckpt_path=None):
        seed_everything(0)
        model = ResumeModule()
        trainer = Trainer(
            **trainer_kwargs(
                max_epochs=None,
                max_steps=max_steps,
                enable_checkpointing=True,
                logger=CSVLogger(str(tmp_path)),
                default_root_dir=str(tmp_path),
            ),
            callbacks=[ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)],
        )
        trainer.fit(model, dataloader(), ckpt_path=ckpt_path)
        return trainer, model

    _, uninterrupted = run(12)
    first, _ = run(8)
    assert (
        Path(first.checkpoint_callback.dirpath) == tmp_path / "lightning_logs" / "version_1" / "checkpoints"
    )
    second, resumed = run(12, ckpt_path="last")
    assert Path(second.checkpoint_callback.dirpath).parent.name == "version_2"
    assert (
        Path(second.ckpt_path)
        == tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=0-step=8.ckpt"
    )
    assert resumed.losses == uninterrupted.losses[8:]
