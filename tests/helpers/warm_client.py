"""The client side of the warm interpreter (``warm_python.py``): what runs when a test starts ``sys.executable``.

It stands in for the process the caller started. It hands its arguments, environment, working folder
and open file descriptors to the server, which forks a child from an interpreter that has already
imported torch. From then on it relays: signals it receives go to the child, and it exits as the child
did (the same code, or killed by the same signal). If it is killed itself, the server kills the child.
Anything the server cannot run as a fresh interpreter would (``reply["cold"]``) runs cold: this process
becomes the real interpreter with the same arguments.

Only the standard library's smallest modules load here (the shim runs with ``python -S``): it starts in
about 20 ms.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

#: The signals a parent sends to stop or poke its child; each is passed on to the warm child.
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")


def _open_fds(skip: int) -> list[int]:
    names = os.listdir("/proc/self/fd")
    fds = []
    for name in names:
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)
        except OSError:  # the descriptor listdir itself held, closed by now
            continue
        fds.append(fd)
    return sorted(fds)


def _ignored_signals() -> list[int]:
    ignored = []
    for name in FORWARDED:
        number = getattr(signal, name)
        if signal.getsignal(number) == signal.SIG_IGN:
            ignored.append(int(number))
    return ignored


def _cold(real: str) -> None:
    os.execv(real, [real, *sys.argv[1:]])


def _exit_as(reply: dict) -> None:
    sys.stdout.flush()
    if "signal" in reply:
        number = reply["signal"]
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(reply.get("exit", 1))


def main(socket_path: str, real: str) -> None:
    if os.environ.get("WARM_PYTHON") == "0":
        _cold(real)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(socket_path)
    except OSError:
        _cold(real)
    fds = _open_fds(conn.fileno())
    request = {
        "argv": sys.argv[1:],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "fds": fds,
        "ignored": _ignored_signals(),
        "group_leader": os.getpgid(0) == os.getpid(),
    }
    conn.sendmsg(
        [json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    )
    reply = json.loads(conn.recv(1 << 16) or b'{"exit": 255}')
    if "cold" in reply:
        conn.close()
        _cold(real)
    child = reply["pid"]

    def forward(number: int, _frame: object) -> None:
        try:
            os.kill(child, number)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        number = getattr(signal, name)
        if signal.getsignal(number) != signal.SIG_IGN:
            signal.signal(number, forward)
    message = conn.recv(1 << 16)
    if not message:
        sys.stderr.write("warm_client: the warm interpreter's server went away\n")
        os._exit(255)
    _exit_as(json.loads(message))
