"""Fixtures shared by the test files."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from s3_server import S3Server, run_s3_server


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
