"""A user's own ClusterEnvironment, written from the contract: what it must define, how it is found, what is refused.

The scripts here are what a user writes: an environment class in the training script, started the
way the user starts it (by itself, or as two ranks with the site's own variables). Every script
leaves a marker file per process start, so a test counts the processes a run started. In this
pytest process, every environment class detects only under a variable of its own: a class defined
here is asked by every later ``detect_environment`` of the session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import warm_python
from boring import BoringModel, quiet_trainer, random_loader
from launch import LAUNCH_VARS, ROOT, job_env

from trainer_core import Trainer, seed_everything
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import (
    ClusterEnvironment,
    DDPPlugin,
    LocalEnvironment,
    ParallelPlugin,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from trainer_core.plugins.environments import detect_environment, find_free_port, installed_environments
from trainer_core.plugins.launchers import LAUNCHED_VARIABLE, ScriptLauncher, SpawnLauncher

QUIET_ARGS = "logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False"

#: The start of every script: a marker per process start (before torch is imported), then the imports.
PRELUDE = """\
import json, os, sys
from pathlib import Path

OUT = Path(sys.argv[1])
(OUT / f"start-{os.getpid()}").write_text(os.environ.get("TRAINER_CORE_LAUNCHED", ""))

import torch
from boring import BoringModel, random_loader

from trainer_core import Trainer, seed_everything
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import ClusterEnvironment
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key in LAUNCH_VARS or key.startswith(("SLURM_", "MY_", "ENV_CONTRACT_")):
            monkeypatch.delenv(key)
    return monkeypatch


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    (tmp_path / "out").mkdir(exist_ok=True)
    return path


def _start(tmp_path: Path, script: Path, **variables: str) -> subprocess.Popen:
    """The script, started as a user starts it, in a session of its own (so that every process it starts can be ended)."""
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "helpers"), env.get("PYTHONPATH", "")])
    env.update(variables)
    # A fresh interpreter (not the tests' warm one): the tests compare the pids the scripts record with these.
    return subprocess.Popen(
        [warm_python.REAL_EXECUTABLE, str(script), str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """The output of ``proc`` once it ended; ends its whole session (any process it started too) either way."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the script still ran after {timeout:.0f} s:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return output


def _starts(tmp_path: Path) -> dict[int, str]:
    """pid -> the TRAINER_CORE_LAUNCHED it was started with, for every process the scripts started."""
    return {int(p.name.split("-")[1]): p.read_text() for p in (tmp_path / "out").glob("start-*")}


# ---------------------------------------------------------------------- the members a subclass must define
FORGETS_HOW_PROCESSES_START = """
class MyScheduler(ClusterEnvironment):
    # Everything but creates_processes_externally: before the contract, the launcher started copies without end.
    @staticmethod
    def detect():
        return False

    def world_size(self):
        return 2

    def global_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self):
        return 0


trainer = Trainer(devices=2, plugins=[MyScheduler()], max_epochs=1, {quiet})
trainer.fit(BoringModel(), random_loader(8, 4, batch_size=2))
"""


@pytest.mark.timeout(90)
def test_an_environment_without_creates_processes_externally_starts_nothing(tmp_path: Path) -> None:
    script = _script(tmp_path, FORGETS_HOW_PROCESSES_START.format(quiet=QUIET_ARGS))
    began = time.monotonic()
    proc = _start(tmp_path, script)
    output = _finish(proc, timeout=60)
    elapsed = time.monotonic() - began
    time.sleep(1.0)  # a process started late would have written its marker by now
    assert proc.returncode != 0
    assert "TypeError: Can't instantiate abstract class MyScheduler" in output, output[-3000:]
    assert "does not implement creates_processes_externally" in output
    assert "True when something else (a scheduler, torchrun) started every process" in output
    assert list(_starts(tmp_path)) == [proc.pid]  # the script itself, and nothing else
    assert elapsed < 30


def test_each_missing_member_is_named() -> None:
    class Partial(ClusterEnvironment):
        @staticmethod
        def detect() -> bool:
            return False

        def world_size(self) -> int:
            return 1

    with pytest.raises(TypeError) as raised:
        Partial()
    message = str(raised.value)
    assert (
        "Partial: it does not implement creates_processes_externally, global_rank, local_rank, node_rank"
        in message
    )
    assert "`local_rank` (this process's rank on its node)" in message
    assert Partial not in installed_environments()  # abstract: never picked by detect()


# ---------------------------------------------------------------------- a process our launcher started never launches
SAYS_IT_STARTS_THEM = """
class MyScheduler(ClusterEnvironment):
    # False in every process: also in the rank trainer-core starts, which must not launch again.
    creates_processes_externally = False

    @staticmethod
    def detect():
        return False

    def world_size(self):
        return 2

    def global_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self):
        return 0


