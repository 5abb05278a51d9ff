"""Part 4 of the reliability suite: a rank killed with SIGKILL, and a rank that hangs.

Two ranks (``plugins="ddp"``, gloo on 127.0.0.1) train with a checkpoint after every step; at step
3 one rank is killed with SIGKILL or stops answering (it sleeps while the other waits in the
gradient all-reduce). The run must end, every process of it, with a clear error within the
configured collective timeout (here 10 s; ``DDPPlugin``'s default is 10 minutes), and the last
checkpoint must load. A rank that raises an exception is covered by
tests/plugins/test_distributed.py::test_a_failing_rank_ends_every_rank.

This file is also the job script: ``python tests/reliability/test_ranks.py OUT FAULT RANK``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

TIMEOUT_S = 10
FAULT_STEP = 3


def _job(out: Path, fault: str, faulty_rank: int) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer_core import LightningModule, Trainer, seed_everything
    from trainer_core.callbacks import ModelCheckpoint
    from trainer_core.plugins import DDPPlugin

    torch.set_num_threads(1)

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def on_train_start(self) -> None:
            (out / f"pid.rank{self.global_rank}").write_text(str(os.getpid()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_rank == faulty_rank and self.trainer.global_step == FAULT_STEP:
                (out / "fault.time").write_text(repr(time.time()))
                if fault == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # "hang": never reach the all-reduce the other rank waits in
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    trainer = Trainer(
        plugins=[DDPPlugin(timeout=timedelta(seconds=TIMEOUT_S))],
        devices=2,
        max_steps=50,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(out / "ckpts"), every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=4))


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "rank", "within"),
    [
        ("sigkill", 1, 10.0),  # rank 0 (the launcher) sees its child die
        ("sigkill", 0, 10.0),  # rank 1 loses its peer's connection
        # rank 0 waits in the all-reduce until the timeout; make test has HangWatchdog's quicker version of it
        pytest.param(
            "hang",
            1,
            TIMEOUT_S + 10.0,
            marks=pytest.mark.skipif(
                os.environ.get("FULL_MATRIX") != "1", reason="FULL_MATRIX=1 (make stress)"
            ),
        ),
    ],
)
def test_a_killed_or_hung_rank_ends_the_run_with_a_clear_error(
    tmp_path: Path, fault: str, rank: int, within: float
) -> None:
    from trainer_core.plugins.io import TorchCheckpointIO

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC"))
    }
    proc = subprocess.Popen(
        [sys.executable, __file__, str(tmp_path), fault, str(rank)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
    pids = [
        int((tmp_path / f"pid.rank{r}").read_text()) for r in (0, 1) if (tmp_path / f"pid.rank{r}").exists()
    ]
    deadline = time.monotonic() + 10
    while not all(_pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not (tmp_path / "fault.time").exists():
        pytest.fail(
            f"the job ended before its fault at step {FAULT_STEP} (rc {proc.returncode}):\n{output[-6000:]}"
        )
    ended = time.time() - float((tmp_path / "fault.time").read_text())
    alive = [p for p in pids if not _pid_gone(p)]
    for pid in alive:  # leave nothing behind, even when the assertions below fail
        os.kill(pid, signal.SIGKILL)

    assert len(pids) == 2, output[-3000:]
    assert not alive, f"rank processes {alive} still run after the run ended"
    assert proc.returncode != 0
    assert ended < within, f"the run took {ended:.1f} s to end after the fault (allowed {within:.0f} s)"
    print(f"{fault} on rank {rank}: every rank ended {ended:.1f} s after the fault")
    # The surviving rank says what happened: its collective failed because a peer died or hung (or
    # the launcher saw its child killed first); and with the timeout that applied.
    said = output.lower()
    assert "another rank has died or is hung" in said or "exited with code -9; ending every rank" in said, (
        output[-3000:]
    )
    if fault == "hang":
        assert "timed out" in said and "timeout=0:00:10" in output, output[-3000:]
    io = TorchCheckpointIO()
    last = io.latest_complete(str(tmp_path / "ckpts"))
    assert last is not None
    assert io.load_checkpoint(last)["global_step"] == FAULT_STEP  # every step before the fault was saved


if __name__ == "__main__":
    _job(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))


def test_every_distributed_plugin_takes_a_timeout_of_minutes_by_default() -> None:
    from trainer_core.plugins import DDPPlugin, DDPShardedPlugin, FSDPPlugin, ZeroPlugin
    from trainer_core.plugins.registry import plugin_from_name

    for cls in (DDPPlugin, DDPShardedPlugin, ZeroPlugin, FSDPPlugin):
        assert cls().timeout == timedelta(minutes=10), cls.__name__
        assert cls(timeout=timedelta(seconds=12)).timeout == timedelta(seconds=12), cls.__name__
    for name in ("ddp", "ddp_spawn", "ddp_sharded", "zero", "fsdp"):
        assert plugin_from_name(name).timeout == timedelta(minutes=10), name
