"""The local S3 stand-in (moto's server mode on 127.0.0.1, its range GETs reading only the
range: tests/s3_server.py), for the tests and the benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from efdl._process import free_port
from tests.wait import wait_until


@contextmanager
def s3_stand_in(timeout_s: float = 60) -> Iterator[dict[str, str]]:
    """Start moto's S3 server (tests/s3_server.py), wait until it accepts connections
    (``timeout_s``), and yield the environment that points s3fs (and any boto client) at it;
    stop it by PID at the end."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.s3_server", "-H", "127.0.0.1", "-p", str(port)],
        cwd=Path(__file__).resolve().parent.parent,  # where tests/ is a package
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"

    def accepts() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"moto's S3 server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_until(f"moto's S3 server to accept connections on port {port}", accepts, timeout_s)
        yield {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "FSSPEC_S3_ENDPOINT_URL": endpoint,  # fsspec's per-protocol config from env
        }
    finally:
        proc.kill()
        proc.wait()