trainer = Trainer(devices=2, plugins=[MyScheduler()], max_epochs=1, {quiet})
trainer.fit(BoringModel(), random_loader(8, 4, batch_size=2))
"""


@pytest.mark.timeout(120)
def test_a_rank_our_launcher_started_refuses_to_launch_again(tmp_path: Path) -> None:
    script = _script(tmp_path, SAYS_IT_STARTS_THEM.format(quiet=QUIET_ARGS))
    began = time.monotonic()
    proc = _start(tmp_path, script)
    output = _finish(proc, timeout=90)
    elapsed = time.monotonic() - began
    time.sleep(1.0)
    starts = _starts(tmp_path)
    assert proc.returncode != 0
    assert (
        "MisconfigurationException: MyScheduler.creates_processes_externally is False in a process that "
        f"trainer-core's launcher started ({LAUNCHED_VARIABLE}={proc.pid}" in output
    ), output[-3000:]
    assert (
        "Make MyScheduler.creates_processes_externally return True in the processes trainer-core starts"
        in output
    )
    # The script and the one rank it started (which knows who started it); that rank started none.
    assert len(starts) == 2 and starts[proc.pid] == ""
    assert [launcher for pid, launcher in starts.items() if pid != proc.pid] == [str(proc.pid)]
    assert elapsed < 60


class _StartsItsOwn(ClusterEnvironment):
    """Says trainer-core starts the ranks, in every process (wrong in a rank trainer-core started)."""

    creates_processes_externally = False

    @staticmethod
    def detect() -> bool:
        return os.environ.get("ENV_CONTRACT_STARTS") == "1"

    def world_size(self) -> int:
        return 2

    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0


def test_the_guard_stops_the_trainer_and_each_launcher_before_anything_starts(
    clean_env: pytest.MonkeyPatch, no_process_group_left_behind: None
) -> None:
    # A process group an earlier in-process run of this pytest worker left would mean "already launched".
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Without the variable the same Trainer is built: the process the user started may launch.
    assert Trainer(devices=2, plugins=[_StartsItsOwn()], logger=False).world_size == 2
    clean_env.setenv(LAUNCHED_VARIABLE, "4242")
    expected = (
        r"_StartsItsOwn\.creates_processes_externally is False .*TRAINER_CORE_LAUNCHED=4242.*return True"
    )
    with pytest.raises(MisconfigurationException, match=expected):
        Trainer(devices=2, plugins=[_StartsItsOwn()], logger=False)
    called: list[int] = []
    launcher = ScriptLauncher(_StartsItsOwn(), num_processes=2, num_nodes=1)
    with pytest.raises(MisconfigurationException, match=expected):
        launcher.launch(called.append, 1)
    with pytest.raises(MisconfigurationException, match=expected):
        SpawnLauncher(_StartsItsOwn(), num_processes=2).launch(called.append, 1)
    assert called == [] and launcher.children == []
    assert "MASTER_PORT" not in os.environ  # not even a port was picked
    # A rank of our own local launch says its processes were started for it: it builds and does not launch.
    clean_env.setenv("LOCAL_RANK", "1")
    trainer = Trainer(devices=2, logger=False)
    assert isinstance(trainer.strategy.cluster_environment, LocalEnvironment) and trainer.global_rank == 1


# ---------------------------------------------------------------------- processes the user's scheduler started
MY_SCHEDULER = """
class MyScheduler(ClusterEnvironment):
    # The site's scheduler starts every rank and says which it is in MY_RANK / MY_WORLD / MY_PORT.
    creates_processes_externally = True

    @staticmethod
    def detect():
        return "MY_RANK" in os.environ

    @property
    def main_address(self):
        return "127.0.0.1"

    @property
    def main_port(self):
        return int(os.environ["MY_PORT"])

    def world_size(self):
        return int(os.environ["MY_WORLD"])

    def global_rank(self):
        return int(os.environ["MY_RANK"])

    def local_rank(self):
        return int(os.environ["MY_RANK"])

    def node_rank(self):
        return 0


