"""Fixtures shared by every test: a real etcd server and stores on it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from efdl.rendezvous.api import KVStore
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.memory_store import MemoryStore


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
