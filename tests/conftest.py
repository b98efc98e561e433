"""Fixtures shared by every test: a real etcd server and stores on it."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from efdl.rendezvous.api import KVStore
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.memory_store import MemoryStore
from tests.s3 import s3_stand_in

# Property tests: the same examples on every run ("ci": derandomized, so that a run passes
# or fails by the code alone); the wide random search is its own command:
#   EFDL_HYPOTHESIS=wide python -m pytest tests/unit/test_allocate.py -k invariants --timeout 0
settings.register_profile("ci", max_examples=300, derandomize=True, deadline=None)
settings.register_profile("wide", max_examples=100_000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("EFDL_HYPOTHESIS", "ci"))


@pytest.fixture(scope="session", autouse=True)
def temp_dir() -> Iterator[Path]:
    """The temp directory of everything this session starts (efdl-run's private
    directories, torchrun's logs, etcd's data), removed at its end: a test that kills a
    process leaves nothing in /tmp. (That efdl removes its own is tested by name.) Short, so
    that Unix socket paths under it stay within their 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="pytest-efdl-"))
    before = {name: os.environ.get(name) for name in ("TMPDIR", "XDG_STATE_HOME")}
    os.environ["TMPDIR"] = str(path)
    os.environ["XDG_STATE_HOME"] = str(path / "state")  # a served etcd's data (efdl-run)
    tempfile.tempdir = None  # read TMPDIR again
    try:
        yield path
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = None
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def short_tmp(temp_dir: Path) -> Path:
    """A fresh directory with a short path (for a TMPDIR that holds Unix sockets)."""
    return Path(tempfile.mkdtemp(prefix="t", dir=temp_dir))


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """One real etcd for the whole session; tests keep apart by key prefix."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture()
def own_etcd() -> Iterator[EmbeddedEtcd]:
    """A real etcd of this test's own, for tests that restart or reconfigure it."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture()
def prefix() -> str:
    return f"/t/{uuid.uuid4().hex[:12]}/"


@pytest.fixture(params=["memory", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[KVStore]:
    """The same contract, against the in-memory fake and a real etcd."""
    if request.param == "memory":
        s: KVStore = MemoryStore()
    else:
        server: EmbeddedEtcd = request.getfixturevalue("etcd_server")
        s = EtcdStore(server.settings())
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """A local S3-compatible server (moto's server mode) on 127.0.0.1, stopped by PID.

    Yields the environment that points s3fs (and any boto client) at it.
    """
    with s3_stand_in() as env:
        yield env


@pytest.fixture()
def s3_bucket(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the local S3 server, this process configured for it; its URL."""
    import fsspec  # type: ignore[import-untyped]

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_server["AWS_ENDPOINT_URL"]})
    bucket = f"efdl-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem(
        "s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"], skip_instance_cache=True
    )
    fs.mkdir(bucket)
    return f"s3://{bucket}"