seed_everything(0)
model = BoringModel()
loader = random_loader(16, 4, batch_size=2)
x, y = loader.dataset.tensors
before = torch.nn.functional.mse_loss(model.net(x), y).item()
trainer = Trainer(devices=2, plugins=[MyScheduler()], max_epochs=3, {quiet})
trainer.fit(model, loader)
after = torch.nn.functional.mse_loss(model.net(x), y).item()
env = trainer.strategy.cluster_environment
torch.save(
    dict(
        weights=model.state_dict(), before=before, after=after, steps=trainer.global_step,
        environment=type(env).__name__, ranks=[trainer.global_rank, trainer.world_size, trainer.local_rank],
        master_port=os.environ.get("MASTER_PORT"),
    ),
    OUT / f"rank{{trainer.global_rank}}.pt",
)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_user_environment_runs_ddp_on_the_processes_it_started(tmp_path: Path) -> None:
    script = _script(tmp_path, MY_SCHEDULER.format(quiet=QUIET_ARGS))
    port = str(find_free_port())
    procs = [_start(tmp_path, script, MY_RANK=str(r), MY_WORLD="2", MY_PORT=port) for r in range(2)]
    outputs = [_finish(proc, timeout=150) for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}:\n{output[-4000:]}"
    assert sorted(_starts(tmp_path)) == sorted(p.pid for p in procs)  # trainer-core started none
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, facts in enumerate(ranks):
        assert facts["environment"] == "MyScheduler"
        assert facts["ranks"] == [rank, 2, rank]
        assert facts["master_port"] == port  # the rendezvous met at the environment's main_port
        assert facts["steps"] == 12  # 8 samples per rank, 2 per batch, 3 epochs
        assert facts["after"] < 0.9 * facts["before"]
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key
    # One process on the whole batch (2 ranks x 2 samples) is the same training, up to float rounding.
    seed_everything(0)
    single = BoringModel()
    quiet_trainer(max_epochs=3).fit(single, random_loader(16, 4, batch_size=4))
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ranks[0]["weights"][key], value, atol=1e-5, rtol=1e-4)
    assert not torch.equal(ranks[0]["weights"]["net.0.weight"], BoringModel().net[0].weight)


# ---------------------------------------------------------------------- detect(): installing a class is enough
INSTALLED = """
class MyScheduler(ClusterEnvironment):
    creates_processes_externally = True

    @staticmethod
    def detect():
        return os.environ.get("MY_SCHEDULER") == "1"

    def world_size(self):
        return int(os.environ["MY_WORLD"])

    def global_rank(self):
        return int(os.environ["MY_RANK"])

    def local_rank(self):
        return int(os.environ["MY_RANK"])

    def node_rank(self):
        return 0


class OtherScheduler(MyScheduler):
    @staticmethod
    def detect():
        return os.environ.get("MY_OTHER") == "1"


class NeedsAQueue(MyScheduler):
    def __init__(self, queue):
        self.queue = queue

    @staticmethod
    def detect():
        return os.environ.get("MY_NEEDS") == "1"


def build():
    try:
        trainer = Trainer(devices=2, {quiet})
    except MisconfigurationException as err:
        return str(err)
    return [type(trainer.strategy.cluster_environment).__name__, trainer.global_rank, trainer.world_size]


facts = {{"installed": build()}}
os.environ["MY_OTHER"] = "1"
facts["two"] = build()
os.environ["MY_SCHEDULER"] = os.environ["MY_OTHER"] = "0"
os.environ["MY_NEEDS"] = "1"
facts["needs_arguments"] = build()
os.environ["MY_NEEDS"] = "0"
facts["none"] = build()
(OUT / "facts.json").write_text(json.dumps(facts))
"""


@pytest.mark.timeout(90)
def test_an_installed_environment_is_detected_without_being_passed(tmp_path: Path) -> None:
    script = _script(tmp_path, INSTALLED.format(quiet=QUIET_ARGS))
    proc = _start(tmp_path, script, MY_SCHEDULER="1", MY_WORLD="2", MY_RANK="1")
    output = _finish(proc, timeout=60)
    assert proc.returncode == 0, output[-4000:]
    facts = json.loads((tmp_path / "out" / "facts.json").read_text())
    assert facts["installed"] == ["MyScheduler", 1, 2]
    assert facts["two"].startswith(
        "2 cluster environments detect this process: __main__.MyScheduler and __main__.OtherScheduler"
    )
    assert "Make the detect() of at most one return True here" in facts["two"]
    assert "Trainer(plugins=[MyScheduler()])" in facts["two"]
    assert facts["needs_arguments"].startswith(
        "__main__.NeedsAQueue.detect() returned True, but NeedsAQueue() failed (TypeError:"
    )
    assert "give every __init__ argument a default" in facts["needs_arguments"]
    assert facts["none"] == ["LocalEnvironment", 0, 2]
    assert list(_starts(tmp_path)) == [proc.pid]


