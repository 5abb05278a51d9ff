"""The ``gpu`` marker, and a record of each test's outcome for ``scripts/gpu_suite.py``'s report.

The marker is registered here, not in pyproject.toml, so the suite is self-contained. With
``GPU_SUITE_RESULTS=<file>`` each phase of each test (setup, call, teardown: its outcome, seconds and
short failure) is appended to that file as one JSON line as soon as it is known: a suite killed by the script's hard timeout still leaves the results it had.
"""

from __future__ import annotations

import json
import os
from typing import Any


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers", "gpu: runs CUDA paths; skipped without CUDA (GPU_SUITE_DEVICE=cpu: a dry run on the CPU)"
    )
    if not config.pluginmanager.hasplugin("timeout"):
        # A GPU machine's Python may lack pytest-timeout: the marks stay valid under --strict-markers, and
        # each job's own timeout (gpu_support.JOB_TIMEOUT) and scripts/gpu_suite.py's limit still apply.
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit (not installed here)")


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("GPU_SUITE_RESULTS")
    if not path:
        return
    message = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    elif report.failed:
        message = report.longreprtext[-3000:]
    entry = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration_s": round(report.duration, 2),
        "message": message,
    }
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
