"""The tests' warm interpreter (``helpers/warm_python.py``) starts children as a fresh interpreter would.

Every child process of the suite forks from it, so each difference from a cold start would show up as a
test that passes here and fails for a user: the probe below is run warm and cold and must see the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_python


@pytest.fixture(autouse=True)
def warm_interpreter_on() -> None:
    # sys.executable becomes the shim once the tests are collected (tests/conftest.py)
    if sys.executable == warm_python.REAL_EXECUTABLE:
        pytest.skip("the warm interpreter is off (WARM_PYTHON=0)")


PROBE = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv,
    "path": [p for p in sys.path if "site-packages" not in p],
    "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"),
    "main_file": globals().get("__file__"),
    "name": __name__,
    "stdin": sys.stdin.read(),
}))
"""


def _run(executable: str, args: list[str], tmp_path: Path, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PROBE_VALUE="x y", PYTHONPATH=str(tmp_path / "extra"))
    return subprocess.run(
        [executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, **kwargs
    )


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_warm_child_sees_what_a_cold_one_sees(tmp_path: Path, form: str) -> None:
    (tmp_path / "extra").mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    args = {"script": ["probe.py", "a", "--b"], "module": ["-m", "probe", "a"], "code": ["-c", PROBE, "a"]}[
        form
    ]
    warm = _run(sys.executable, args, tmp_path, input="from stdin")
    cold = _run(warm_python.REAL_EXECUTABLE, args, tmp_path, input="from stdin")
    assert warm.returncode == cold.returncode == 0, warm.stderr + cold.stderr
    assert json.loads(warm.stdout) == json.loads(cold.stdout)
    assert warm.stderr == cold.stderr


def test_exit_codes_and_tracebacks_are_the_interpreters(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(
        "import sys\nif sys.argv[1] == 'exit':\n    sys.exit(7)\nraise ValueError('boom')\n"
    )
    assert subprocess.run([sys.executable, "fail.py", "exit"], cwd=tmp_path).returncode == 7
    warm = subprocess.run([sys.executable, "fail.py", "raise"], cwd=tmp_path, capture_output=True, text=True)
    cold = subprocess.run(
        [warm_python.REAL_EXECUTABLE, "fail.py", "raise"], cwd=tmp_path, capture_output=True, text=True
    )
    assert warm.returncode == cold.returncode == 1
    assert warm.stderr == cold.stderr  # the program's frames only, none of the server's


def test_signals_reach_the_child_and_a_killed_shim_takes_it_along(tmp_path: Path) -> None:
    (tmp_path / "wait.py").write_text(
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    for how, code in (("terminate", -signal.SIGTERM), ("kill", -signal.SIGKILL)):
        pid_file = tmp_path / f"{how}.pid"
        proc = subprocess.Popen([sys.executable, "wait.py", str(pid_file)], cwd=tmp_path)
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        getattr(proc, how)()
        assert proc.wait(timeout=30) == code
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, f"the child outlived its shim's {how}"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_inherited_descriptors_reach_the_child(tmp_path: Path) -> None:
    read, write = os.pipe()
    try:
        code = f"import os; os.write({write}, b'through the pipe')"
        proc = subprocess.run([sys.executable, "-c", code], pass_fds=(write,), timeout=60)
        assert proc.returncode == 0
        os.close(write)
        write = -1
        assert os.read(read, 100) == b"through the pipe"
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


@pytest.mark.parametrize(
    ("args", "env", "warm"),
    [
        (["-c", "import sys; print('torch' in sys.modules)"], {}, True),
        (["-S", "-c", "import sys; print('torch' in sys.modules)"], {}, False),
        (["-c", "import sys; print('torch' in sys.modules)"], {"TORCH_LOGS": "+dynamo"}, False),
        (["-c", "import sys; print('torch' in sys.modules)"], {"PYTHONHASHSEED": "3"}, False),
        (["-c", "import sys; print('torch' in sys.modules)"], {"WARM_PYTHON": "0"}, False),
    ],
)
def test_what_a_fork_cannot_reproduce_starts_cold(args: list[str], env: dict[str, str], warm: bool) -> None:
    proc = subprocess.run(
        [sys.executable, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(warm)
