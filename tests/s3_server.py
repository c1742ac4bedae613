"""A real S3 API server on 127.0.0.1 for the tests: moto's server mode, started and stopped by the test.

:func:`s3_server` yields the environment a client needs (``AWS_ENDPOINT_URL`` and dummy
credentials, which s3fs and botocore read as they would in production); :func:`make_bucket`
creates a bucket through s3fs. A test that needs it skips without moto and s3fs on a developer
machine and fails in CI (``.ci/run`` installs both with the test extras).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

__all__ = ["need_s3", "s3_server", "make_bucket", "s3fs_of"]


def need_s3() -> None:
    """Skip (fail under ``CI=true``) without moto's server and s3fs."""
    missing = [m for m in ("moto", "s3fs", "flask") if not _importable(m)]
    if missing:
        why = f"the S3 API server tests need {', '.join(missing)} (pip install -e '.[test]')"
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3 server on a free port of 127.0.0.1; yields the client environment, stops the server on exit."""
    need_s3()
    _forget_clients()  # an s3fs instance made for an earlier server still points at that server's endpoint
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {url}") from None
                time.sleep(0.2)
        yield {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        _forget_clients()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _forget_clients() -> None:
    """Drop fsspec's cached s3fs instances: fsspec hands back one instance per set of arguments, and the endpoint
    (``AWS_ENDPOINT_URL``) is read when the instance is made, so a later server on another port needs a new one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def s3fs_of(env: dict[str, str]):
    """An s3fs filesystem on the server of ``env`` (no listing cache)."""
    import s3fs

    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=env["AWS_ENDPOINT_URL"],
        use_listings_cache=False,
    )


def make_bucket(env: dict[str, str], name: str) -> str:
    """Create bucket ``name`` on the server of ``env``; its ``s3://`` URL."""
    s3fs_of(env).mkdir(name)
    return f"s3://{name}"
