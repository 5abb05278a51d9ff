"""A job its launcher restarts continues by itself, from a checkpoint every rank agrees on.

torchrun restarts failed workers (``--max-restarts``) and SLURM requeues jobs; both say so in the
environment (``TORCHELASTIC_RESTART_COUNT``, ``SLURM_RESTART_COUNT``). ``fit()`` called without a
``ckpt_path`` in such a process resumes the newest complete checkpoint, as ``ckpt_path="last"``
does. Real restarts under torchrun agents are in test_elastic.py; these are the parts that need no
second process.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from boring import BoringModel, quiet_trainer, random_loader
from torch.distributed import TCPStore

from trainer_core.callbacks import ModelCheckpoint
from trainer_core.checkpoint.restore import _agreed_checkpoints
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.plugins.environments import TorchElasticEnvironment, agree_on_scope, find_free_port
from trainer_core.utilities import launcher_restart_count


def _trainer(folder: Path, max_steps: int) -> object:
    return quiet_trainer(
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(folder), every_n_train_steps=2, save_top_k=-1)],
    )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_launchers_restart_count_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_restart_count() == ("", 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's first attempt
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert launcher_restart_count() == ("SLURM", 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launcher_restart_count() == ("torchrun", 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "garbage")
    assert launcher_restart_count() == ("SLURM", 2)


def test_a_restarted_job_resumes_its_newest_checkpoint_without_ckpt_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    whole = BoringModel()
    _trainer(tmp_path / "whole", 8).fit(whole, random_loader(32, 4, batch_size=4))

    torch.manual_seed(0)
    first = BoringModel()
    _trainer(tmp_path / "ckpts", 5).fit(first, random_loader(32, 4, batch_size=4))  # "killed" after step 5
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    torch.manual_seed(1)  # the restarted process starts from other weights: only the checkpoint can help
    second = BoringModel()
    trainer = _trainer(tmp_path / "ckpts", 8)
    with caplog.at_level(logging.INFO):
        trainer.fit(second, random_loader(32, 4, batch_size=4))
    assert trainer.ckpt_path is not None and trainer.ckpt_path.endswith("step=4.ckpt")
    assert "restart 1 of this job by SLURM: resuming from" in caplog.text
    for name, value in _weights(whole).items():
        assert torch.equal(second.state_dict()[name], value), name


def test_a_restart_that_finds_no_checkpoint_starts_fresh_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    trainer = _trainer(tmp_path / "ckpts", 2)
    with pytest.warns(
        UserWarning, match=r"restart 2 of this job by torchrun: .*found no complete checkpoint"
    ):
        trainer.fit(BoringModel(), random_loader(8, 4, batch_size=4))
    assert trainer.global_step == 2 and trainer.ckpt_path is None


def test_a_given_ckpt_path_wins_over_the_automatic_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _trainer(tmp_path / "a", 2).fit(BoringModel(), random_loader(8, 4, batch_size=4))
    _trainer(tmp_path / "b", 4).fit(BoringModel(), random_loader(16, 4, batch_size=4))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    trainer = _trainer(tmp_path / "b", 6)
    trainer.fit(
        BoringModel(),
        random_loader(16, 4, batch_size=4),
        ckpt_path=str(tmp_path / "a" / "epoch=0-step=2.ckpt"),
    )
    assert trainer.ckpt_path.endswith("a/epoch=0-step=2.ckpt")


def test_one_restarted_rank_means_the_job_was_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each torchrun agent counts its own restarts: a node that joined the new round counts 0."""
    from trainer_core import Trainer

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # this rank's agent restarted nothing
    seen = [("", 0), ("torchrun", 2)]
    trainer = SimpleNamespace(
        world_size=2, resume_reason="", plugin=SimpleNamespace(all_gather_object=lambda mine: seen)
    )
    fit_loop = SimpleNamespace(ckpt_path=None)
    Trainer._resume_after_restart(trainer, fit_loop)  # type: ignore[arg-type]
    assert fit_loop.ckpt_path == "last" and trainer.resume_reason == "restart 2 of this job by torchrun"
    seen[1] = ("", 0)
    fit_loop.ckpt_path = None
    Trainer._resume_after_restart(trainer, fit_loop)  # type: ignore[arg-type]
    assert fit_loop.ckpt_path is None


