"""``FaultTolerantDDPPlugin`` (``"ddp_ft"``): data parallelism across replica groups that come and go.

The job is ``R`` replica groups of one process each. Inside a group nothing is distributed; across
groups, torchft's ``Manager`` agrees on a quorum before every optimizer step (the groups alive
now), all-reduces the gradients over the groups in it (torchft's managed gloo group, reconfigured
when the quorum changes), and lets the optimizer step only when the quorum agrees the step is
whole (``should_commit``). A group that dies (SIGKILL) costs the others one step that does not
commit and the time the lighthouse takes to see it gone; they never restart or reload. A group that
starts again joins the next quorum and receives the whole run state (weights, optimizer,
schedulers, loop position, callbacks) from a live group over torchft's checkpoint transport
(HTTP), then trains the same step as the others.

The rules, in docs/architecture.md ("Fault tolerance across replica groups"):

* Quorums are synchronous (torchft's ``use_async_quorum=False``): the quorum for a step is agreed
  before its forward, and a group that heals applies the received state before it, so every group
  in a quorum trains that step on the same weights. The first quorum of a process is agreed before
  its first batch (``checkpoint_from_peer``), so a group that joins a running job restores the
  state the way a resume from a file does, positioned at the batch the others are at.
* Data: a ``DistributedSampler`` over ``R`` shards, shard ``i`` for group ``i`` (torchft's rule),
  so with every group alive each step trains exactly what plain DDP at ``R`` ranks does. A group
  out of the quorum trains nothing: its batches of those steps are skipped, and a step that does
  not commit skips every group's batch. :attr:`steps_record` says, for every step attempt, which
  groups trained it and whether it committed; :func:`skipped_batches` lists what was skipped.
* Only committed steps count: ``global_step``, the learning-rate schedulers and ``max_steps``
  follow committed optimizer steps.
* Group 0 writes checkpoints and logs (it is ``global_rank`` 0); while it is out of the quorum,
  nothing is written, which is logged. The checkpoint is an ordinary DDP checkpoint at ``R`` ranks:
  it resumes under this plugin, under ``"ddp"`` at any number of ranks, and on one process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.base import TrainingTypePlugin
from trainer_core.plugins.ddp import DDPPlugin, _StepRouter
from trainer_core.plugins.launchers import LAUNCHED_VARIABLE, _script_command, terminate

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer

_logger = logging.getLogger("trainer_core")

#: The environment a replica group's process reads (torchft's names where torchft has them).
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_VARIABLE = "REPLICA_GROUP_ID"
NUM_GROUPS_VARIABLE = "NUM_REPLICA_GROUPS"
#: Set by the one-machine launcher in each group it starts: how many times it started that group before.
RESTARTS_VARIABLE = "TRAINER_CORE_GROUP_RESTARTS"
#: Set by the one-machine launcher: where the groups it started first say they are ready for the first quorum.
READY_DIR_VARIABLE = "TRAINER_CORE_GROUPS_READY_DIR"
#: The checkpoint's plugin-state keys.
MANAGER_KEY = "torchft_manager"
STEPS_KEY = "replica_group_steps"
#: What the plugin logs at every step: the replica groups in its quorum.
LIVE_GROUPS_METRIC = "ft/live_groups"
_FT_INSTALL = "pip install 'trainer-core[ft]' (torchft)"


def _import_torchft() -> Any:
    # torchft's Rust side logs every quorum and commit at INFO; the plugin says what a user needs
    # (groups that leave, join and heal). RUST_LOG=info brings torchft's back.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as err:  # pragma: no cover - the test environment has it
        raise MisconfigurationException(
            f"FaultTolerantDDPPlugin ('ddp_ft') runs on torchft, which is not installed: {_FT_INSTALL}."
        ) from err
    return torchft


class _QuorumRecorder:
    """Stands in for the Manager's client: keeps the last quorum for the plugin.

    torchft's ``Manager`` keeps the members of a quorum to itself; the plugin names the groups that
    left or came back, times heals and records which groups trained each step, so it reads the
    quorum as the client returns it.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def replica_name(group: int) -> str:
    """This host, this process and the group number, as the lighthouse sees the group.

    torchft reads the group number from the trailing digits of the part before the first ``:``.
    """
    return f"{socket.gethostname()}_pid{os.getpid()}_group{group}"


