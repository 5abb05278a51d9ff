"""Which cluster environment a process is in, read from its variables alone (no processes started)."""

from __future__ import annotations

import os

import pytest
from launch import LAUNCH_VARS

from trainer_core import Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import LocalEnvironment, SLURMEnvironment, TorchElasticEnvironment
from trainer_core.plugins.environments import detect_environment


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key in LAUNCH_VARS or key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    return monkeypatch


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, local: int, group: int = 0) -> None:
    for key, value in {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": local,
        "GROUP_RANK": group,
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": 29511,
    }.items():
        monkeypatch.setenv(key, str(value))


def _srun_env(monkeypatch: pytest.MonkeyPatch, **overrides: str) -> None:
    values = {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "train.sh",
        "SLURM_NODELIST": "node[12-13]",
        **overrides,
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_torchelastic_is_read_from_its_variables(clean_env: pytest.MonkeyPatch) -> None:
    _torchrun_env(clean_env, rank=3, world=4, local=1, group=1)
    env = detect_environment(2, 2)
    assert isinstance(env, TorchElasticEnvironment)
    assert env.creates_processes_externally
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (3, 4, 1, 1)
    assert (env.main_address, env.main_port) == ("10.1.2.3", 29511)


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_torchelastic_needs_every_variable(clean_env: pytest.MonkeyPatch, missing: str) -> None:
    _torchrun_env(clean_env, rank=0, world=2, local=0)
    clean_env.delenv(missing)
    assert not TorchElasticEnvironment.detect()
    assert isinstance(detect_environment(2, 1), LocalEnvironment)


def test_slurm_is_detected_under_srun(clean_env: pytest.MonkeyPatch) -> None:
    _srun_env(clean_env)
    env = detect_environment(2, 2)
    assert isinstance(env, SLURMEnvironment)
    assert env.creates_processes_externally
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (3, 4, 1, 1)
    assert env.main_address == "node12"
    # Every task of the job derives the same port from the job id.
    assert env.main_port == SLURMEnvironment().main_port and 10000 <= env.main_port < 30000


def test_slurm_interactive_shell_is_not_srun(clean_env: pytest.MonkeyPatch) -> None:
    _srun_env(clean_env, SLURM_JOB_NAME="bash")
    assert not SLURMEnvironment.detect()
    assert isinstance(detect_environment(2, 1), LocalEnvironment)


def test_slurm_allocation_without_a_step_is_not_srun(clean_env: pytest.MonkeyPatch) -> None:
    _srun_env(clean_env)
    clean_env.delenv("SLURM_STEP_ID")
    assert not SLURMEnvironment.detect()
    assert isinstance(detect_environment(2, 1), LocalEnvironment)


def test_local_environment_otherwise(clean_env: pytest.MonkeyPatch) -> None:
    env = detect_environment(2, 1)
    assert isinstance(env, LocalEnvironment)
    assert not env.creates_processes_externally
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (0, 2, 0, 0)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node[12-14,20]", "node12"),
        ("node[007-009]", "node007"),
        ("gpu-a[3]", "gpu-a3"),
        ("host1", "host1"),
        ("host1,host2", "host1"),
        ("host1,node[5-6]", "host1"),
        ("node[1-2],gpu[7-8]", "node1"),
    ],
)
def test_slurm_nodelist_gives_the_first_host(
    clean_env: pytest.MonkeyPatch, nodelist: str, first: str
) -> None:
    _srun_env(clean_env, SLURM_NODELIST=nodelist)
    assert SLURMEnvironment().main_address == first


def test_slurm_master_addr_wins_over_the_nodelist(clean_env: pytest.MonkeyPatch) -> None:
    _srun_env(clean_env, MASTER_ADDR="10.0.0.7", MASTER_PORT="23456")
    env = SLURMEnvironment()
    assert (env.main_address, env.main_port) == ("10.0.0.7", 23456)


def test_trainer_under_torchrun_with_more_processes_than_asked_for(clean_env: pytest.MonkeyPatch) -> None:
    _torchrun_env(clean_env, rank=0, world=4, local=0)
    with pytest.raises(MisconfigurationException, match=r"(?s)4.*devices=2.*num_nodes=1"):
        Trainer(devices=2, plugins="ddp", logger=False, enable_checkpointing=False, enable_progress_bar=False)


def test_trainer_takes_ranks_from_torchrun_and_slurm(clean_env: pytest.MonkeyPatch) -> None:
    _torchrun_env(clean_env, rank=3, world=4, local=1, group=1)
    trainer = Trainer(devices=2, num_nodes=2, plugins="ddp", logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy.cluster_environment, TorchElasticEnvironment)
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank, trainer.node_rank) == (3, 4, 1, 1)
    assert not trainer.is_global_zero
    for key in LAUNCH_VARS:
        clean_env.delenv(key, raising=False)
    _srun_env(clean_env)
    trainer = Trainer(devices=2, num_nodes=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank, trainer.node_rank) == (3, 4, 1, 1)


def test_fsdp_plugin_rejects_bad_settings() -> None:
    from trainer_core.plugins import FSDPPlugin

    with pytest.raises(MisconfigurationException, match="state_dict_type='nope'"):
        FSDPPlugin(state_dict_type="nope")
    plugin = FSDPPlugin(hybrid_shard=(2, 3))
    plugin.configure_devices("cpu", 2, 1)
    with pytest.raises(MisconfigurationException, match=r"hybrid_shard=\(2, 3\)\) needs 6 processes"):
        plugin.device_mesh  # noqa: B018


def test_sharded_plugin_without_fairscale_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer_core.imports as imports
    from trainer_core.plugins import DDPShardedPlugin

    class Missing:
        message = "Module not found: 'fairscale'"

        def __bool__(self) -> bool:
            return False

    monkeypatch.setattr(imports, "FAIRSCALE_AVAILABLE", Missing())
    with pytest.raises(ModuleNotFoundError, match=r"trainer-core\[sharded\]"):
        DDPShardedPlugin()
