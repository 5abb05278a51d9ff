"""Where a process learns its rank: torchrun/TorchElastic, SLURM, a local launch of our own, or the user's own.

An environment only *reads* ranks and the rendezvous address; it never starts processes. When the
Trainer is given none, :func:`detect_environment` picks one: an environment class the user defined
whose ``detect()`` holds, else torchrun, SLURM, local, in that order.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import logging
import os
import random
import re
import signal
import socket
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

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


#: What each abstract member answers, for the error a subclass that lacks one gets.
_ABSTRACT_MEMBERS = {
    "creates_processes_externally": "True when something else (a scheduler, torchrun) started every process, "
    "False to have trainer-core start the local ranks",
    "detect": "a staticmethod, True when this process runs under your scheduler (read its environment variables)",
    "world_size": "the number of processes over all nodes",
    "global_rank": "this process's rank among all processes",
    "local_rank": "this process's rank on its node",
    "node_rank": "the rank of this process's node",
}


class ClusterEnvironment(abc.ABC):
    """The ranks and rendezvous of this process: the contract of an environment the user writes.

    A subclass must implement ``creates_processes_externally``, ``detect``, ``world_size``,
    ``global_rank``, ``local_rank`` and ``node_rank``; one that lacks any cannot be instantiated, and
    the ``TypeError`` names what is missing (a default ``creates_processes_externally = False`` let a
    class that forgot it start copies of the script without end). It may override ``main_address``, ``main_port``, ``validate`` and
    ``process_group_store``. ``set_world_size``/``set_global_rank`` are Lightning's: they do nothing
    here, so a Lightning environment class ports unchanged.

    Every process builds its own instance: one passed in ``Trainer(plugins=[MyEnv()])`` is built by the
    script in each rank, one found by :func:`detect_environment` is built with no arguments. Members
    are read when the Trainer is built and when a run sets up its processes, never per step.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ClusterEnvironment:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            needed = "; ".join(
                f"`{name}` ({_ABSTRACT_MEMBERS.get(name, 'see ClusterEnvironment')})" for name in missing
            )
            raise TypeError(
                f"Can't instantiate abstract class {cls.__name__}: it does not implement {', '.join(missing)}. "
                f"Every ClusterEnvironment defines {needed}."
            )
        return super().__new__(cls)

    @property
    @abc.abstractmethod
    def creates_processes_externally(self) -> bool:
        """Whether something outside trainer-core (torchrun, srun, your scheduler) started every process.

        ``True``: every rank already runs this script and trainer-core starts none. ``False``: the
        process the user started is local rank 0 and trainer-core's launcher starts local ranks
        1..N-1; in those it must then say ``True`` (they have ``TRAINER_CORE_LAUNCHED`` and
        ``LOCAL_RANK`` in their environment, as :class:`LocalEnvironment` reads). A launcher asked to
        start processes from a process it started refuses. Read in every process when the Trainer is
        built and when a run starts; a class attribute (``creates_processes_externally = True``) will do.
        """

    @staticmethod
    @abc.abstractmethod
    def detect() -> bool:
        """Whether this process runs under this environment, from its environment variables alone.

        Called with no instance by :func:`detect_environment` in every process when a Trainer is built
        without an environment; a subclass the user defines whose ``detect()`` returns True is built
        with no arguments and used. Cheap and free of side effects. Make it depend on a variable that
        only your scheduler sets: every subclass defined in the interpreter is asked, including those
        a test suite defined for other tests.
        """

    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of processes over all nodes (``devices * num_nodes`` of the Trainer).

        Read by the plugin in every process: when the Trainer is built (``validate``), to decide whether
        to start processes, for ``init_process_group`` and the data split.
        """

    @abc.abstractmethod
    def global_rank(self) -> int:
        """This process's rank among all processes, 0 to ``world_size() - 1``; 0 writes checkpoints and logs."""

    @abc.abstractmethod
    def local_rank(self) -> int:
        """This process's rank among the processes of its node; it picks the GPU (``cuda:<local_rank>``)."""

    @abc.abstractmethod
    def node_rank(self) -> int:
        """The rank of this process's node, 0 to ``num_nodes - 1``."""

    @property
    def main_address(self) -> str:
        """The host of global rank 0 where every process meets: ``$MASTER_ADDR``, else 127.0.0.1.

        Read by every process before ``init_process_group``, and by the launching process before it
        starts the local ranks (which inherit it as ``MASTER_ADDR``); every process must get the same.
        """
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """The port on :attr:`main_address` where every process meets: ``$MASTER_PORT``.

        Without ``MASTER_PORT``, an environment whose processes trainer-core starts picks a free port
        and puts it in this process's environment, which the processes it starts inherit; one whose
        processes are started elsewhere cannot pick one that every process agrees on, and says so.
        """
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        if not self.creates_processes_externally:
            os.environ["MASTER_PORT"] = str(find_free_port())
            return int(os.environ["MASTER_PORT"])
        from trainer_core.errors import MisconfigurationException

        raise MisconfigurationException(
            f"{type(self).__name__}.main_port: MASTER_PORT is not set in this process; set it to the same port in "
            "every process, or override `main_port` to return the port your scheduler gives the job."
        )

    def validate(self, num_devices: int, num_nodes: int) -> None:
        """Fail early when the Trainer's ``devices``/``num_nodes`` disagree with the launcher.

        Called once in every process when the Trainer is built, for an environment whose processes
        were started elsewhere (``creates_processes_externally``); raise ``MisconfigurationException``.
        """
        expected = num_devices * num_nodes
        actual = self.world_size()
        if actual != expected:
            from trainer_core.errors import MisconfigurationException

            raise MisconfigurationException(
                f"{type(self).__name__} started {actual} processes but Trainer(devices={num_devices}, "
                f"num_nodes={num_nodes}) expects {expected}; make them agree."
            )

    def process_group_store(self, timeout: timedelta) -> Optional[Store]:
        """The store the process group meets in; ``None``: torch's own ``env://`` rendezvous.

        Called in every process when a run sets up its processes, just before ``init_process_group``;
        the ``env://`` rendezvous meets at :attr:`main_address`:``main_port``.
        """
        return None

    def set_world_size(self, size: int) -> None:  # noqa: B027 (optional, a no-op by default)
        """Told the world size the Trainer asked for (``devices * num_nodes``); ignored by default.

        Lightning's hook, so a Lightning environment class ports unchanged: called in every process
        when the Trainer is built and again when a run sets up its processes.
        """

    def set_global_rank(self, rank: int) -> None:  # noqa: B027 (optional, a no-op by default)
        """Told this process's global rank (``node_rank * devices + local_rank``); ignored by default.

        Lightning's hook, called with :meth:`set_world_size`.
        """


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
    """The environment of a Trainer given none: the user's own if one detects this process, else a built-in.

    Every concrete subclass of :class:`ClusterEnvironment` defined outside trainer-core is asked first
    (see :func:`installed_environments`), so a site-specific scheduler works by defining (importing) its
    class; the one whose ``detect()`` returns True is built with no arguments. Then torchrun, SLURM and
    our own local launch, in that order. Two of the user's classes detecting this process at once is an
    error naming both.
    """
    user = _detected_user_environment()
    if user is not None:
        return user
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment()
    return LocalEnvironment(num_devices, num_nodes)


