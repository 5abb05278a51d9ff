"""A warm interpreter for the tests' child processes: torch imported once, each child forked from it.

Most of ``make test``'s time went to child processes importing torch (about 2 s of CPU each, and the
suite starts well over a thousand). ``tests/conftest.py`` starts one server per pytest worker and points
``sys.executable`` at a shim (``warm_client.py``); every ``[sys.executable, ...]`` a test, a job script or
our launcher starts then forks from the server instead of importing torch again.

A child is the process a fresh interpreter would have been: ``__main__`` runs the script (or ``-m``
module, or ``-c`` code) with its arguments, environment, working folder, ``sys.path`` (``PYTHONPATH``
included), standard streams and inherited descriptors; it exits with the interpreter's exit code and
shutdown (threads joined, ``atexit``, streams flushed), and its traceback shows the script's frames only.
Only ``torch`` and ``torch._dynamo`` (which building any torch optimizer imports) are preloaded, with what
they load; neither draws from a random generator. A test about what a program imports starts
``REAL_EXECUTABLE``, a truly fresh interpreter. NumPy's global generator is reseeded from the OS as a fresh import would seed it (Python's
``random`` reseeds itself after a fork). Whatever a warm child could not reproduce runs cold: interpreter
options other than ``-c``, ``-m``, ``-u``, ``-B``, a different value of an environment variable read while
torch or the interpreter starts (``PYTHON*`` other than ``PYTHONPATH``/``PYTHONUNBUFFERED``/
``PYTHONDONTWRITEBYTECODE``, ``TORCH_*``, ``MKL``/``OMP`` settings other than the thread count, ...),
and ``WARM_PYTHON=0``.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent

#: Environment variables a child may set to another value than the server had: applied after the fork.
APPLIED_AFTER_FORK = {
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
}
#: Prefixes of the variables read while the interpreter or torch starts: a child that changes one runs cold.
#: (``KMP_*`` and most ``PYTORCH_*`` are read later or not at all by torch's CPU build, so the child reads
#: them itself; libraries the tests import set some of them.)
READ_AT_START = (
    *("PYTHON", "TORCH_", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCHFUNCTORCH", "PYTORCH_JIT"),
    *("OMP_", "MKL_", "GOMP_", "OPENBLAS", "NUMPY", "LD_", "MALLOC"),
)


def _plan(argv: list[str], env: dict[str, str], cwd: str) -> Optional[dict[str, Any]]:
    """What the child runs (``kind``: script, module or code), or None where only a cold start is faithful."""
    for name in set(env) | set(os.environ):
        if name in SET_BY_PRELOAD and env.get(name) in (None, SET_BY_PRELOAD[name]):
            continue  # the child gets the preload's value, as its own import would have set it
        if name.startswith(READ_AT_START) and env.get(name) != os.environ.get(name):
            if name not in APPLIED_AFTER_FORK or name not in env:
                return None  # read before the fork, or a thread count the server's default cannot give back
    if env.get("WARM_PYTHON") == "0":
        return None
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    no_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "-u":
            unbuffered = True
        elif arg == "-B":
            no_bytecode = True
        elif arg in ("-c", "-m"):
            if index + 1 >= len(argv):
                return None
            kind = "code" if arg == "-c" else "module"
            return {
                "kind": kind,
                "target": argv[index + 1],
                "argv": [arg if kind == "code" else "-m", *argv[index + 2 :]],
                "unbuffered": unbuffered,
                "no_bytecode": no_bytecode,
            }
        elif arg.startswith("-"):
            return None  # -X, -W, -I, -O, -S, -E, stdin, combined flags: the interpreter's own handling
        else:
            if not os.path.isfile(os.path.join(cwd, arg)):
                return None  # a folder or zip with __main__, or a missing file: the interpreter's message
            return {
                "kind": "script",
                "target": arg,
                "argv": argv[index:],
                "unbuffered": unbuffered,
                "no_bytecode": no_bytecode,
            }
        index += 1
    return None  # an interactive interpreter


class Server:
    """Accepts requests from shims on a Unix socket, forks a child for each, reports each child's end."""

    def __init__(self, socket_path: str, shim: str) -> None:
        self.shim = shim
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(socket_path)
        self.listener.listen(64)
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_write)
        self.parent = os.getppid()
        #: connection -> (child pid, whether to kill the child's process group when the shim dies)
        self.children: dict[socket.socket, tuple[int, bool]] = {}

    def serve(self) -> Optional[dict[str, Any]]:
        """Serve until the pytest worker ends; in a forked child, return what that child must run."""
        while os.getppid() == self.parent:
            readable, _, _ = select.select([self.listener, self.wake_read, *self.children], [], [], 1.0)
            for ready in readable:
                if ready is self.listener:
                    job = self._accept()
                    if job is not None:
                        return job
                elif ready == self.wake_read:
                    os.read(self.wake_read, 4096)
                else:
                    self._shim_gone(ready)
            self._reap()
        return None

    def _accept(self) -> Optional[dict[str, Any]]:
        conn, _ = self.listener.accept()
        fd_size = socket.CMSG_SPACE(256 * array.array("i").itemsize)
        try:
            data, ancillary, _, _ = conn.recvmsg(1 << 20, fd_size)
        except OSError:
            conn.close()
            return None
        received = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
        request = json.loads(data)
        plan = _plan(request["argv"], request["env"], request["cwd"])
        _note(plan is not None, request["argv"])
        if plan is None:
            for fd in received:
                os.close(fd)
            conn.send(b'{"cold": true}')
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            return {**request, **plan, "received": list(received), "server": self}
        for fd in received:
            os.close(fd)
        self.children[conn] = (pid, request["group_leader"])
        conn.send(json.dumps({"pid": pid}).encode())
        return None

    def _shim_gone(self, conn: socket.socket) -> None:
        """The shim was killed: kill what it stood for (and, for a session leader, the child's group)."""
        pid, group = self.children.pop(conn)
        conn.close()
        try:
            os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        by_pid = {pid: conn for conn, (pid, _) in self.children.items()}
        while by_pid:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = by_pid.pop(pid, None)
            if conn is None:
                continue
            del self.children[conn]
            if os.WIFSIGNALED(status):
                reply = {"signal": os.WTERMSIG(status)}
            else:
                reply = {"exit": os.waitstatus_to_exitcode(status)}
            try:
                conn.send(json.dumps(reply).encode())
            except OSError:
                pass
            conn.close()

    def close_in_child(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.wake_read)
        os.close(self.wake_write)
        self.listener.close()
        for conn in self.children:
            conn.close()


