"""The local S3 stand-in (moto's server mode on 127.0.0.1), for the tests and the benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from efdl._process import free_port


@contextmanager
def s3_stand_in(timeout_s: float = 60) -> Iterator[dict[str, str]]:
    """Start moto's S3 server, wait until it accepts connections (``timeout_s``), and yield
    the environment that points s3fs (and any boto client) at it; stop it by PID at the end."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto's S3 server did not accept connections on port {port} within "
                        f"{timeout_s:.0f} s"
                    ) from None
                time.sleep(0.1)
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