def installed_environments() -> list[type[ClusterEnvironment]]:
    """The user's environment classes :func:`detect_environment` asks, in a fixed order (module, then name).

    Every subclass, at any depth, that can be instantiated, is defined outside trainer-core, and
    defines ``detect()`` itself or inherits it from a class outside trainer-core: a subclass of a
    built-in that keeps the built-in's ``detect()`` is passed explicitly (``plugins=[MySLURM()]``),
    since a ``LocalEnvironment`` subclass would otherwise be picked in every process.
    """
    found: dict[type, None] = {}
    pending = list(ClusterEnvironment.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        found[cls] = None
        pending.extend(cls.__subclasses__())
    users = [
        cls
        for cls in found
        if _is_users(cls) and not inspect.isabstract(cls) and _is_users(_detect_owner(cls))
    ]
    return sorted(users, key=lambda cls: (cls.__module__, cls.__qualname__))


def _is_users(cls: type) -> bool:
    return not cls.__module__.startswith(("trainer_core", "plugins."))


def _detect_owner(cls: type) -> type:
    """The class in ``cls``'s MRO whose body defines ``detect``."""
    return next(base for base in cls.__mro__ if "detect" in vars(base))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _detected_user_environment() -> Optional[ClusterEnvironment]:
    from trainer_core.errors import MisconfigurationException

    detecting = [cls for cls in installed_environments() if _detects(cls)]
    if not detecting:
        return None
    if len(detecting) > 1:
        raise MisconfigurationException(
            f"{len(detecting)} cluster environments detect this process: "
            f"{' and '.join(_qualified(cls) for cls in detecting)} (their detect() returns True). Make the "
            "detect() of at most one return True here, or pass the one to use: "
            f"Trainer(plugins=[{detecting[0].__name__}()])."
        )
    cls = detecting[0]
    try:
        return cls()
    except Exception as err:
        raise MisconfigurationException(
            f"{_qualified(cls)}.detect() returned True, but {cls.__name__}() failed ({type(err).__name__}: {err}). "
            "An environment found by detect() is built with no arguments: give every __init__ argument a "
            f"default, or pass an instance: Trainer(plugins=[{cls.__name__}(...)])."
        ) from err


def _detects(cls: type[ClusterEnvironment]) -> bool:
    try:
        return bool(cls.detect())
    except Exception as err:
        from trainer_core.errors import MisconfigurationException

        raise MisconfigurationException(
            f"{_qualified(cls)}.detect() raised {type(err).__name__}: {err}. detect() is asked in every process "
            "that builds a Trainer without an environment: return False where your scheduler's variables are missing."
        ) from err


def check_environment_argument(owner: str, environment: Any) -> Optional[ClusterEnvironment]:
    """``environment`` when it is a :class:`ClusterEnvironment` instance (or ``None``); else an error for ``owner``.

    ``owner`` is the constructor the argument was given to, e.g. ``"DDPPlugin"``.
    """
    if environment is None or isinstance(environment, ClusterEnvironment):
        return environment
    from trainer_core.errors import MisconfigurationException

    if isinstance(environment, type) and issubclass(environment, ClusterEnvironment):
        raise MisconfigurationException(
            f"{owner}(cluster_environment={environment.__name__}): pass {environment.__name__}() (an instance), "
            "not the class."
        )
    raise MisconfigurationException(
        f"{owner}(cluster_environment={environment!r}): a {type(environment).__name__} is not a ClusterEnvironment; "
        "pass an instance of one (SLURMEnvironment(), TorchElasticEnvironment() or your ClusterEnvironment subclass)."
    )