def _note(warm: bool, argv: list[str]) -> None:
    """With ``WARM_PYTHON_LOG=file``, one line per start (``warm``/``cold`` and the arguments): how many ran warm."""
    log = os.environ.get("WARM_PYTHON_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{'warm' if warm else 'cold'} {' '.join(argv)[:200]!r}\n")


def _arrange_descriptors(received: list[int], targets: list[int]) -> None:
    """Give the child the shim's descriptors under the shim's numbers, and nothing of the server's."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in received]
    for fd in received:
        os.close(fd)
    os.closerange(3, 1024)
    for source, target in zip(high, targets):
        os.dup2(source, target)
    for fd in high:
        os.close(fd)
    for fd in range(3):
        if fd not in targets:
            os.close(fd)


def _standard_streams(unbuffered: bool) -> None:
    import io

    def stream(fd: int, mode: str, errors: str, line: bool) -> Optional[io.TextIOWrapper]:
        try:
            os.fstat(fd)
        except OSError:
            return None
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        buffered = (
            raw
            if unbuffered and mode == "wb"
            else (io.BufferedReader if mode == "rb" else io.BufferedWriter)(raw)
        )
        return io.TextIOWrapper(
            buffered,
            encoding=sys.stdout.encoding or "utf-8",
            errors=errors,
            line_buffering=line or tty,
            write_through=unbuffered,
        )

    sys.stdin = sys.__stdin__ = stream(0, "rb", "strict", False)
    sys.stdout = sys.__stdout__ = stream(1, "wb", "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "wb", "backslashreplace", True)


def _become(job: dict[str, Any]) -> None:
    """Turn this forked child into the fresh interpreter the shim's caller asked for."""
    job["server"].close_in_child()
    if job["group_leader"]:
        os.setsid()
    else:
        os.setpgid(0, 0)
    for number in job["ignored"]:
        signal.signal(number, signal.SIG_IGN)
    _arrange_descriptors(job["received"], job["fds"])
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    for name, value in SET_BY_PRELOAD.items():
        os.environ.setdefault(name, value)
    _standard_streams(job["unbuffered"])
    sys.dont_write_bytecode = job["no_bytecode"]
    sys.argv = list(job["argv"])
    if job["kind"] == "script":
        first = os.path.dirname(os.path.realpath(job["target"]))
    else:
        first = os.getcwd() if job["kind"] == "module" else ""
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *BASE_PATH]
    sys.executable = job["server"].shim
    import multiprocessing.spawn

    multiprocessing.spawn.set_executable(sys.executable)
    threads = job["env"].get("OMP_NUM_THREADS") or job["env"].get("MKL_NUM_THREADS") or ""
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _trimmed(tb: Any) -> Any:
    """The traceback from the program's first frame on, as a fresh interpreter prints it."""
    import runpy

    ours = {os.path.realpath(__file__), runpy.__file__, "<frozen runpy>"}
    start = tb
    while tb is not None:
        if (
            os.path.realpath(tb.tb_frame.f_code.co_filename) not in ours
            and tb.tb_frame.f_code.co_filename not in ours
        ):
            return tb
        tb = tb.tb_next
    return start


