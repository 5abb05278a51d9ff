"""Fixtures shared by the test files, and where things are.

The folders follow the source: ``core/`` (Trainer, loops, hooks, logging, optimizers, CLI),
``plugins/``, ``callbacks/``, ``checkpoint/`` (IO, format, resume), ``loggers/``, and
``reliability/`` (kills, faults, bad files, security; RELIABILITY.md names each test).
``helpers/`` holds what tests share (``boring``: a tiny module, random data, a quiet Trainer;
``launch``: the environment of a job started by path; ``faulty_fs``, ``s3_server``, ``malicious``).
``jobs/`` holds the scripts tests start in child processes the way a user starts a script; a test
imports a job's model from it to compute the reference. Both folders are on ``sys.path``
(``pythonpath`` in pyproject.toml), so their modules import by name and test file names are unique.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import warm_python
from launch import LAUNCH_VARS
from s3_server import S3Server, run_s3_server

#: What ``seed_everything`` leaves in the environment: a program a later test starts (a LightningCLI
#: program seeds itself from PL_GLOBAL_SEED) would otherwise take an earlier test's seed.
_SEED_VARS = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def _runs_tests(config: pytest.Config) -> bool:
    """This process runs tests: an xdist worker, or a run without workers (not the xdist controller)."""
    return "PYTEST_XDIST_WORKER" in os.environ or not getattr(config.option, "numprocesses", None)


def pytest_configure(config: pytest.Config) -> None:
    """Start this worker's warm interpreter (``helpers/warm_python.py``) while the tests are collected.

    Child processes (job scripts, their ranks, CLI programs) then fork from an interpreter that imported
    torch once, instead of importing it again: that was most of the suite's time. ``WARM_PYTHON=0`` turns
    it off; a child it could not start as a fresh interpreter would (odd interpreter options, another
    ``TORCH_*`` setting, ...) starts cold by itself.
    """
    if os.environ.get("WARM_PYTHON") == "0" or not _runs_tests(config) or sys.platform != "linux":
        return
    folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
    config.stash[_WARM] = (folder, warm_python.start(folder))


def pytest_collection_finish(session: pytest.Session) -> None:
    warm = session.config.stash.get(_WARM, None)
    if warm is not None:
        shim = warm[1]()
        if shim is not None:
            sys.executable = shim
            multiprocessing.spawn.set_executable(shim)


def pytest_unconfigure(config: pytest.Config) -> None:
    warm = config.stash.get(_WARM, None)
    if warm is not None:
        sys.executable = warm_python.REAL_EXECUTABLE
        try:
            os.killpg(warm[1].server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        warm[1].server.wait()
        shutil.rmtree(warm[0], ignore_errors=True)


_WARM = pytest.StashKey[tuple]()


@pytest.fixture(autouse=True)
def no_launch_variables_leak() -> Iterator[None]:
    """Launch variables a test's in-process run set (our launcher sets MASTER_PORT here) end with the test.

    A later job started from this worker would inherit them and try to rendezvous on a port an object
    of the earlier run may still hold (CI saw EADDRINUSE in a 2-rank job started by a module fixture).
    The seed ``seed_everything`` exports ends with the test too (CI saw a LightningCLI program seeded
    with another test's seed).
    """
    before = {name: os.environ.get(name) for name in (*LAUNCH_VARS, *_SEED_VARS)}
    group_before = _default_group_started()
    yield
    if _default_group_started() and not group_before:
        # An in-process run of a distributed plugin (FSDP at one rank, say) starts a one-rank group
        # and, as in Lightning, leaves it; a later test starting its own group would fail (CI saw
        # "trying to initialize the default process group twice" in another module's fixture).
        import torch.distributed as dist

        dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _default_group_started() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


@pytest.fixture
def no_process_group_left_behind() -> Iterator[None]:
    """For a test that runs a multi-process plugin in this process, at one rank.

    Such a run starts a one-rank process group and sets MASTER_PORT here; later tests start jobs that
    inherit the environment, so neither may outlive the test.
    """
    environ = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server (moto) on loopback for the whole session; skipped if moto is not installed."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    yield from run_s3_server()


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """A fresh, empty ``s3://`` prefix for one test."""
    return s3_server.url(uuid.uuid4().hex[:12])
