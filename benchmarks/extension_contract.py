"""The extension contract beside Lightning 2.6.6: what each natural mistake does, and what each extension costs.

Two tables, for the closing note of issue 30:

**Mistakes.** Each natural mistake a user makes while extending the Trainer (a class where an instance
belongs, a missing member, a misspelt argument, a forgotten ``super().__init__()``, a duplicate, a
setting that is silently dropped) is one tiny program, written once and generated for each framework
with only its imports and class names changed (``DDPStrategy`` / ``DDPPlugin``, ...; the few places
where the two APIs differ in shape are spelled out per framework below). Each program runs in a fresh
interpreter, in a session of its own, with a timeout. Every process it starts (the framework's
launcher re-running the script) appends JSON lines to one events file: that it started (so processes
are counted), each phase it reaches (``plugin build``, ``Trainer(...)``, ``fit``, the module's
``on_fit_start``), each training step, the uncaught exception that ended it, and what the program
checked afterwards. The table says, per framework: the first error (type and first line of the
message) and when it came (where the object is built, at ``Trainer(...)``, at fit start, after N
steps), or that nothing was said (and what the check found), a hang (no exit within ``--timeout``), or
a process storm (more than ``--max-processes`` processes started: the run is killed, its whole session
and every process that reported itself).

**Lines a user writes.** For each extension point (a DDP plugin with a communication hook, a
``CheckpointIO``, a ``ClusterEnvironment``, a ``Precision``, a stateful ``Callback``, a ``Logger``, a
``Profiler``, a registered name chosen from the CLI's YAML) ``benchmarks/extension_examples/`` holds a
minimal, runnable program per framework (``lightning/<point>.py``, ``trainer_core/<point>.py``), each
ending in asserts on its result. The lines between ``# extension: begin`` and ``# extension: end`` are
the extension itself (the classes and the object handed to the Trainer); the rest (a tiny module, data,
the asserts) is the same on both sides. Counted: non-blank lines that are not comments, of the extension
and of the whole file; each program is run and passes or fails.

    .venv/bin/python benchmarks/extension_contract.py                 # both tables (5 minutes on 2 cores, + a hang's --timeout)
    .venv/bin/python benchmarks/extension_contract.py --only 1,13 --skip-examples
    .venv/bin/python benchmarks/extension_contract.py --show 8 --framework trainer_core   # print one program
    .venv/bin/python benchmarks/extension_contract.py --before 6fe1854 --skip-examples   # also trainer-core before issue 30

The report goes to ``bench_results/extension_contract.md`` (``--out``) and the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

EXAMPLES_DIR = Path(__file__).resolve().parent / "extension_examples"
FRAMEWORKS = ("lightning", "trainer_core")
TITLES = {"lightning": "Lightning 2.6.6", "trainer_core": "trainer-core"}

# ----------------------------------------------------------------------------- the mistake programs
#
# A program is PRELUDE + the framework's imports + MODULE + the mistake's body, with $names filled in
# from NAMES. The prelude uses the standard library only, so a failing framework import is reported too.

PRELUDE = """\
import json, os, sys, threading, time

_EVENTS = os.environ["EXT_EVENTS"]


def _event(kind, detail=""):
    with open(_EVENTS, "a") as f:
        f.write(json.dumps([os.getpid(), time.time(), kind, detail]) + "\\n")


def phase(name):
    _event("phase", name)


def result(text):
    _event("result", text)


def _first_line(err):
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _record_error(err_type, err, tb):
    root = err  # the error that started it, when this one was raised while handling another
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    _event("error", [err_type.__name__, _first_line(err), type(root).__name__, _first_line(root)])
    sys.__excepthook__(err_type, err, tb)


