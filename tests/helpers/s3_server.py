"""A real S3 endpoint for tests: moto's server on loopback, with dummy credentials and one bucket.

Tests talk to it over HTTP through s3fs exactly as they would to AWS; nothing of ours is mocked.
``conftest.py`` exposes it as the session fixture ``s3_server`` and the per-test fixture ``s3_url``
(a fresh prefix in the bucket); other test files reuse both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

BUCKET = "trainer-core-test"
_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    """Where the server listens and what a client needs to reach it."""

    endpoint_url: str
    bucket: str = BUCKET
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])


def run_s3_server() -> Iterator[S3Server]:
    """Start moto on 127.0.0.1 (a free port), create the bucket, yield, then stop it.

    The endpoint and dummy credentials are also put in the environment (``AWS_ENDPOINT_URL``), so code
    under test that builds its own s3fs filesystem without ``storage_options`` reaches this server too,
    never AWS.
    """
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request drowns test output

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved_env = {key: os.environ.get(key) for key in [*_CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update(_CREDENTIALS)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        options = {
            "endpoint_url": endpoint,
            "key": _CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": _CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "token": _CREDENTIALS["AWS_SESSION_TOKEN"],
        }
        yield S3Server(endpoint_url=endpoint, storage_options=options)
    finally:
        server.stop()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