def _group_of(replica_id: str) -> int:
    head = replica_id.split(":")[0]
    digits = len(head) - len(head.rstrip("0123456789"))
    return int(head[-digits:]) if digits else -1


def _host_of(replica_id: str) -> str:
    head = replica_id.split(":")[0]
    host, _, rest = head.partition("_pid")
    pid = rest.split("_group")[0]
    return f"host {host}, pid {pid}" if pid else head


def skipped_batches(steps_record: list[dict[str, Any]], num_groups: int) -> list[tuple[int, int, int]]:
    """``(epoch, batch_idx, group)`` of every batch a run skipped, from :attr:`steps_record`.

    A batch is the ``batch_idx``-th batch of the group's own shard of the epoch; it is skipped when
    the group was out of the quorum for that step, or in it but the step did not commit.
    """
    skipped = []
    for run in steps_record:
        groups = set(run["groups"]) if run["committed"] else set()
        for batch in range(run["batch"], run["batch"] + run["batches"]):
            skipped.extend((run["epoch"], batch, g) for g in range(num_groups) if g not in groups)
    return skipped


class FaultTolerantDDPPlugin(DDPPlugin):
    """Data parallelism over replica groups that fail and rejoin without stopping the others (torchft).

    ``replica_groups``: how many groups the job has at most (the data is split in that many shards);
    default ``NUM_REPLICA_GROUPS`` from the environment, else the Trainer's ``devices``.
    ``replica_group``: this process's group; default ``REPLICA_GROUP_ID``. ``lighthouse``: the
    address of torchft's lighthouse (``http://host:port``); default ``TORCHFT_LIGHTHOUSE``. Given
    neither a group nor a lighthouse, ``fit`` on one machine starts the lighthouse in this process,
    runs group 0 here and groups 1..R-1 as this script started again, and starts a group again when
    it dies, up to ``max_restarts`` times each.

    ``min_replica_size``: the fewest groups a step may commit with. ``timeout``: how long a
    gradient all-reduce or a heal may take before the step is abandoned. ``quorum_timeout``: how
    long a quorum may wait. ``join_timeout``, ``heartbeat_timeout``: the lighthouse's (the one
    started here): how long a quorum waits for groups that were in the last one, and how long a
    silent group counts as alive. Keyword arguments other than these go to torch's
    ``DistributedDataParallel``, as under ``"ddp"`` (``find_unused_parameters=True`` for a model
    that leaves parameters unused); communication hooks are not taken (the quorum's all-reduce is
    the hook).
    """

    name = "ddp_ft"
    ddp_comm_hook_unsupported = (
        "the gradients are all-reduced over the quorum of replica groups by torchft's hook"
    )
    optimizer_in_backward_unsupported = (
        "a parameter would step inside backward, before the quorum decides whether the step commits"
    )
    mid_accumulation_gradients_unsaved = None
    votes_on_steps = True

    def __init__(
        self,
        replica_groups: Optional[int] = None,
        replica_group: Optional[int] = None,
        lighthouse: Optional[str] = None,
        min_replica_size: int = 1,
        timeout: timedelta = timedelta(seconds=30),
        quorum_timeout: timedelta = timedelta(seconds=60),
        join_timeout: timedelta = timedelta(milliseconds=500),
        heartbeat_timeout: timedelta = timedelta(seconds=2),
        max_restarts: int = 3,
        **ddp_kwargs: Any,
    ) -> None:
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if ddp_kwargs.get(name) is not None:
                raise MisconfigurationException(
                    f"FaultTolerantDDPPlugin({name}=...): {self.ddp_comm_hook_unsupported}; use 'ddp' for a hook of "
                    "your own."
                )
        if "start_method" in ddp_kwargs or "cluster_environment" in ddp_kwargs:
            raise MisconfigurationException(
                "FaultTolerantDDPPlugin starts its replica groups itself or is started one group at a time (by "
                "torchrun or by hand); start_method and cluster_environment are not taken."
            )
        super().__init__(timeout=timeout, **ddp_kwargs)
        self._groups_arg = replica_groups
        self._group_arg = replica_group
        self._lighthouse_arg = lighthouse
        if min_replica_size < 1:
            raise MisconfigurationException(
                f"FaultTolerantDDPPlugin(min_replica_size={min_replica_size}): a step needs at least 1 group."
            )
        self.min_replica_size = min_replica_size
        self.quorum_timeout = quorum_timeout
        self.join_timeout = join_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.max_restarts = max_restarts
        self._manager: Any = None
        self._recorder: Optional[_QuorumRecorder] = None
        self._store: Any = None
        self._lighthouse_server: Any = None
        self._supervisor: Optional[_GroupSupervisor] = None
        # A quorum is agreed before each optimizer step's first batch; the first before the loop.
        self._quorum_due = True
        self._members: Optional[tuple[str, ...]] = None
        self._received: Optional[dict[str, Any]] = None
        self._before_loop = False
        self._log_groups = False
        self._sent_from = ""
        #: Whether the last optimizer step committed (every group in the quorum agreed it was whole).
        self.step_committed = True
        self._attempt: Optional[tuple[int, int, tuple[int, ...]]] = None
        #: Runs of batches trained alike: ``{"epoch", "batch" (the first), "batches", "groups", "committed"}``.
        self.steps_record: list[dict[str, Any]] = []
        #: Seconds each heal of this group took (the quorum, receiving the state and loading it).
        self.heal_seconds: list[float] = []
        self._warned_no_writer = False

    # ------------------------------------------------------------------ where this process stands
    @property
    def replica_groups(self) -> int:
        groups = self._groups_arg
        if groups is None and NUM_GROUPS_VARIABLE in os.environ:
            groups = int(os.environ[NUM_GROUPS_VARIABLE])
        if groups is None:
            groups = self._num_devices * self._num_nodes
        return groups

    @property
    def replica_group(self) -> int:
        if self._group_arg is not None:
            return self._group_arg
        return int(os.environ.get(REPLICA_GROUP_VARIABLE, "0"))

    @property
    def global_rank(self) -> int:
        return self.replica_group

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self.replica_groups

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu") if self._device_type != "cuda" else torch.device("cuda", 0)

    @property
    def lighthouse(self) -> Optional[str]:
        return self._lighthouse_arg or os.environ.get(LIGHTHOUSE_VARIABLE) or None

    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        self._device_type = device_type
        self._num_devices = num_devices
        self._num_nodes = num_nodes
        groups = self.replica_groups
        if groups < 1:
            raise MisconfigurationException(
                f"FaultTolerantDDPPlugin(replica_groups={groups}): give 1 or more."
            )
        if not 0 <= self.replica_group < groups:
            raise MisconfigurationException(
                f"FaultTolerantDDPPlugin: replica group {self.replica_group} ({REPLICA_GROUP_VARIABLE}) is not one "
                f"of the job's {groups} groups ({NUM_GROUPS_VARIABLE} or replica_groups=): groups are numbered "
                f"0..{groups - 1}."
            )
        group_size = os.environ.get("WORLD_SIZE", "1")
        if REPLICA_GROUP_VARIABLE in os.environ and group_size != "1":
            raise MisconfigurationException(
                f"FaultTolerantDDPPlugin: this replica group has {group_size} processes (WORLD_SIZE); each group is "
                "one process: start one torchrun per group with --nproc-per-node 1."
            )

    # ------------------------------------------------------------------ processes
    def _starts_processes(self) -> bool:
        return (
            REPLICA_GROUP_VARIABLE not in os.environ
            and self._group_arg is None
            and self.lighthouse is None
            and self.replica_groups > 1
        )

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """On one machine: the lighthouse here, group 0 here, groups 1..R-1 this script started again."""
        if self._starts_processes() and self._supervisor is None:
            if LAUNCHED_VARIABLE in os.environ:
                raise MisconfigurationException(
                    f"FaultTolerantDDPPlugin: this process was started by trainer-core ({LAUNCHED_VARIABLE}) but has "
                    f"no {REPLICA_GROUP_VARIABLE}; it would start the groups again."
                )
            lighthouse_type = _import_torchft()._torchft.LighthouseServer
            self._lighthouse_server = lighthouse_type(
                bind="[::]:0",
                min_replicas=self.min_replica_size,
                join_timeout_ms=int(self.join_timeout.total_seconds() * 1000),
                heartbeat_timeout_ms=int(self.heartbeat_timeout.total_seconds() * 1000),
            )
            address = self._lighthouse_server.address()
            os.environ[LIGHTHOUSE_VARIABLE] = address
            os.environ[NUM_GROUPS_VARIABLE] = str(self.replica_groups)
            os.environ[REPLICA_GROUP_VARIABLE] = "0"
            os.environ[READY_DIR_VARIABLE] = tempfile.mkdtemp(prefix="trainer-core-ft-")
            self._supervisor = _GroupSupervisor(self.replica_groups, self.max_restarts)
            self._supervisor.start_all()
        try:
            return function(*args, **kwargs)
        except BaseException:
            if self._supervisor is not None:
                self._supervisor.stop(grace=0)
            raise

    def setup_environment(self) -> None:
        TrainingTypePlugin.setup_environment(self)
        _import_torchft()
        address = self.lighthouse
        if address is None:
            raise MisconfigurationException(
                f"FaultTolerantDDPPlugin: no lighthouse. Give lighthouse='http://host:port' or {LIGHTHOUSE_VARIABLE} "
                f"(start one with `python -m torchft.lighthouse` or torchft's LighthouseServer), or run with "
                f"replica_groups=N and neither {REPLICA_GROUP_VARIABLE} nor a lighthouse set, and the plugin starts "
                "one here with the groups."
            )
        _check_reachable(address, self.quorum_timeout)
        if dist.is_initialized():
            return
        # The group's own store (one process): torchft's Manager finds its server's address in it, and the
        # group's default process group (collectives inside the group are the plugin's no-ops) lives on it.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=self._store, rank=0, world_size=1, timeout=self.timeout)

    # Inside a group of one process every collective is the process itself.
    barrier = TrainingTypePlugin.barrier
    broadcast = TrainingTypePlugin.broadcast
    reduce = TrainingTypePlugin.reduce
    all_gather = TrainingTypePlugin.all_gather
    all_gather_object = TrainingTypePlugin.all_gather_object
    reduce_boolean_decision = TrainingTypePlugin.reduce_boolean_decision

    def _shared_download(self, filepath: str) -> Any:
        return None

    # ------------------------------------------------------------------ model and manager
    def setup(self, trainer: Trainer) -> None:
        module = self._lightning_module
        if module is not None and not module.automatic_optimization:
            raise MisconfigurationException(
                "FaultTolerantDDPPlugin: manual optimization is not supported: the plugin decides whether each "
                "optimizer step commits after the quorum's all-reduce. Use automatic optimization."
            )
        self.trainer = trainer
        if trainer.state_stage == "fit" and self._manager is None:
            self._manager = self._make_manager(trainer)
        super().setup(trainer)
        if trainer.state_stage == "fit" and len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"FaultTolerantDDPPlugin: configure_optimizers returned {len(self.optimizers)} optimizers; the quorum "
                "commits one optimizer step at a time: return one."
            )

    def _make_manager(self, trainer: Trainer) -> Any:
        _import_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        group = self.replica_group
        manager = Manager(
            pg=ProcessGroupGloo(timeout=self.timeout),
            load_state_dict=self._load_from_peer,
            state_dict=self._state_for_peer,
            min_replica_size=self.min_replica_size,
            use_async_quorum=False,
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.quorum_timeout,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self._store.port if self._store is not None else int(os.environ["MASTER_PORT"]),
            lighthouse_addr=self.lighthouse,
            replica_id=replica_name(group),
            hostname=socket.gethostname(),
        )
        self._recorder = _QuorumRecorder(manager._client)
        manager._client = self._recorder
        return manager

    def wrap_model(self, module: nn.Module) -> nn.Module:
        """torch's ``DistributedDataParallel`` whose buckets are all-reduced over the quorum of replica groups.

        As torchft's own wrapper: a one-rank dummy group soaks up DDP's own collectives and the
        communication hook all-reduces over the quorum. The buckets are fixed when the wrapper is
        built (parameters in definition order, DDP's size limits), so a group built later, to rejoin,
        reduces in the same buckets as the groups that trained on; DDP never rebuilds them.
        """
        from torchft.process_group import ProcessGroupDummy

        manager = self._manager
        if manager is None:  # validate/test/predict: no quorum, the module itself
            return module
        model = nn.parallel.DistributedDataParallel(
            _StepRouter(module), process_group=ProcessGroupDummy(0, 1), **self._ddp_kwargs
        )
        if not self._ddp_kwargs.get("find_unused_parameters"):
            reducer = model.reducer
            reducer._push_all_rebuilt_params()
            if reducer._rebuild_buckets():
                model._has_rebuilt_buckets = True
        model.register_comm_hook(manager, _allreduce_over_quorum)
        return model

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._quorum_due:
            self._quorum_due = False
            self._agree_on_quorum()
        if self._log_groups:
            self._log_groups = False
            module = self._lightning_module
            assert module is not None
            module.log(LIVE_GROUPS_METRIC, float(self.live_groups()), on_step=True, on_epoch=False)
        return super().training_step(*args, **kwargs)

    def optimizer_step(
        self, optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None, **kwargs: Any
    ) -> Any:
        """The closure (forward, backward, the quorum's all-reduce), then the quorum's vote, then the step if it commits."""
        manager = self._manager
        assert closure is not None and manager is not None

        def closure_then_vote() -> Any:
            loss = closure()
            self.step_committed = committed = manager.should_commit()
            if not committed:
                # The gradients are partial or corrupt: nothing steps (torch's optimizers skip a parameter without one).
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None
            self._record_attempt(committed)
            self._quorum_due = True
            return loss

        return super().optimizer_step(optimizer, closure_then_vote, **kwargs)

    def _agree_on_quorum(self) -> None:
        """The quorum for the next step: who trains it; a group behind the others heals from one of them first."""
        manager = self._manager
        recorder = self._recorder
        assert manager is not None and recorder is not None
        started = time.monotonic()
        try:
            manager.start_quorum()
        except Exception as err:
            raise RuntimeError(
                f"FaultTolerantDDPPlugin (replica group {self.replica_group}): no quorum could be agreed with the "
                f"lighthouse at {self.lighthouse} ({type(err).__name__}: {err}). The lighthouse is down or cannot be "
                "reached: start it again and restart the groups; they resume from the newest checkpoint "
                "(fit(ckpt_path='last'))."
            ) from err
        quorum = recorder.last
        if quorum is None:
            return
        if quorum.heal:
            seconds = time.monotonic() - started
            self.heal_seconds.append(seconds)
            _logger.warning(
                f"FaultTolerantDDPPlugin: replica group {self.replica_group} healed from replica group "
                f"{self._sent_from or '?'} at step {quorum.max_step} in {seconds:.2f} s (the quorum, receiving the "
                "state and loading it)."
            )
        self._note_members(tuple(sorted(quorum.replica_ids)))
        self._log_groups = True

    def _note_members(self, members: tuple[str, ...]) -> None:
        before = self._members
        self._members = members
        if before is None or before == members:
            return
        old = {_group_of(m): m for m in before}
        new = {_group_of(m): m for m in members}
        for group in sorted(set(old) - set(new)):
            _logger.warning(
                f"FaultTolerantDDPPlugin: replica group {group} ({_host_of(old[group])}) left the quorum; "
                f"{len(new)} group(s) go on."
            )
        for group in sorted(set(new) - set(old)):
            _logger.warning(
                f"FaultTolerantDDPPlugin: replica group {group} ({_host_of(new[group])}) joined the quorum; "
                f"{len(new)} group(s) train."
            )
        # A group started again before the lighthouse gave up on it: the same number, another process.
        for group in sorted(g for g in set(old) & set(new) if old[g] != new[g]):
            _logger.warning(
                f"FaultTolerantDDPPlugin: replica group {group} ({_host_of(old[group])}) left the quorum and its "
                f"new process ({_host_of(new[group])}) joined the quorum in the same step; {len(new)} group(s) train."
            )
        if 0 not in new and self.replica_group == min(new) and not self._warned_no_writer:
            self._warned_no_writer = True
            _logger.warning(
                "FaultTolerantDDPPlugin: replica group 0 writes the checkpoints and logs and is out of the quorum: "
                "none are written until it rejoins."
            )

    def live_groups(self) -> int:
        """How many replica groups are in the current quorum."""
        return len(self._members) if self._members else 1

    def _record_attempt(self, committed: bool) -> None:
        """Which groups trained the batches of this optimizer step, and whether it committed (runs alike merged)."""
        trainer = self.trainer
        assert trainer is not None
        progress = trainer.progress
        last_batch = progress.batch_idx
        first = last_batch - last_batch % trainer.accumulate_grad_batches
        groups = sorted(_group_of(m) for m in self._members or ())
        epoch = progress.current_epoch
        record = self.steps_record
        if record:
            run = record[-1]
            if (
                run["epoch"] == epoch
                and run["batch"] + run["batches"] == first
                and run["groups"] == groups
                and run["committed"] == committed
            ):
                run["batches"] += last_batch - first + 1
                return
        record.append(
            {
                "epoch": epoch,
                "batch": first,
                "batches": last_batch - first + 1,
                "groups": groups,
                "committed": committed,
            }
        )
        if not committed:
            _logger.warning(
                f"FaultTolerantDDPPlugin (replica group {self.replica_group}): the step at epoch {epoch}, batch "
                f"{first} did not commit (a replica group failed during it); the groups go on with the next batch, "
                "and this one is recorded as skipped."
            )

    # ------------------------------------------------------------------ state from and to live peers
    def checkpoint_from_peer(self) -> Optional[tuple[dict[str, Any], str]]:
        """Agree on the first quorum before the first batch; a group behind the others gets their state.

        Returns the checkpoint a live group sent and where it came from, for the fit loop to restore
        as it restores a file (the loop position included), or ``None``.
        """
        if self._manager is None:
            return None
        self._quorum_due = False
        self._wait_for_first_groups()
        self._before_loop = True
        try:
            self._agree_on_quorum()
        finally:
            self._before_loop = False
        received, self._received = self._received, None
        if received is None and self._alone_after_a_restart():
            _logger.warning(
                f"FaultTolerantDDPPlugin: replica group {self.replica_group} was started again but no live group is "
                "left to heal from (the run has ended, or every group died): it exits instead of training alone from "
                "the start. Resume the run from its newest checkpoint (fit(ckpt_path='last'))."
            )
            logging.shutdown()
            os._exit(0)
        if received is None:
            return None
        return received, f"replica group {self._sent_from} (a live peer)"

    def _alone_after_a_restart(self) -> bool:
        """A group started again (by the one-machine launcher or torchrun), in a quorum of its own at step 0.

        Under torchrun a restarted group resumes the newest checkpoint first (its step is then not 0).
        """
        manager = self._manager
        restarted = os.environ.get(RESTARTS_VARIABLE, "0") != "0" or os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "0"
        ) not in ("", "0")
        return (
            restarted
            and manager is not None
            and manager.current_step() == 0
            and self.replica_groups > 1
            and len(self._members or ()) == 1
        )

    def _wait_for_first_groups(self) -> None:
        """On one machine, the groups' first start: every group reaches its first quorum before any asks.

        They start together but take seconds to import and set up; the lighthouse would form the
        first quorum of whichever came first, which would then train alone until the others heal in.
        Groups started again after a failure do not wait: they heal into the running quorum.
        """
        ready = os.environ.get(READY_DIR_VARIABLE)
        if not ready or os.environ.get(RESTARTS_VARIABLE, "0") != "0":
            return
        Path(ready, f"group{self.replica_group}").touch()
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        while time.monotonic() < deadline:
            if all(Path(ready, f"group{g}").exists() for g in range(self.replica_groups)):
                return
            time.sleep(0.05)
        _logger.warning(
            f"FaultTolerantDDPPlugin: not every replica group was ready within {self.quorum_timeout}; the first "
            "quorum forms with those that are, the others heal in when they arrive."
        )

    def _state_for_peer(self) -> dict[str, Any]:
        """What a group that heals from this one receives: this group's checkpoint as a file would hold it."""
        from trainer_core.checkpoint.save import dump_checkpoint

        trainer = self.trainer
        assert trainer is not None
        checkpoint = dump_checkpoint(trainer.checkpoint_parts())
        checkpoint["_ft_sender"] = self.replica_group
        return checkpoint

    def _load_from_peer(self, checkpoint: dict[str, Any]) -> None:
        """A live group's state. Before the loop the fit loop restores it whole; inside it, what moves with steps."""
        self._sent_from = str(checkpoint.pop("_ft_sender", "?"))
        trainer = self.trainer
        assert trainer is not None
        if self._before_loop:
            self._received = checkpoint
            return
        from trainer_core.checkpoint.restore import restore_between_steps

        restore_between_steps(trainer.checkpoint_parts(), checkpoint, f"replica group {self._sent_from}")

    def plugin_state_dict(self) -> dict[str, Any]:
        state = super().plugin_state_dict()
        if self._manager is not None:
            state[MANAGER_KEY] = self._manager.state_dict()
        state[STEPS_KEY] = [dict(run) for run in self.steps_record]
        return state

    def load_plugin_state_dict(self, state: dict[str, Any]) -> None:
        super().load_plugin_state_dict(state)
        if self._manager is not None and MANAGER_KEY in state:
            self._manager.load_state_dict(state[MANAGER_KEY])
        if STEPS_KEY in state:
            self.steps_record = [dict(run) for run in state[STEPS_KEY]]

    def on_exception(self, exception: BaseException) -> None:
        # Not ParallelPlugin's note on failed collectives: a group's failure does not fail the others here.
        TrainingTypePlugin.on_exception(self, exception)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            with contextlib.suppress(Exception):
                manager.shutdown(wait=False)
            # The quorum's gloo group is released now, not by the interpreter's exit, where gloo can
            # abort the process ("terminate called without an active exception", seen once in ten runs).
            with contextlib.suppress(Exception):
                manager._pg.shutdown()
        super().teardown()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._supervisor is not None and self.trainer is not None and self.trainer.state_stage == "fit":
            self._supervisor.wait()
            self._supervisor = None
        if self._lighthouse_server is not None:
            self._lighthouse_server.shutdown()
            self._lighthouse_server = None
            ready = os.environ.get(READY_DIR_VARIABLE)
            if ready:
                shutil.rmtree(ready, ignore_errors=True)
            for name in (
                LIGHTHOUSE_VARIABLE,
                NUM_GROUPS_VARIABLE,
                REPLICA_GROUP_VARIABLE,
                READY_DIR_VARIABLE,
            ):
                os.environ.pop(name, None)