def _ranks_seeing(*listings: list[str]) -> SimpleNamespace:
    return SimpleNamespace(plugin=SimpleNamespace(all_gather_object=lambda mine: list(listings)))


def test_ranks_that_list_different_checkpoints_agree_on_the_newest_they_all_see() -> None:
    # Rank 1 listed the folder after step 6 was published and step 2 removed by retention.
    common = _agreed_checkpoints(_ranks_seeing(["s2", "s4"], ["s4", "s6"]), ["s2", "s4"])
    assert common == {"s4"}
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in common .*rank 0: s4; rank 1: none"):
        _agreed_checkpoints(_ranks_seeing(["s2", "s4"], []), ["s2", "s4"])
    assert _agreed_checkpoints(_ranks_seeing([], []), []) == set()


def _agree(port: int, world: int) -> list[str]:
    """Every rank of one start runs ``agree_on_scope`` at once (threads, each with its own store client)."""
    names: list[str] = [""] * world

    def rank(r: int) -> None:
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        names[r] = agree_on_scope(client, r, world, "trainer_core/job7/world3", timedelta(seconds=20))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return names


def test_the_ranks_of_each_start_agree_on_a_fresh_store_scope() -> None:
    port = find_free_port()
    server = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    first = _agree(port, 3)
    assert first[0] and first == [first[0]] * 3
    # A dead start left its tokens and its proposal behind; the next start never agrees on them.
    assert server.get("trainer_core/job7/world3/proposal").decode().startswith(first[0])
    second = _agree(port, 3)
    assert second == [second[0]] * 3 and second[0] != first[0]
    assert second[0].startswith("trainer_core/job7/world3/")


def test_torchrun_workers_meet_in_the_agreed_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    port = find_free_port()
    server = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    env = {
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = TorchElasticEnvironment().process_group_store(timedelta(seconds=10))
    assert store is not None
    store.set("rank_0", "address of this start")
    server.set("rank_0", "a dead peer's address")  # an unscoped key of the same name is another key
    scope = server.get("trainer_core/job7/world1/proposal").decode().partition("|")[0]
    assert server.get(f"{scope}/rank_0") == b"address of this start"
    assert store.get("rank_0") == b"address of this start"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # RANK & co. set by hand: torch's own rendezvous
    assert TorchElasticEnvironment().process_group_store(timedelta(seconds=10)) is None


def test_a_stop_signal_during_setup_ends_the_process_at_once(tmp_path: Path) -> None:
    """Before the first training batch there is nothing new to save: SIGTERM does what it always does."""
    script = tmp_path / "slow_setup.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            sys.path.insert(0, sys.argv[1])
            from boring import BoringModel, quiet_trainer, random_loader

            class SlowSetup(BoringModel):
                def setup(self, stage):
                    open("ready", "w").close()
                    time.sleep(60)

            quiet_trainer(max_steps=2).fit(SlowSetup(), random_loader(8, 4))
            """
        )
    )
    helpers = str(Path(__file__).resolve().parents[1] / "helpers")
    proc = subprocess.Popen([sys.executable, str(script), helpers], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached setup"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_elastic_launch_may_run_on_fewer_nodes_than_num_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    TorchElasticEnvironment().validate(num_devices=2, num_nodes=2)  # --nnodes 1:2, one node left
    with pytest.raises(MisconfigurationException, match="started 2 processes"):
        TorchElasticEnvironment().validate(num_devices=1, num_nodes=3)  # devices disagree with nproc_per_node
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    with pytest.raises(MisconfigurationException, match="started 2 processes"):
        TorchElasticEnvironment().validate(num_devices=2, num_nodes=2)  # more nodes than asked for