def _run(job: dict[str, Any]) -> int:
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        if job["kind"] == "script":
            _run_script(main, os.path.abspath(job["target"]))
        elif job["kind"] == "module":
            runpy._run_module_as_main(job["target"], alter_argv=True)  # what ``python -m`` calls
        else:
            exec(compile(job["target"], "<string>", "exec"), main.__dict__)
    except SystemExit as stop:
        return _exit_code(stop.code)
    except KeyboardInterrupt as interrupted:
        interrupted.__traceback__ = _trimmed(interrupted.__traceback__)  # the hook prints the exception's own
        sys.excepthook(type(interrupted), interrupted, interrupted.__traceback__)
        _die_by_sigint_at_exit()
        return 130
    except BaseException as error:
        error.__traceback__ = _trimmed(error.__traceback__)
        sys.excepthook(type(error), error, error.__traceback__)
        return 1
    return 0


def _run_script(main: Any, path: str) -> None:
    """What ``python path`` does: ``sys.argv[0]`` as given, ``__file__`` absolute, the source's own loader."""
    from importlib.machinery import SourceFileLoader

    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
    main.__dict__.update(__package__=None, __spec__=None)
    exec(code, main.__dict__)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _die_by_sigint_at_exit() -> None:
    import atexit

    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)

    atexit.register(die)


#: What importing torch and torch._dynamo put in the environment (``TORCHINDUCTOR_CACHE_DIR``).
SET_BY_PRELOAD: dict[str, str] = {}
#: ``sys.path`` after the interpreter's own start, without the first entry and ``PYTHONPATH``.
BASE_PATH: list[str] = []


def _serve_forever(socket_path: str, shim: str) -> None:
    global BASE_PATH
    before = dict(os.environ)
    import torch
    import torch._dynamo  # noqa: F401 - building any torch optimizer imports it: about as long as torch again

    SET_BY_PRELOAD.update({k: v for k, v in os.environ.items() if before.get(k) != v})

    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    BASE_PATH = [p for p in sys.path[1:] if p not in own]
    server = Server(socket_path, shim)
    Path(socket_path + ".ready").touch()
    job = server.serve()
    if job is None:
        return
    _become(job)
    del job["server"]
    sys.exit(_run(job))


#: The interpreter the tests were started with, for a test that needs a truly fresh one or a file beside it.
REAL_EXECUTABLE = sys.executable


def start(folder: Path) -> Any:
    """Start a server for this process; returns a function that waits for it and gives the shim's path."""
    import subprocess

    real = REAL_EXECUTABLE
    socket_path = str(folder / "warm.sock")
    shim = folder / "python"
    shim.write_text(
        f"#!{real} -S\n"
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import warm_client\n"
        f"warm_client.main({socket_path!r}, {real!r})\n"
    )
    shim.chmod(0o755)
    server = subprocess.Popen(
        [real, __file__, socket_path, str(shim)], stdin=subprocess.DEVNULL, start_new_session=True
    )

    def ready(timeout: float = 120) -> Optional[str]:
        deadline = time.monotonic() + timeout
        while not os.path.exists(socket_path + ".ready"):
            if server.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return str(shim)

    ready.server = server  # type: ignore[attr-defined]
    return ready


if __name__ == "__main__":
    _serve_forever(sys.argv[1], sys.argv[2])
