"""Starting the processes of a run that no outside launcher (torchrun, srun) started.

``ScriptLauncher`` re-runs the user's command as the other local ranks (Lightning's ``"ddp"``):
nothing needs to be picklable and each rank is an ordinary process. ``SpawnLauncher`` starts the
ranks with ``torch.multiprocessing`` (``"ddp_spawn"``) and hands rank 0's result and trained
weights back to the calling process. Both make sure one failing rank ends every rank quickly
instead of leaving the others blocked in a collective until its timeout.

Every process they start has ``TRAINER_CORE_LAUNCHED`` (the launching process's pid) in its environment,
and neither starts processes from such a process, whatever its environment says: a rank that
re-ran the script must never launch again (a copy that launches starts copies without end).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from trainer_core.plugins.environments import ClusterEnvironment

_POLL_SECONDS = 0.5
_OUTCOME_FILE = "rank0-outcome.pt"

#: Set in every process a launcher starts, to the pid of the process that started it.
LAUNCHED_VARIABLE = "TRAINER_CORE_LAUNCHED"


def refuse_relaunch(environment: ClusterEnvironment) -> None:
    """Raise when this process was started by our launcher: it must not start processes again.

    Called before anything is started, when the Trainer is built and by each launcher.
    """
    launcher_pid = os.environ.get(LAUNCHED_VARIABLE)
    if launcher_pid is None:
        return
    from trainer_core.errors import MisconfigurationException

    name = type(environment).__name__
    raise MisconfigurationException(
        f"{name}.creates_processes_externally is False in a process that trainer-core's launcher started "
        f"({LAUNCHED_VARIABLE}={launcher_pid}, the pid of the process that started it), so this process would "
        f"start the ranks again, and each of them again, without end; nothing was started. Make "
        f"{name}.creates_processes_externally return True in the processes trainer-core starts (they have "
        f"{LAUNCHED_VARIABLE} and LOCAL_RANK set, as LocalEnvironment reads), or True everywhere when your "
        "scheduler starts every process."
    )


def _script_command() -> list[str]:
    """The command that started this process, so a child runs exactly the same program."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        # Started as `python -m package.module`.
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    script = sys.argv[0]
    if not script or script == "-c" or not os.path.exists(script):
        from trainer_core.errors import MisconfigurationException

        raise MisconfigurationException(
            "plugins='ddp' starts the other ranks by running this program's script again, but this process was "
            "not started from a script (interactive session or `python -c`). Put the code in a script, use "
            "torchrun, or pass plugins='ddp_spawn'."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


class _ChildWatcher(threading.Thread):
    """Ends the whole run when a child rank dies with an error, so no rank waits on it forever."""

    def __init__(self, children: list[subprocess.Popen]) -> None:
        super().__init__(daemon=True, name="trainer-core-child-watcher")
        self.children = children
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(_POLL_SECONDS):
            for child in self.children:
                code = child.poll()
                if code not in (None, 0):
                    sys.stderr.write(
                        f"\n[trainer-core] rank process {child.pid} exited with code {code}; ending every rank.\n"
                    )
                    sys.stderr.flush()
                    terminate(self.children, grace_seconds=0)
                    os._exit(1 if code > 0 else 128 - code)


def terminate(children: list[subprocess.Popen], grace_seconds: float = 5.0) -> None:
    """SIGTERM every live child, then SIGKILL whatever is still there after ``grace_seconds``.

    When the run has already failed, the grace is 0: a rank treats SIGTERM as pre-emption and would
    spend the grace trying to agree on a checkpoint with the rank that failed.
    """
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for child in children:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            child.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            child.kill()


class ScriptLauncher:
    """Local rank 0 runs the function; local ranks 1..N-1 are this script started again."""

    def __init__(self, environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> None:
        self.environment = environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.children: list[subprocess.Popen] = []
        self._watcher: Optional[_ChildWatcher] = None

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.environment.creates_processes_externally and not self.children:
            refuse_relaunch(self.environment)
            self._start_children()
        try:
            return function(*args, **kwargs)
        except SystemExit as stop:
            # A clean stop (pre-emption saved a checkpoint on every rank): the children end at the same
            # step and are reaped at exit; any other exit code is a failure.
            if stop.code not in (None, 0):
                self.stop_children()
            raise
        except BaseException:
            # Rank 0 failed: the children would wait for it in the next collective until the timeout.
            self.stop_children()
            raise

    def _start_children(self) -> None:
        env = self.environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ.setdefault("NODE_RANK", str(env.node_rank()))
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        command = _script_command()
        for local_rank in range(1, self.num_processes):
            child_env = dict(os.environ, LOCAL_RANK=str(local_rank), **{LAUNCHED_VARIABLE: str(os.getpid())})
            self.children.append(subprocess.Popen(command, env=child_env, cwd=os.getcwd()))
        self._watcher = _ChildWatcher(self.children)
        self._watcher.start()
        # Rank 0 outlives its children (as torchrun's agent does): it reaps them before exiting.
        atexit.register(self._wait_for_children)

    def _wait_for_children(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if any(child.poll() is None for child in self.children):
            terminate(self.children)

    def stop_children(self) -> None:
        if self._watcher is not None:
            self._watcher.stopped.set()
        terminate(self.children, grace_seconds=0)


class SpawnLauncher:
    """Start every rank with ``torch.multiprocessing`` (spawn) and return rank 0's result here."""

    def __init__(
        self, environment: ClusterEnvironment, num_processes: int, start_method: str = "spawn"
    ) -> None:
        self.environment = environment
        self.num_processes = num_processes
        self.start_method = start_method

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        refuse_relaunch(self.environment)
        if trainer is not None:
            trainer.plugin.full_checkpoint_unavailable = None
        os.environ["MASTER_ADDR"] = self.environment.main_address
        os.environ["MASTER_PORT"] = str(self.environment.main_port)
        with tempfile.TemporaryDirectory(prefix="trainer-core-spawn-") as folder:
            from trainer_core.checkpoint.rng import collect_rng_states

            # Every rank starts from this process's random state (seeded by seed_everything), as
            # forked ranks would: a spawned interpreter would otherwise start from torch's default.
            rng_states = collect_rng_states()
            context = torch.multiprocessing.start_processes(
                _spawned_rank,
                args=(self.num_processes, trainer, function, args, kwargs, folder, rng_states, os.getpid()),
                nprocs=self.num_processes,
                start_method=self.start_method,
                join=False,
            )
            # join raises (with the rank's traceback) if any rank fails, and ends the others.
            with _forward_preemption_signals([process.pid for process in context.processes]):
                while not context.join():
                    pass
            # Written moments ago by our own rank 0 in a private folder: trusted, so a full unpickle
            # is fine (predictions may hold any object the user's predict_step returned).
            outcome = torch.load(os.path.join(folder, _OUTCOME_FILE), weights_only=False)
            if trainer is not None:
                _adopt_rank_zero_state(trainer, outcome)
                trainer.plugin.full_checkpoint_unavailable = (
                    "the ranks that ddp_spawn started have ended, and this process holds rank 0's weights but not the "
                    "optimizer, scheduler, loop and RNG states a resumed run needs. Save during fit (ModelCheckpoint, "
                    "or save_checkpoint in a callback), pass weights_only=True, or use plugins='ddp'"
                )
        return outcome["result"]


def _spawned_rank(
    local_rank: int,
    num_processes: int,
    trainer: Any,
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    folder: str,
    rng_states: dict[str, Any],
    launcher_pid: int,
) -> None:
    from trainer_core.checkpoint.rng import apply_rng_states

    os.environ[LAUNCHED_VARIABLE] = str(launcher_pid)
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["WORLD_SIZE"] = str(num_processes)
    apply_rng_states(rng_states)
    if trainer is not None and trainer.lightning_module is not None:
        # torch.multiprocessing hands CPU tensors to the children in shared memory: without a
        # private copy every rank would step the very same parameters.
        trainer.lightning_module._apply(lambda t: t.clone())
    try:
        result = function(*args, **kwargs)
    except BaseException:
        traceback.print_exc()
        raise
    if local_rank != 0:
        return
    outcome: dict[str, Any] = {"result": result, "weights": None}
    if trainer is not None and trainer.lightning_module is not None:
        outcome["weights"] = {k: v.cpu() for k, v in trainer.lightning_module.state_dict().items()}
        outcome["callback_metrics"] = {
            k: v.cpu() if hasattr(v, "cpu") else v for k, v in trainer.callback_metrics.items()
        }
        outcome["global_step"] = trainer.global_step
        outcome["preempted"] = trainer.preempted
        outcome["current_epoch"] = trainer.current_epoch
        outcome["callbacks"] = [cb.state_dict() for cb in trainer.callbacks]
    torch.save(outcome, os.path.join(folder, _OUTCOME_FILE))


def _adopt_rank_zero_state(trainer: Any, outcome: dict[str, Any]) -> None:
    """Put rank 0's trained weights and counters into the caller's trainer and module."""
    # The ranks saved and stopped on a pre-emption signal: the caller's fit ends the job the same way.
    trainer.preempted = outcome.get("preempted", False)
    if outcome.get("weights") is None or trainer.lightning_module is None:
        return
    trainer.lightning_module.load_state_dict(outcome["weights"])
    trainer.callback_metrics.update(outcome.get("callback_metrics", {}))
    progress = trainer.progress
    progress.global_step = outcome.get("global_step", progress.global_step)
    progress.current_epoch = outcome.get("current_epoch", progress.current_epoch)
    for cb, cb_state in zip(trainer.callbacks, outcome.get("callbacks", [])):
        if cb_state:
            cb.load_state_dict(cb_state)


@contextlib.contextmanager
def _forward_preemption_signals(pids: list[int]) -> Iterator[None]:
    """While the spawned ranks run, pass SIGTERM/SIGUSR1 sent to this process on to them.

    A scheduler that pre-empts the job may signal only the process it started; the ranks then save
    a checkpoint together and stop, and this process ends the job as they do.
    """
    from trainer_core.signals import PREEMPTION_SIGNALS

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {signum: signal.signal(signum, forward) for signum in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