def _allreduce_over_quorum(manager, bucket):  # type: ignore[no-untyped-def]
    """DDP's communication hook: the bucket summed over the quorum and divided by its size, in place.

    Unannotated: DDP compares the ``bucket`` annotation with the class itself, and this module's
    annotations are strings.

    When the all-reduce fails (a group died or hangs past ``timeout``), the manager records the
    error, the bucket is left as it is and the step does not commit (``should_commit``). torchft's
    own hook asserts there instead of returning.
    """
    buffer = bucket.buffer()
    manager.allreduce(buffer).wait()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _check_reachable(address: str, timeout: timedelta) -> None:
    """One TCP connection to the lighthouse before anything trains: a wrong address fails here, clearly."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise MisconfigurationException(
            f"FaultTolerantDDPPlugin: lighthouse address {address!r} ({LIGHTHOUSE_VARIABLE} or lighthouse=) has no "
            "host and port; give it as http://host:port."
        )
    deadline = time.monotonic() + min(timeout.total_seconds(), 10.0)
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise MisconfigurationException(
                    f"FaultTolerantDDPPlugin: the torchft lighthouse at {address} cannot be reached ({err}); nothing "
                    "was trained. Start it (`python -m torchft.lighthouse --min_replicas 1`) and give its address "
                    f"as {LIGHTHOUSE_VARIABLE} or lighthouse=."
                ) from err
            time.sleep(0.2)


class _GroupSupervisor:
    """Groups 1..R-1 of a one-machine run: this script started again, and again when one dies."""

    def __init__(self, groups: int, max_restarts: int) -> None:
        self.groups = groups
        self.max_restarts = max_restarts
        self.children: dict[int, subprocess.Popen] = {}
        self.restarts: dict[int, int] = dict.fromkeys(range(1, groups), 0)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainer-core-ft-supervisor", daemon=True)

    def _start(self, group: int) -> None:
        env = dict(
            os.environ,
            **{
                REPLICA_GROUP_VARIABLE: str(group),
                LAUNCHED_VARIABLE: str(os.getpid()),
                RESTARTS_VARIABLE: str(self.restarts[group]),
            },
        )
        self.children[group] = subprocess.Popen(_script_command(), env=env, cwd=os.getcwd())

    def start_all(self) -> None:
        for group in range(1, self.groups):
            self._start(group)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(0.5):
            for group, child in list(self.children.items()):
                code = child.poll()
                if code in (None, 0) or self._stopped.is_set():
                    continue
                if self.restarts[group] >= self.max_restarts:
                    continue
                self.restarts[group] += 1
                sys.stderr.write(
                    f"[trainer-core] replica group {group} (pid {child.pid}) exited with {code}; starting it again "
                    f"({self.restarts[group]} of {self.max_restarts}); it heals from a live group.\n"
                )
                self._start(group)

    def wait(self, timeout: float = 120.0) -> None:
        """After group 0's fit: the others finish the same steps; then the watch ends."""
        deadline = time.monotonic() + timeout
        for child in list(self.children.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.stop(grace=5.0)

    def stop(self, grace: float) -> None:
        self._stopped.set()
        terminate(list(self.children.values()), grace_seconds=grace)
