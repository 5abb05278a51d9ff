"""Where a process learns its rank: torchrun/TorchElastic, SLURM, or a local launch of our own.

An environment only *reads* ranks and the rendezvous address; it never starts processes. The
first one whose ``detect()`` holds is used, in the order torchrun, SLURM, local.
"""

from __future__ import annotations

import os
import random
import re
import socket
from typing import Optional

# Below Linux's default ephemeral range (32768-60999): a port the kernel hands out for outgoing connections
# (gloo opens many between ranks) can be taken between our check and the rendezvous binding it.
_PORT_RANGE = (20000, 32000)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range where possible."""
    rng = (
        random.Random()
    )  # its own generator: the user's seeded global RNG must not decide (or be moved by) this
    for _ in range(50):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterEnvironment:
    """The ranks and rendezvous of this process."""

    #: Whether something outside trainer-core (torchrun, srun) started every process already.
    creates_processes_externally: bool = False

    @staticmethod
    def detect() -> bool:
        raise NotImplementedError

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    def world_size(self) -> int:
        raise NotImplementedError

    def global_rank(self) -> int:
        raise NotImplementedError

    def local_rank(self) -> int:
        raise NotImplementedError

    def node_rank(self) -> int:
        raise NotImplementedError

    def validate(self, num_devices: int, num_nodes: int) -> None:
        """Fail early when the Trainer's ``devices``/``num_nodes`` disagree with the launcher."""
        expected = num_devices * num_nodes
        actual = self.world_size()
        if actual != expected:
            from trainer_core.errors import MisconfigurationException

            raise MisconfigurationException(
                f"{type(self).__name__} started {actual} processes but Trainer(devices={num_devices}, "
                f"num_nodes={num_nodes}) expects {expected}; make them agree."
            )


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes started by ``torchrun`` (TorchElastic): every variable is set for us."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        required = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in required)

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))


class SLURMEnvironment(ClusterEnvironment):
    """Processes started by ``srun``; an interactive ``salloc`` shell is not mistaken for one."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        if "SLURM_NTASKS" not in os.environ or "SLURM_PROCID" not in os.environ:
            return False
        # Inside `salloc`/an interactive job the shell itself has SLURM variables but was not started by srun.
        return (
            os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive") and "SLURM_STEP_ID" in os.environ
        )

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodelist = os.environ.get("SLURM_NODELIST", "127.0.0.1")
        return _first_host(nodelist)

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        # A port derived from the job id, so every task of the job picks the same one.
        job_id = int(os.environ.get("SLURM_JOB_ID", "0")[-4:] or 0)
        return 10000 + job_id % 20000

    def world_size(self) -> int:
        return int(os.environ["SLURM_NTASKS"])

    def global_rank(self) -> int:
        return int(os.environ["SLURM_PROCID"])

    def local_rank(self) -> int:
        return int(os.environ.get("SLURM_LOCALID", 0))

    def node_rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", 0))


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``node[12-14,20],other`` or ``host1,node[5-6]``."""
    depth = 0
    end = len(nodelist)
    for i, char in enumerate(nodelist):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    match = re.match(r"([^\[]+)\[(\d+)", first)
    if match:
        return f"{match.group(1)}{match.group(2)}"
    return first


class LocalEnvironment(ClusterEnvironment):
    """Processes trainer-core starts itself on this machine (``devices=N``, optionally ``num_nodes``).

    The launching process (local rank 0) picks the port and puts ``LOCAL_RANK``, ``NODE_RANK``,
    ``WORLD_SIZE`` and the rendezvous in each child's environment; a child finds them there.
    """

    def __init__(self, num_devices: int = 1, num_nodes: int = 1) -> None:
        self._num_devices = num_devices
        self._num_nodes = num_nodes
        self._global_rank: Optional[int] = None

    @property
    def creates_processes_externally(self) -> bool:  # type: ignore[override]
        # A child we started has LOCAL_RANK in its environment: it must not start children again.
        return "LOCAL_RANK" in os.environ

    @staticmethod
    def detect() -> bool:
        return True

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(find_free_port())
        return int(os.environ["MASTER_PORT"])

    def world_size(self) -> int:
        return self._num_devices * self._num_nodes

    def global_rank(self) -> int:
        return self.node_rank() * self._num_devices + self.local_rank()

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))


def detect_environment(num_devices: int, num_nodes: int) -> ClusterEnvironment:
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment()
    return LocalEnvironment(num_devices, num_nodes)
