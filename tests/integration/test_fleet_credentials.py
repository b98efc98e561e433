"""The etcd users efdl node gives its agents (efdl.fleet.etcd_users, efdl.fleet.spawn), against a
real etcd with authentication on: an agent's user reads and writes its job's keys and nothing
else (not another job's, not a job whose id starts with its own, not the fleet's records), may
not manage users, and is gone once deleted; a daemon whose user may not manage users is
refused; a restarted daemon deletes the users of its host that no agent has."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from etcd3 import etcdrpc

from efdl.errors import ConfigError, StoreAuthError
from efdl.fleet.etcd_users import EtcdUsers, agent_user_prefix
from efdl.fleet.records import FleetKeys
from efdl.fleet.spawn import AgentFiles, Isolation, Spawner
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore

ROOT_PASSWORD = f"root-{secrets.token_hex(8)}"


def _enable_auth(server: EmbeddedEtcd) -> None:
    """Users root (the daemon's) and reader (a role on /other/ only), then auth on."""
    channel = grpc.insecure_channel(server.endpoint.target)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=ROOT_PASSWORD))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="reader"))
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="reader", password="reader-pw"))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="reader", role="reader"))
    auth.AuthEnable(etcdrpc.AuthEnableRequest())
    channel.close()


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(extra_args=("--auth-token=simple",)) as server:
        _enable_auth(server)
        yield server


@pytest.fixture()
def admin(auth_etcd: EmbeddedEtcd) -> Iterator[EtcdUsers]:
    users = EtcdUsers(auth_etcd.settings(user="root", password=ROOT_PASSWORD))
    try:
        yield users
    finally:
        users.close()


def test_authentication_is_told_on_from_off(etcd_server: EmbeddedEtcd, admin: EtcdUsers) -> None:
    assert admin.auth_enabled()
    plain = EtcdUsers(etcd_server.settings())
    try:
        assert not plain.auth_enabled()
    finally:
        plain.close()


def test_an_agents_user_reaches_its_jobs_keys_alone(
    auth_etcd: EmbeddedEtcd, admin: EtcdUsers
) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    fleet = FleetKeys(f"f{uuid.uuid4().hex[:6]}")
    admin.put(f"/efdl/{job}-b/secret", b"another job's")  # its id starts with job's
    admin.put(f"/efdl/other-{job}/secret", b"another job's")
    admin.put(fleet.spec(job), b"{}")
    name = f"{agent_user_prefix('gpu-a')}{uuid.uuid4().hex[:8]}"
    password = secrets.token_urlsafe(32)
    admin.add_agent_user(name, password, f"/efdl/{job}/")
    assert name in admin.agent_users(agent_user_prefix("gpu-a"))
    with EtcdStore(auth_etcd.settings(user=name, password=password)) as agent:
        lease = agent.grant_lease(10)
        agent.put(f"/efdl/{job}/nodes/n1", b"me", lease=lease)
        assert [kv.value for kv in agent.get_prefix(f"/efdl/{job}/").kvs] == [b"me"]
        agent.revoke_lease(lease)
        for key in (f"/efdl/{job}-b/secret", f"/efdl/other-{job}/secret", fleet.spec(job)):
            with pytest.raises(StoreAuthError, match=f"user '{name}'"):
                agent.get(key)
            with pytest.raises(StoreAuthError):
                agent.put(key, b"overwritten")
        with pytest.raises(StoreAuthError):
            agent.get_prefix("/efdl/")
    as_agent = EtcdUsers(auth_etcd.settings(user=name, password=password))
    try:
        with pytest.raises(ConfigError, match=f"user '{name}' may not manage etcd's users"):
            as_agent.check_can_manage_users()
    finally:
        as_agent.close()
    kv = admin.get(fleet.spec(job))
    assert kv is not None and kv.value == b"{}"  # untouched
    admin.delete_agent_user(name)
    admin.delete_agent_user(name)  # gone already: no error
    assert name not in admin.agent_users(agent_user_prefix("gpu-a"))
    with pytest.raises(StoreAuthError):
        EtcdStore(auth_etcd.settings(user=name, password=password))


def test_a_daemon_whose_user_may_not_manage_users_is_refused(
    auth_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    reader = EtcdUsers(auth_etcd.settings(user="reader", password="reader-pw"))
    try:
        spawner = Spawner("gpu-a", "127.0.0.1", "x", tmp_path / "state", Isolation(), reader)
        with pytest.raises(ConfigError, match="this daemon's user 'reader' may not manage"):
            spawner.prepare()
    finally:
        reader.close()


def test_a_restarted_daemon_deletes_the_users_no_agent_of_its_host_has(
    admin: EtcdUsers, tmp_path: Path
) -> None:
    host = f"gpu-{uuid.uuid4().hex[:6]}"
    mine = [f"{agent_user_prefix(host)}{i}" for i in ("kept", "orphan")]
    theirs = f"{agent_user_prefix(host + '-b')}x"  # another host's, whose id starts with it
    for name in (*mine, theirs):
        admin.add_agent_user(name, "pw", "/efdl/j/")
    spawner = Spawner(host, "127.0.0.1", "x", tmp_path / "state", Isolation(), admin)
    spawner.prepare()
    (tmp_path / "state" / "run" / "stale").mkdir()
    kept = AgentFiles("l", "e", str(tmp_path / "state" / "run" / "kept"), None, mine[0])
    (tmp_path / "state" / "run" / "kept").mkdir()
    spawner.forget_orphans([kept])
    assert admin.agent_users(agent_user_prefix(host)) == [mine[0]]
    assert theirs in admin.agent_users(agent_user_prefix(host + "-b"))
    assert sorted(p.name for p in (tmp_path / "state" / "run").iterdir()) == ["kept"]
    for name in (mine[0], theirs):
        admin.delete_agent_user(name)