_event("start")
sys.excepthook = _record_error
threading.excepthook = lambda args: _record_error(args.exc_type, args.exc_value, args.exc_traceback)
phase("import")
"""

MODULE = '''
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self, zero=False):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.zero = zero

    def on_fit_start(self):
        phase("fit start")

    def training_step(self, batch, batch_idx):
        _event("step")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


QUIET = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def has_key(obj, key):
    if isinstance(obj, dict):
        return key in obj or any(has_key(v, key) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_key(v, key) for v in obj)
    return False


def file_holds(path, key):
    """Whether the checkpoint at ``path`` (a file, or a folder of files) holds a dict key ``key``."""
    files = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names] if os.path.isdir(path) else [path]
    for name in files:
        try:
            if has_key(torch.load(name, map_location="cpu", weights_only=False), key):
                return True
        except Exception:
            with open(name, "rb") as f:
                if key.encode() in f.read():
                    return True
    return False
'''

NAMES = {
    "lightning": {
        "imports": (
            "import pytorch_lightning as L\n"
            "from pytorch_lightning.callbacks import Callback\n"
            "from pytorch_lightning.loggers import CSVLogger\n"
            "from pytorch_lightning.plugins import AsyncCheckpointIO, TorchCheckpointIO\n"
            "from pytorch_lightning.plugins.environments import ClusterEnvironment\n"
            "from pytorch_lightning.plugins.precision import Precision\n"
            "from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry\n"
        ),
        "DDP": "DDPStrategy",
        "Single": "SingleDeviceStrategy",
    },
    "trainer_core": {
        "imports": (
            "import trainer_core as L\n"
            "from trainer_core.callbacks import Callback\n"
            "from trainer_core.loggers import CSVLogger\n"
            "from trainer_core.plugins import AsyncCheckpointIO, TorchCheckpointIO\n"
            "from trainer_core.plugins import ClusterEnvironment\n"
            "from trainer_core.precision import Precision\n"
            "from trainer_core.plugins import DDPPlugin, SingleDevicePlugin, plugin_from_name, register_plugin\n"
        ),
        "DDP": "DDPPlugin",
        "Single": "SingleDevicePlugin",
    },
}


# Mistakes 3 and 14. Lightning has no sharded strategy on CPU: DDP with ZeroRedundancyOptimizer is its way.
SHARDED_FIELD = {
    "lightning": """
    class MyStrategy(DDPStrategy):
        def optimizer_state(self, optimizer):
            state = super().optimizer_state(optimizer)
            $add_field
            return state


    phase("plugin build")
    strategy = MyStrategy()
    phase("Trainer(...)")
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=2, **QUIET)
    phase("fit")
    trainer.fit(Tiny(zero=True))
    phase("after fit")
    trainer.save_checkpoint("extra.ckpt")
    if trainer.global_rank == 0:
        result(f"field in the file: {file_holds('extra.ckpt', 'user_extra_field')}")
    """,
    "trainer_core": """
    from trainer_core.plugins import ZeroPlugin


    class MyStrategy(ZeroPlugin):
        def optimizer_state(self, optimizer):
            state = super().optimizer_state(optimizer)
            $add_field
            return state


    phase("plugin build")
    strategy = MyStrategy()
    phase("Trainer(...)")
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=2, **QUIET)
    phase("fit")
    trainer.fit(Tiny())
    phase("after fit")
    trainer.save_checkpoint("extra.ckpt")
    if trainer.global_rank == 0:
        result(f"field in the file: {file_holds('extra.ckpt', 'user_extra_field')}")
    """,
}


@dataclass(frozen=True)
class Mistake:
    number: int
    title: str
    body: str  # the same for both frameworks, or ...
    per_framework: dict[str, str] = field(default_factory=dict)  # ... spelled out where the APIs differ
    names: dict[str, str] = field(default_factory=dict)  # more $names of this body

    def source(self, framework: str) -> str:
        body = self.per_framework.get(framework, self.body)
        text = PRELUDE + NAMES[framework]["imports"] + MODULE + "\n" + textwrap.dedent(body)
        return string.Template(text).substitute({**NAMES[framework], **self.names})


MISTAKES = [
    Mistake(
        1,
        "`ClusterEnvironment` subclass without `creates_processes_externally`, `devices=2`",
        """
        class MyEnv(ClusterEnvironment):
            @property
            def main_address(self):
                return "127.0.0.1"

            @property
            def main_port(self):
                return int(os.environ["MASTER_PORT"])

            @staticmethod
            def detect():
                return True

            def world_size(self):
                return int(os.environ.get("MY_WORLD", "2"))

            def set_world_size(self, size):
                pass

            def global_rank(self):
                return int(os.environ.get("MY_RANK", "0"))

            def set_global_rank(self, rank):
                pass

            def local_rank(self):
                return self.global_rank()

            def node_rank(self):
                return 0


        phase("plugin build")
        strategy = $DDP(cluster_environment=MyEnv())
        phase("Trainer(...)")
        trainer = L.Trainer(strategy=strategy, devices=2, max_steps=2, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        """,
    ),
    Mistake(
        2,
        "two instances of one stateful callback, default `state_key`",
        """
        class Counter(Callback):
            def __init__(self, increment):
                self.increment, self.count = increment, 0

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.count += self.increment

            def state_dict(self):
                return {"count": self.count}

            def load_state_dict(self, state_dict):
                self.count = state_dict["count"]


        phase("Trainer(...)")
        trainer = L.Trainer(callbacks=[Counter(1), Counter(10)], max_steps=2, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        trainer.save_checkpoint("two.ckpt")
        phase("resumed fit")
        resumed = [Counter(1), Counter(10)]
        L.Trainer(callbacks=resumed, max_steps=2, **QUIET).fit(Tiny(), ckpt_path="two.ckpt")
        result(f"resumed counts {[c.count for c in resumed]} (saved [2, 20])")
        """,
    ),
    Mistake(
        3,
        "sharded plugin subclass whose `optimizer_state` adds a field (2 ranks): in the file?",
        "",
        per_framework=SHARDED_FIELD,
        names={"add_field": 'state["user_extra_field"] = 42'},
    ),
    Mistake(
        4,
        "`checkpoint_io=TorchCheckpointIO` (the class) on a single-device plugin",
        """
        phase("plugin build")
        strategy = $Single(device="cpu", checkpoint_io=TorchCheckpointIO)
        phase("Trainer(...)")
        trainer = L.Trainer(
            strategy=strategy, max_epochs=2, limit_train_batches=4, **dict(QUIET, enable_checkpointing=True)
        )
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        """,
    ),
    Mistake(
        5,
        "`plugins=[plugin, TorchCheckpointIO]` (a class in the list)",
        "",
        per_framework={
            # Lightning's plugins=[...] takes no strategy: the strategy goes to strategy=.
            "lightning": """
            phase("Trainer(...)")
            trainer = L.Trainer(
                strategy=SingleDeviceStrategy(device="cpu"),
                plugins=[TorchCheckpointIO],
                max_epochs=2,
                limit_train_batches=4,
                **dict(QUIET, enable_checkpointing=True),
            )
            phase("fit")
            trainer.fit(Tiny())
            phase("after fit")
            """,
            "trainer_core": """
            phase("Trainer(...)")
            trainer = L.Trainer(
                plugins=[SingleDevicePlugin(), TorchCheckpointIO],
                max_epochs=2,
                limit_train_batches=4,
                **dict(QUIET, enable_checkpointing=True),
            )
            phase("fit")
            trainer.fit(Tiny())
            phase("after fit")
            """,
        },
    ),
    Mistake(
        6,
        'registering an existing name (`"ddp"`) without `override=True`',
        "",
        per_framework={
            "lightning": """
            class MyDDP(DDPStrategy):
                pass


            phase("register")
            StrategyRegistry.register("ddp", MyDDP)
            phase("after register")
            result(f'"ddp" now builds {type(StrategyRegistry.get("ddp")).__name__}')
            """,
            "trainer_core": """
            class MyDDP(DDPPlugin):
                pass


            phase("register")
            register_plugin("ddp", MyDDP)
            phase("after register")
            result(f'"ddp" now builds {type(plugin_from_name("ddp")).__name__}')
            """,
        },
    ),
    Mistake(
        7,
        "misspelt argument: `DDP(find_unused_paramters=True)`, `devices=2`",
        """
        phase("plugin build")
        strategy = $DDP(find_unused_paramters=True)
        phase("Trainer(...)")
        trainer = L.Trainer(strategy=strategy, devices=2, max_steps=2, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        """,
    ),
    Mistake(
        8,
        "DDP subclass whose `__init__` forgets `super().__init__()`, `devices=2`",
        """
        class MyDDP($DDP):
            def __init__(self, note):
                self.note = note


        phase("plugin build")
        strategy = MyDDP("mine")
        phase("Trainer(...)")
        trainer = L.Trainer(strategy=strategy, devices=2, max_steps=2, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        """,
    ),
    Mistake(
        9,
        "`callbacks=[MyCallback]` (the class)",
        """
        class MyCallback(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                pass


        phase("Trainer(...)")
        trainer = L.Trainer(callbacks=[MyCallback], max_steps=2, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        """,
    ),
    Mistake(
        10,
        "`logger=CSVLogger` (the class)",
        """
        phase("Trainer(...)")
        trainer = L.Trainer(max_steps=2, **dict(QUIET, logger=CSVLogger))
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        """,
    ),
    Mistake(
        11,
        "two `CheckpointIO` in `plugins=[TorchCheckpointIO(), AsyncCheckpointIO()]`",
        """
        phase("Trainer(...)")
        trainer = L.Trainer(
            plugins=[TorchCheckpointIO(), AsyncCheckpointIO()],
            max_epochs=1,
            limit_train_batches=4,
            **dict(QUIET, enable_checkpointing=True),
        )
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        result(f"checkpoint IO in use: {type(trainer.strategy.checkpoint_io).__name__}")
        """,
    ),
    Mistake(
        12,
        '`plugins=[Precision()]` together with `precision="bf16-mixed"`',
        """
        phase("Trainer(...)")
        trainer = L.Trainer(plugins=[Precision()], precision="bf16-mixed", max_steps=2, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        result(f"precision in use: {trainer.precision}")
        """,
    ),
    Mistake(
        13,
        "DDP communication hook on CPU/gloo, 2 ranks, 24 steps: hook calls",
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook_calls = 0


        def counting_allreduce(state, bucket):
            global hook_calls
            hook_calls += 1
            return default_hooks.allreduce_hook(state, bucket)


        phase("plugin build")
        strategy = $DDP(ddp_comm_hook=counting_allreduce)
        phase("Trainer(...)")
        trainer = L.Trainer(strategy=strategy, devices=2, max_steps=24, **QUIET)
        phase("fit")
        trainer.fit(Tiny())
        phase("after fit")
        result(f"rank {trainer.global_rank}: {hook_calls} hook calls")
        """,
    ),
    Mistake(
        14,
        "as 3, with the field added only to a non-empty state (rank 0 alone holds the consolidated state)",
        "",
        per_framework=SHARDED_FIELD,
        names={"add_field": 'if state:  state["user_extra_field"] = 42'},
    ),
]

# ----------------------------------------------------------------------------- running one program


@dataclass
class Outcome:
    """What one program did: its processes' events, how it ended, and a one-line summary."""

    status: str  # "error", "silent", "hang", "storm", "exit <code>"
    summary: str
    processes: int
    seconds: float
    details: list[str] = field(default_factory=list)


# A phase's words in the table: where the first error surfaced.
WHERE = {
    "import": "at import",
    "register": "at `register`",
    "plugin build": "where the plugin is built",
    "Trainer(...)": "at `Trainer(...)`",
    "fit": "in `fit()`, before `on_fit_start`",
    "fit start": "at fit start (before the first step)",
    "after fit": "after `fit()`",
    "resumed fit": "at the resumed `fit()`",
    "after register": "after `register`",
}


def run_program(source: str, *, timeout: float, max_processes: int, extra_env: dict[str, str]) -> Outcome:
    """Run ``source`` as a script in a session of its own; kill it whole on a hang or a process storm."""
    with tempfile.TemporaryDirectory(prefix="ext-contract-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(source)
        events_path = Path(tmp) / "events.jsonl"
        events_path.touch()
        env = {k: v for k, v in common.worker_env().items() if not _launch_variable(k)}
        env.update(
            EXT_EVENTS=str(events_path),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(common.free_port()),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra_env)
        log_path = Path(tmp) / "output.txt"
        start = time.monotonic()
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            ended = _watch(proc, events_path, timeout, max_processes)
            still_running = _kill_everything(proc, events_path, script)
        seconds = time.monotonic() - start
        events = _read_events(events_path)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-6:]
    return _classify(events, ended, proc.returncode, seconds, still_running, timeout, max_processes, tail)


def _launch_variable(name: str) -> bool:
    """Variables that would tell a program it is one rank of a job already running."""
    return name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK") or (
        name.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "TRAINER_CORE_", "MASTER_"))
    )


def _watch(proc: subprocess.Popen, events_path: Path, timeout: float, max_processes: int) -> str:
    """``"exit"``, ``"hang"`` or ``"storm"``: how the run ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=0.2)
            return "exit"
        except subprocess.TimeoutExpired:
            pass
        if _count_started(events_path) > max_processes:
            return "storm"
        if time.monotonic() > deadline:
            return "hang"


def _count_started(events_path: Path) -> int:
    return sum(1 for event in _read_events(events_path) if event[2] == "start")


def _kill_everything(proc: subprocess.Popen, events_path: Path, script: Path) -> int:
    """End the program's session and every process of this script; how many were still running."""
    import psutil

    pids = {event[0] for event in _read_events(events_path)}
    alive = sum(1 for pid in pids if _is_ours(pid, script))
    for _ in range(3):  # a process may start while the others are being ended
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        pids |= {event[0] for event in _read_events(events_path)}
        for pid in pids:
            try:
                p = psutil.Process(pid)
                family = [p, *p.children(recursive=True)]  # started, not yet reporting
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            for member in family:
                try:
                    if str(script) in " ".join(member.cmdline()):  # ours: the pid was not reused
                        member.kill()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
        time.sleep(0.1)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return alive


def _is_ours(pid: int, script: Path) -> bool:
    """Whether ``pid`` is alive (not a zombie) and runs ``script``."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and str(script) in " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _read_events(events_path: Path) -> list[list[Any]]:
    events = []
    for line in events_path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written as we read
            continue
    return events


def _classify(
    events: list[list[Any]],
    ended: str,
    returncode: Optional[int],
    seconds: float,
    still_running: int,
    timeout: float,
    max_processes: int,
    tail: list[str],
) -> Outcome:
    pids = list(dict.fromkeys(e[0] for e in events if e[2] == "start"))
    processes = len(pids)
    rank_of = {pid: i for i, pid in enumerate(pids)}
    results = [f"{e[3]}" for e in events if e[2] == "result"]
    errors = [e for e in events if e[2] == "error"]
    details = [
        f"process {rank_of.get(e[0], '?')}: {_error_text(e, 300)} ({_where(events, e)})" for e in errors
    ]
    details += [f"check: {r}" for r in results]
    if ended == "storm":
        summary = (
            f"**process storm**: {processes} processes started in {seconds:.0f} s "
            f"({still_running} still running when killed at {max_processes})"
        )
        return Outcome("storm", summary, processes, seconds, details)
    if ended == "hang":
        where = _where(events, None)
        summary = f"**hang**: no exit in {timeout:.0f} s ({where}); " + (
            f"{errors[0][3][0]} on a rank" if errors else "no error"
        )
        return Outcome("hang", summary, processes, seconds, details)
    if errors:
        first = errors[0]
        summary = f"{_error_text(first, 170)} — {_where(events, first)}"
        return Outcome("error", summary, processes, seconds, details)
    if returncode != 0:
        summary = f"exit status {returncode}, no Python error ({_where(events, None)}): {_clip(' / '.join(tail[-2:]))}"
        return Outcome(f"exit {returncode}", summary, processes, seconds, details + tail)
    summary = "no error" + (f"; {'; '.join(results)}" if results else "")
    return Outcome("silent", summary, processes, seconds, details)


def _error_text(error: list[Any], limit: int) -> str:
    """The error a user sees, and the one it was raised while handling when they differ."""
    err_type, message, root_type, root_message = error[3]
    text = f"`{err_type}`: {_clip(message, limit)}"
    if (root_type, root_message) != (err_type, message):
        text += f" (raised while handling `{root_type}`: {_clip(root_message, limit)})"
    return text


def _where(events: list[list[Any]], error: Optional[list[Any]]) -> str:
    """The phase the erring process (or, for None, the furthest process) was in, with its steps."""
    if error is not None:
        mine = [e for e in events if e[0] == error[0] and e[1] <= error[1]]
    else:
        mine = events
    phase = next((e[3] for e in reversed(mine) if e[2] == "phase"), "import")
    steps = sum(1 for e in mine if e[2] == "step")
    if error is None and steps:
        steps = max(
            sum(1 for e in events if e[0] == pid and e[2] == "step") for pid in {e[0] for e in events}
        )
    if steps and phase in ("fit", "fit start", "resumed fit"):
        return f"after {steps} steps"
    return WHERE.get(phase, phase)


def _clip(text: str, limit: int = 170) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- the examples


POINTS = {
    "ddp_comm_hook": "DDP plugin with a communication hook (2 ranks)",
    "checkpoint_io": "`CheckpointIO` (gzip + sha256; top-k, last, resume)",
    "cluster_environment": "`ClusterEnvironment` (MY_RANK/MY_WORLD; 2 ranks)",
    "precision": "`Precision` (a constant loss scale)",
    "stateful_callback": "stateful `Callback` (two instances)",
    "logger": "`Logger`",
    "profiler": "`Profiler`",
    "registry_cli": "registered name chosen from the CLI's YAML",
}
BEGIN, END = "# extension: begin", "# extension: end"


def code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def extension_lines(path: Path) -> tuple[int, int]:
    """(lines of the extension between the markers, lines of the whole program)."""
    text = path.read_text()
    inside = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return code_lines(inside), code_lines(text)


def run_example(path: Path, timeout: float) -> tuple[bool, str, float]:
    """Run one example in a fresh folder and session: (passed, its last error line, seconds)."""
    with tempfile.TemporaryDirectory(prefix="ext-example-") as tmp:
        env = {k: v for k, v in common.worker_env().items() if not _launch_variable(k)}
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(common.free_port())
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, str(path)],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            output = b""
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        seconds = time.monotonic() - start
    if proc.returncode == 0:
        return True, "", seconds
    if not output:
        return False, f"no exit in {timeout:.0f} s", seconds
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    return False, _clip(lines[-1] if lines else f"exit status {proc.returncode}"), seconds


# ----------------------------------------------------------------------------- the report

# What differs between the two sides of a row of the lines table, beyond the count.
NOTES = {
    "ddp_comm_hook": "Lightning registers `DDPStrategy(ddp_comm_hook=...)` only on CUDA (0 calls on CPU, "
    "mistake 13): the hook goes on the wrapper in a `configure_ddp` override; here the argument works as is",
    "checkpoint_io": "the same three methods (Lightning's `load_checkpoint` also takes `weights_only`)",
    "cluster_environment": "Lightning: 10 abstract members (`main_address`, `main_port`, `set_world_size`, "
    "`set_global_rank` too); here 6, the others have defaults",
    "precision": "the same `backward` override",
    "stateful_callback": "Lightning's key helper is private (`_generate_state_key`); here `generate_state_key`",
    "logger": "Lightning: `name` and `version` are abstract; here they have defaults",
    "profiler": "the same `start`/`stop`/`summary`",
    "registry_cli": "`StrategyRegistry.register` against `register_plugin`; the same YAML",
}


def title(column: str) -> str:
    framework, _, ref = column.partition("@")
    return TITLES[framework] + (f" at `{ref}`" if ref else "")


def mistakes_table(outcomes: dict[tuple[int, str], Outcome], columns: list[str]) -> str:
    headers = ["#", "mistake"] + [title(c) for c in columns] + ["processes (" + " / ".join(columns) + ")"]
    rows = []
    for m in MISTAKES:
        if not any((m.number, c) in outcomes for c in columns):
            continue
        cells = [_cell(outcomes.get((m.number, c))) for c in columns]
        counts = " / ".join(
            str(outcomes[(m.number, c)].processes) if (m.number, c) in outcomes else "-" for c in columns
        )
        rows.append([str(m.number), m.title, *cells, counts])
    return _markdown(headers, rows)


def _cell(outcome: Optional[Outcome]) -> str:
    if outcome is None:
        return "not run"
    return f"{outcome.summary} ({outcome.seconds:.0f} s)"


def examples_table(examples: dict[tuple[str, str], tuple[bool, str, float]]) -> str:
    headers = ["extension point", "lines here (extension / file)", "lines Lightning (extension / file)"]
    headers += ["both run?", "what differs"]
    rows = []
    for point, point_title in POINTS.items():
        here = extension_lines(EXAMPLES_DIR / "trainer_core" / f"{point}.py")
        theirs = extension_lines(EXAMPLES_DIR / "lightning" / f"{point}.py")
        runs = []
        for framework in ("trainer_core", "lightning"):
            if (point, framework) not in examples:
                runs.append(f"{TITLES[framework]}: not run")
                continue
            passed, error, seconds = examples[(point, framework)]
            runs.append(f"{TITLES[framework]}: {'pass' if passed else 'FAIL ' + error} ({seconds:.0f} s)")
        row = [point_title, f"{here[0]} / {here[1]}", f"{theirs[0]} / {theirs[1]}", "; ".join(runs)]
        rows.append([*row, NOTES[point]])
    return _markdown(headers, rows)


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join(
        [line(headers), "| " + " | ".join("---" for _ in headers) + " |"] + [line(r) for r in rows]
    )


def details_section(outcomes: dict[tuple[int, str], Outcome], columns: list[str]) -> str:
    lines = []
    for m in MISTAKES:
        for c in columns:
            outcome = outcomes.get((m.number, c))
            if outcome is None or not outcome.details:
                continue
            lines.append(f"* {m.number}, {title(c)}:")
            lines += [f"  * {_clip(d, 400)}" for d in outcome.details[:8]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- trainer-core at a git ref


def tree_at(ref: str, into: Path) -> Path:
    """trainer-core's three source folders at ``ref`` (``git archive``; nothing in the checkout changes),
    laid out as the one import package ``setup.py`` maps them to; put the returned folder on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "-C", str(common.REPO_ROOT), "archive", ref, "trainer_core", "plugins", "callbacks"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "trainer_core"
    (into / "plugins").rename(package / "plugins")
    (into / "callbacks").rename(package / "callbacks")
    return into


# ----------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(common.RESULTS_DIR / "extension_contract.md"))
    parser.add_argument("--only", default="", help="mistake numbers, comma-separated (default: all)")
    parser.add_argument("--framework", default=",".join(FRAMEWORKS), help="lightning,trainer_core")
    parser.add_argument(
        "--before",
        default="",
        metavar="REF",
        help="also run the mistakes under trainer-core as of git REF (e.g. HEAD: before uncommitted changes)",
    )
    parser.add_argument(
        "--timeout", type=float, default=150.0, help="seconds before a program counts as hung"
    )
    parser.add_argument(
        "--max-processes", type=int, default=8, help="processes started before a run is a storm"
    )
    parser.add_argument("--jobs", type=int, default=2, help="programs run side by side")
    parser.add_argument("--skip-examples", action="store_true")
    parser.add_argument("--skip-mistakes", action="store_true")
    parser.add_argument("--quick", action="store_true", help="accepted for `make bench`; the run is the same")
    parser.add_argument("--show", type=int, default=0, help="print mistake N's program and exit")
    args = parser.parse_args(argv)
    frameworks = [f for f in args.framework.split(",") if f]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
        parser.error(f"--framework: unknown {unknown}; choose from {', '.join(FRAMEWORKS)}")
    if args.show:
        print(next(m for m in MISTAKES if m.number == args.show).source(frameworks[-1]))
        return
    numbers = {int(n) for n in args.only.split(",") if n.strip()} or {m.number for m in MISTAKES}
    columns = frameworks + ([f"trainer_core@{args.before}"] if args.before else [])

    with tempfile.TemporaryDirectory(prefix="ext-contract-tree-") as tree:
        extra_env = {}
        if args.before:
            extra_env[f"trainer_core@{args.before}"] = {"PYTHONPATH": str(tree_at(args.before, Path(tree)))}
        jobs: list[tuple[str, Any, str]] = []
        if not args.skip_mistakes:
            jobs += [("mistake", m, c) for m in MISTAKES if m.number in numbers for c in columns]
        if not args.skip_examples:
            jobs += [("example", p, f) for p in POINTS for f in frameworks]

        def run(job: tuple[str, Any, str]) -> Any:
            kind, what, column = job
            if kind == "mistake":
                source = what.source(column.partition("@")[0])
                outcome = run_program(
                    source,
                    timeout=args.timeout,
                    max_processes=args.max_processes,
                    extra_env=extra_env.get(column, {}),
                )
                common.log(f"mistake {what.number:2d} {column:12s} {outcome.summary}")
                return outcome
            outcome = run_example(EXAMPLES_DIR / column / f"{what}.py", args.timeout)
            common.log(f"example {what:20s} {column:12s} {'pass' if outcome[0] else 'FAIL ' + outcome[1]}")
            return outcome

        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            done = list(pool.map(run, jobs))
    outcomes = {(job[1].number, job[2]): out for job, out in zip(jobs, done) if job[0] == "mistake"}
    examples = {(job[1], job[2]): out for job, out in zip(jobs, done) if job[0] == "example"}

    versions = common.package_versions(["pytorch_lightning", "torch", "trainer-core"])
    report = [
        "# The extension contract beside Lightning",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `benchmarks/extension_contract.py` "
        f"in {time.monotonic() - start:.0f} s ({args.jobs} programs side by side); versions {versions}; "
        f"machine {common.machine_info()}.",
        "",
    ]
    if outcomes:
        report += [
            "## What each mistake does",
            "",
            "Each cell: the first error a user sees (type, first line of its message; and the error it was "
            "raised while handling, when another) and where it surfaced, or what the program's own check "
            "found when nothing was said; the run's wall time. Processes: how many Python processes the "
            "program started in all (its launcher re-running the script included). Run a program yourself "
            "with `--show N --framework F`.",
            "",
            mistakes_table(outcomes, columns),
            "",
            "Every error and check, by process:",
            "",
            details_section(outcomes, columns),
            "",
        ]
    if examples:
        report += [
            "## Lines a user writes per extension point",
            "",
            "Lines: non-blank, non-comment lines between `# extension: begin` and `# extension: end` (the "
            "classes and the object handed to the Trainer) / of the whole runnable program in "
            "`benchmarks/extension_examples/{trainer_core,lightning}/<point>.py`; each program ends in "
            "asserts on its result.",
            "",
            examples_table(examples),
            "",
        ]
    text = "\n".join(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    common.log(f"wrote {out}")


if __name__ == "__main__":
    main()
