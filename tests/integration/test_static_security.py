"""The etcd a node of the job serves, with a real etcd: auth turned on with the job token
before it listens, its data kept across a kill, and the warning for a password that goes to
etcd over plain http."""

from __future__ import annotations

import logging
import secrets
import socket
from pathlib import Path

import psutil
import pytest

from efdl._process import free_port
from efdl.errors import ConfigError, StoreAuthError
from efdl.rendezvous.api import Endpoint
from efdl.rendezvous.embedded import AuthState, EmbeddedEtcd, require_auth
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.served import ServedEtcd, make_job_directory

pytestmark = pytest.mark.timeout(120)


def outside_address() -> str | None:
    """An IPv4 address of this host other than loopback (other hosts could reach it), on an
    interface that is up."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if name not in stats or not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def test_the_token_turns_auth_on_before_etcd_listens_and_a_restart_keeps_it(
    tmp_path: Path,
) -> None:
    token = secrets.token_hex(16)
    data = tmp_path / "data"
    assert require_auth(data, "root", token) is AuthState.OFF  # turned on now
    assert require_auth(data, "root", token) is AuthState.OPENS  # on already, same token
    with pytest.raises(StoreAuthError, match="another password for user 'root'"):
        require_auth(data, "root", secrets.token_hex(16))
    with EmbeddedEtcd(data_dir=data, durable=True) as server:
        # No user: refused at the first request.
        with pytest.raises(StoreAuthError), EtcdStore(server.settings()) as anonymous:
            anonymous.put("/efdl/j/k", b"v")
        with pytest.raises(StoreAuthError):
            EtcdStore(server.settings(user="root", password=secrets.token_hex(16)))
        with EtcdStore(server.settings(user="root", password=token)) as store:
            store.put("/efdl/j/k", b"kept")
        server.kill()  # as when its node is SIGKILLed
        server.start()
        with EtcdStore(server.settings(user="root", password=token)) as store:
            kv = store.get("/efdl/j/k")
            assert kv is not None and kv.value == b"kept"


def test_data_served_with_a_token_is_refused_without_one(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    port = free_port()
    directory = make_job_directory(tmp_path / "state", "j", port)
    at = Endpoint("127.0.0.1", port)
    served = ServedEtcd(at, "127.0.0.1", directory, token).start()
    served.stop()
    assert (directory / "data").is_dir()  # the job did not end: kept for a restart
    with pytest.raises(ConfigError, match="was served with a job token, and none was given"):
        ServedEtcd(at, "127.0.0.1", directory, None).start()
    with pytest.raises(ConfigError, match="another job token"):
        ServedEtcd(at, "127.0.0.1", directory, secrets.token_hex(16)).start()
    served = ServedEtcd(at, "127.0.0.1", directory, token).start()
    served.job_ended = True
    served.stop()
    assert not directory.exists()


def test_a_password_over_plain_http_to_another_host_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address = outside_address()
    if address is None:
        pytest.skip("this host has no address other than loopback")
    token = secrets.token_hex(16)
    require_auth(tmp_path / "data", "root", token)
    with EmbeddedEtcd(data_dir=tmp_path / "data", host=address) as server:
        settings = server.settings(user="root", password=token)
        with caplog.at_level(logging.WARNING, logger="efdl.rendezvous.etcd_store"):
            with EtcdStore(settings) as store, EtcdStore(settings):
                store.put("/efdl/j/k", b"v")
            with EtcdStore(server.settings()):  # no password: nothing to warn about
                pass
        warnings = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert f"http://{address}:{server.client_port}" in warnings[0]
        assert token not in warnings[0]
