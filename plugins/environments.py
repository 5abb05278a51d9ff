"""Where a process learns its rank: torchrun/TorchElastic, SLURM, or a local launch of our own.

An environment only *reads* ranks and the rendezvous address; it never starts processes. The
first one whose ``detect()`` holds is used, in the order torchrun, SLURM, local.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import signal
import socket
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch.distributed import Store

_logger = logging.getLogger("trainer_core")

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

    def process_group_store(self, timeout: timedelta) -> Optional[Store]:
        """The store the process group meets in; ``None``: torch's own ``env://`` rendezvous."""
        return None

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

    def validate(self, num_devices: int, num_nodes: int) -> None:
        """Also accept an elastic launch (``--nnodes 1:N``) that runs on fewer nodes than ``num_nodes`` now."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_devices))
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", num_nodes))
        if "TORCHELASTIC_RUN_ID" in os.environ and local == num_devices and 1 <= nodes < num_nodes:
            _logger.info(
                f"torchrun runs {nodes} of the Trainer's num_nodes={num_nodes} nodes (an elastic node range): "
                f"training at world size {self.world_size()}."
            )
            return
        super().validate(num_devices, num_nodes)

    def process_group_store(self, timeout: timedelta) -> Optional[Store]:
        """torchrun's store, with every key scoped to this start of the workers.

        Restarted workers meet in a store that outlives them (the launcher's), which still holds the keys
        of the start before, gloo's addresses among them: a restarted rank could read a dead peer's address
        and fail or hang in ``init_process_group``. No variable torchrun sets tells one start from the next
        on every node (``TORCHELASTIC_RESTART_COUNT`` is each agent's own count: a node that joins starts
        at 0, and a restart for a node that joined does not count), so the ranks agree on a fresh scope
        (:func:`agree_on_scope`).
        """
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return None
        from torch.distributed import PrefixStore, rendezvous

        rank, world = self.global_rank(), self.world_size()
        store, _, _ = next(rendezvous("env://", rank, world, timeout=timeout))
        prefix = f"trainer_core/{os.environ['TORCHELASTIC_RUN_ID']}/world{world}"
        return PrefixStore(agree_on_scope(store, rank, world, prefix, timeout), store)


#: How long rank 0 waits for every rank to accept a proposed scope before it reads the tokens again.
_ACCEPT_SECONDS = 1.0


def agree_on_scope(store: Store, rank: int, world_size: int, prefix: str, timeout: timedelta) -> str:
    """A key prefix every rank of this start agrees on, made only of values this start wrote.

    Each rank writes a fresh random token. Rank 0 reads the tokens and proposes them, named by their
    hash; a rank accepts only a proposal that holds its own token, so a token or a proposal a dead start
    left behind is never agreed on. Rank 0 declares the scope once every rank has accepted; when they
    have not within :data:`_ACCEPT_SECONDS` (a token it read was stale, its rank had not written yet), it
    reads the tokens again and proposes anew. A few store round trips per rank.
    """
    token = uuid.uuid4().hex
    store.set(f"{prefix}/token/{rank}", token)
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if rank == 0:
            tokens = [token] + [store.get(f"{prefix}/token/{r}").decode() for r in range(1, world_size)]
            name = f"{prefix}/{hashlib.sha256(','.join(tokens).encode()).hexdigest()[:16]}"
            store.set(f"{prefix}/proposal", f"{name}|{','.join(tokens)}")
            until = time.monotonic() + _ACCEPT_SECONDS
            while time.monotonic() < until:
                if store.add(f"{name}/accepted", 0) >= world_size - 1:
                    store.set(f"{name}/agreed", "1")
                    return name
                time.sleep(0.01)
            continue
        name, _, listed = store.get(f"{prefix}/proposal").decode().partition("|")
        tokens = listed.split(",")
        if len(tokens) != world_size or tokens[rank] != token:
            time.sleep(0.02)  # a proposal of a dead start, or made before this rank's token was written
            continue
        store.add(f"{name}/accepted", 1)
        try:
            store.wait([f"{name}/agreed"], timedelta(seconds=3 * _ACCEPT_SECONDS))
            return name
        except RuntimeError:  # (torch's DistStoreError) rank 0 proposed again: read the new proposal
            continue
    raise RuntimeError(
        f"rank {rank}: the {world_size} ranks of this torchrun start did not all reach the process group's store "
        f"within {timeout}; another rank has died or hangs before init_process_group (its own output says which)."
    )


class SLURMEnvironment(ClusterEnvironment):
    """Processes started by ``srun``; an interactive ``salloc`` shell is not mistaken for one.

    Pass one in ``Trainer(plugins=[SLURMEnvironment(...)])`` to choose how the job is requeued (found by
    itself, a SLURM job gets the defaults). On ``requeue_signal`` (SLURM sends it before the time limit
    when the job asks, e.g. ``#SBATCH --signal=USR1@90``) every rank saves ``preempted.ckpt`` at one
    step and, with ``auto_requeue``, global rank 0 runs ``scontrol requeue`` on this job; the requeued
    job (``SLURM_RESTART_COUNT`` > 0) continues from that checkpoint by itself (trainer_core.signals).

    Args:
        auto_requeue: requeue the job after saving. ``False``: only save and stop (for a launcher such as
            submitit that requeues the job itself).
        requeue_signal: the signal SLURM was told to send (a ``signal.Signals``, its number or name such
            as ``"SIGUSR2"``); ``None``: :attr:`default_requeue_signal`. SIGTERM and SIGUSR1 still save
            and stop when another signal is chosen.
    """

    creates_processes_externally = True
    #: The requeue signal of an environment created without one, including the one found by itself in a
    #: SLURM job: set it (``SLURMEnvironment.default_requeue_signal = signal.SIGUSR2``) to change the signal
    #: only when the script runs under SLURM (Lightning #21404). ``None`` where the platform lacks SIGUSR1.
    default_requeue_signal: Optional[signal.Signals] = getattr(signal, "SIGUSR1", None)

    def __init__(
        self, auto_requeue: bool = True, requeue_signal: Optional[signal.Signals | int | str] = None
    ) -> None:
        if not isinstance(auto_requeue, bool):
            from trainer_core.errors import MisconfigurationException

            raise MisconfigurationException(
                f"SLURMEnvironment(auto_requeue={auto_requeue!r}): pass True or False."
            )
        self.auto_requeue = auto_requeue
        given = requeue_signal if requeue_signal is not None else type(self).default_requeue_signal
        self.requeue_signal: Optional[signal.Signals] = None if given is None else _catchable_signal(given)

    @staticmethod
    def job_name() -> Optional[str]:
        return os.environ.get("SLURM_JOB_NAME")

    @staticmethod
    def job_id() -> Optional[int]:
        """This job's id; ``None`` outside SLURM and in an interactive allocation (as Lightning)."""
        if os.environ.get("SLURM_JOB_NAME") in _INTERACTIVE_JOB_NAMES:
            return None
        value = os.environ.get("SLURM_JOB_ID", "")
        return int(value) if value.isdigit() else None

    @staticmethod
    def requeue_job_id() -> Optional[str]:
        """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task (requeueing the array's
        own id would requeue every task of it), else the job id; ``None`` when SLURM set neither."""
        array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
        if array_job and array_task:
            return f"{array_job}_{array_task}"
        return os.environ.get("SLURM_JOB_ID") or None

    @staticmethod
    def detect_batch_job() -> bool:
        """Whether this process runs inside a SLURM batch job, with or without ``srun``.

        A one-process job started by ``sbatch`` (``python train.py`` in the script) has no ``srun``
        variables for :meth:`detect`, but is requeued the same way.
        """
        return "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_JOB_NAMES

    def __repr__(self) -> str:
        signame = self.requeue_signal.name if self.requeue_signal is not None else None
        return f"SLURMEnvironment(auto_requeue={self.auto_requeue}, requeue_signal={signame})"

    @staticmethod
    def detect() -> bool:
        if "SLURM_NTASKS" not in os.environ or "SLURM_PROCID" not in os.environ:
            return False
        # Inside `salloc`/an interactive job the shell itself has SLURM variables but was not started by srun.
        return (
            os.environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_JOB_NAMES and "SLURM_STEP_ID" in os.environ
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


#: Job names of an interactive allocation (``srun --job-name=interactive``, a ``bash`` shell): not a batch
#: job, so neither detected nor requeued (Lightning's rule).
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def _catchable_signal(value: signal.Signals | int | str) -> signal.Signals:
    """``value`` as a signal Python can handle, or an error naming the argument."""
    from trainer_core.errors import MisconfigurationException

    try:
        if isinstance(value, str):
            name = value.strip().upper()
            found = getattr(signal, name if name.startswith("SIG") else f"SIG{name}")
        else:
            found = value
        found = signal.Signals(found)
    except (AttributeError, ValueError, TypeError):
        raise MisconfigurationException(
            f"SLURMEnvironment(requeue_signal={value!r}) is not a signal of this platform; pass one such as "
            "signal.SIGUSR1 or 'SIGUSR2', the same one as `#SBATCH --signal`."
        ) from None
    if found in (getattr(signal, "SIGKILL", None), getattr(signal, "SIGSTOP", None)):
        raise MisconfigurationException(
            f"SLURMEnvironment(requeue_signal={found.name}): a process cannot catch {found.name}; have SLURM send "
            "another signal before the time limit (`#SBATCH --signal=USR1@90`) and pass that one."
        )
    return found


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