class _SiteA(ClusterEnvironment):
    """A site scheduler, detected only under ENV_CONTRACT_A (a test-only variable)."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        return os.environ.get("ENV_CONTRACT_A") == "1"

    def world_size(self) -> int:
        return 2

    def global_rank(self) -> int:
        return 1

    def local_rank(self) -> int:
        return 1

    def node_rank(self) -> int:
        return 0


class _SiteB(_SiteA):
    @staticmethod
    def detect() -> bool:
        return os.environ.get("ENV_CONTRACT_B") == "1"


class _HalfWritten(ClusterEnvironment):
    """Abstract (no ranks): skipped even when its detect() holds."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        return os.environ.get("ENV_CONTRACT_A") == "1"


class _MyLocal(LocalEnvironment):
    """Keeps LocalEnvironment's detect() (always True): passed explicitly, never picked by itself."""


class _MySLURM(SLURMEnvironment):
    """Defines its own detect(): picked under the variable it reads."""

    @staticmethod
    def detect() -> bool:
        return os.environ.get("ENV_CONTRACT_SLURM") == "1" and SLURMEnvironment.detect()


def test_detection_asks_the_users_concrete_classes_first(clean_env: pytest.MonkeyPatch) -> None:
    installed = installed_environments()
    assert installed.index(_SiteA) < installed.index(_SiteB)  # by module, then name: the same in every rank
    assert _MySLURM in installed
    for skipped in (_HalfWritten, _MyLocal, LocalEnvironment, SLURMEnvironment, TorchElasticEnvironment):
        assert skipped not in installed
    assert type(detect_environment(2, 1)) is LocalEnvironment
    clean_env.setenv("ENV_CONTRACT_A", "1")
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }.items():
        clean_env.setenv(key, value)  # torchrun's variables too: the user's class comes first
    assert type(detect_environment(2, 1)) is _SiteA
    trainer = Trainer(devices=2, logger=False)
    assert type(trainer.strategy.cluster_environment) is _SiteA and trainer.global_rank == 1
    clean_env.setenv("ENV_CONTRACT_B", "1")
    with pytest.raises(MisconfigurationException) as raised:
        detect_environment(2, 1)
    assert str(raised.value).startswith(
        "2 cluster environments detect this process: test_environment_contract._SiteA and "
        "test_environment_contract._SiteB"
    )
    # Passing one decides: detection is not asked.
    assert type(Trainer(devices=2, plugins=[_SiteB()], logger=False).strategy.cluster_environment) is _SiteB


class _LightningStyle(ClusterEnvironment):
    """Lightning's LightningEnvironment pattern: told its world size and rank through the setters."""

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        return 0


def test_a_lightning_environment_is_told_its_ranks(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOCAL_RANK", "1")
    env = _LightningStyle()
    trainer = Trainer(devices=2, num_nodes=1, plugins=[env], logger=False)
    assert (env.world_size(), env.global_rank()) == (2, 1)
    assert (trainer.world_size, trainer.global_rank) == (2, 1)


@pytest.mark.parametrize(
    ("plugin", "given", "expected"),
    [
        (
            DDPPlugin,
            SLURMEnvironment,
            r"^DDPPlugin\(cluster_environment=SLURMEnvironment\): pass SLURMEnvironment\(\)",
        ),
        (
            ParallelPlugin,
            _SiteA,
            r"^ParallelPlugin\(cluster_environment=_SiteA\): pass _SiteA\(\) \(an instance\)",
        ),
        (
            DDPPlugin,
            "slurm",
            r"^DDPPlugin\(cluster_environment='slurm'\): a str is not a ClusterEnvironment; pass",
        ),
    ],
)
def test_a_plugin_takes_an_environment_instance_only(plugin: type, given: Any, expected: str) -> None:
    with pytest.raises(MisconfigurationException, match=expected):
        plugin(cluster_environment=given)


def test_main_port_without_master_port(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_PORT", "0")
    clean_env.delenv("MASTER_PORT")  # recorded: the port picked below is removed after the test
    # Processes started elsewhere cannot agree on a port each picks: say what to set.
    with pytest.raises(
        MisconfigurationException, match=r"^_SiteA\.main_port: MASTER_PORT is not set.*override `main_port`"
    ):
        _SiteA().main_port  # noqa: B018
    # Processes trainer-core starts inherit the one the launching process picks.
    port = _StartsItsOwn().main_port
    assert os.environ["MASTER_PORT"] == str(port) and _StartsItsOwn().main_port == port
