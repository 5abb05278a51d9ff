"""Part 5 of the reliability suite: a long run that checkpoints often stays bounded.

``LOAD_STEPS`` steps (2,000 in CI; ``make stress`` runs 10,000) with a checkpoint every 10 steps,
``save_top_k=3`` and ``last.ckpt``: the checkpoint folder never holds more than 3 + 1 checkpoints
and no temporary file, the process's resident memory at the end is within 5% of what it was after
warm-up, and no file descriptor is left open. Run with the synchronous and the background writer.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import BoringModel, random_data
from torch.utils.data import DataLoader

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint
from trainer_core.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

STEPS = int(os.environ.get("LOAD_STEPS", "2000"))
EVERY = 10
TOP_K = 3
WARMUP = max(200, STEPS // 10)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_fds() -> list[str]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed already
    return sorted(fds)


class Watch(Callback):
    """Samples files, memory and descriptors; checks the folder after every save."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.most_checkpoints = 0
        self.warm: dict[str, Any] = {}
        self.end: dict[str, Any] = {}

    def _sample(self) -> dict[str, Any]:
        wait = getattr(self.io, "wait", None)
        if wait is not None:
            wait()  # a background write in flight holds a file open: measure between writes
        gc.collect()
        return {"rss": _rss(), "fds": _open_fds()}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.io = trainer.strategy.checkpoint_io

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % EVERY == 0 and self.folder.exists():
            names = [p.name for p in self.folder.iterdir()]
            self.most_checkpoints = max(
                self.most_checkpoints, sum(n.endswith(".ckpt") and not n.startswith(".") for n in names)
            )
        if step == WARMUP:
            self.warm = self._sample()
        if step == trainer.max_steps:
            self.end = self._sample()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_long_run_keeps_files_memory_and_descriptors_bounded(kind: str, tmp_path: Path) -> None:
    seed_everything(0, verbose=False)
    folder = tmp_path / "ckpts"
    watch = Watch(folder)
    data = random_data(256, 32)
    trainer = Trainer(
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AsyncCheckpointIO() if kind == "async" else TorchCheckpointIO()],
        callbacks=[
            ModelCheckpoint(
                dirpath=str(folder),
                every_n_train_steps=EVERY,
                monitor="step",
                mode="max",
                save_top_k=TOP_K,
                save_last=True,
            ),
            watch,
        ],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only add contention on a shared machine
    started = time.perf_counter()
    try:
        trainer.fit(
            BoringModel(features=32, hidden=64, lr=1e-3), DataLoader(data, batch_size=16, shuffle=True)
        )
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - started

    final = sorted(p.name for p in folder.iterdir())
    growth = (watch.end["rss"] - watch.warm["rss"]) / watch.warm["rss"]
    figures = {
        "steps": STEPS,
        "saves": STEPS // EVERY,
        "most_checkpoints_in_folder": watch.most_checkpoints,
        "files_at_end": len(final),
        "rss_after_warmup_mib": round(watch.warm["rss"] / 2**20, 1),
        "rss_at_end_mib": round(watch.end["rss"] / 2**20, 1),
        "rss_growth_percent": round(100 * growth, 2),
        "open_fds_after_warmup": len(watch.warm["fds"]),
        "open_fds_at_end": len(watch.end["fds"]),
        "seconds": round(seconds, 1),
    }
    print(f"\nload ({kind}): {figures}")
    report = os.environ.get("RELIABILITY_REPORT")
    if report:
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / f"load_{kind}.json").write_text(json.dumps(figures, indent=1))

    assert trainer.global_step == STEPS
    assert watch.most_checkpoints <= TOP_K + 1, f"up to {watch.most_checkpoints} checkpoints at once"
    assert len(final) == TOP_K + 1 and "last.ckpt" in final, final
    assert not [name for name in final if name.startswith(".")]  # no temporary left behind
    assert growth <= 0.05, f"RSS grew {100 * growth:.1f}% after warm-up"
    leaked = sorted(set(watch.end["fds"]) - set(watch.warm["fds"]))
    assert len(watch.end["fds"]) <= len(watch.warm["fds"]), f"descriptors left open: {leaked}"
