"""An etcd user per fleet agent, limited to its job's keys: what ``efdl node`` gives each agent
it starts where etcd has authentication on, instead of its own credentials.

For an agent, the daemon makes a role granting read and write on ``/efdl/<job>/`` (the key
range of that prefix) and nothing else, a user with that role alone and a random password,
and deletes both when the agent has ended. Both are named ``efdl-agent.<host>.<id>``, so a
daemon that restarts deletes those of its host that no agent of its own still uses (its
agents' records name theirs). Managing users takes etcd's ``root`` role: a daemon whose
user lacks it is refused at start, since the only credentials it could give its jobs would
be its own.

Where authentication is off, every client may read and write every key: the daemon logs
that its jobs are not isolated in etcd.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2
from etcd3.utils import prefix_range_end
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

from efdl.errors import ConfigError, StoreAuthError
from efdl.rendezvous.etcd_store import EtcdStore

AGENT_USER_PREFIX = "efdl-agent."


def agent_user_prefix(host_id: str) -> str:
    """The names of the etcd users (and roles) made for agents of host ``host_id``."""
    return f"{AGENT_USER_PREFIX}{host_id}."


class AgentUsers(Protocol):
    """What the host daemon asks of etcd's user management (:class:`EtcdUsers`)."""

    def auth_enabled(self) -> bool: ...

    def check_can_manage_users(self) -> None: ...

    def add_agent_user(self, name: str, password: str, key_prefix: str) -> None: ...

    def delete_agent_user(self, name: str) -> None: ...

    def agent_users(self, prefix: str) -> list[str]: ...


def _auth_status_messages() -> tuple[Any, Any]:
    """etcd's AuthStatus request and response (etcd 3.5; the etcd3 package's protos are older):
    the response's ``enabled`` (field 2) is all that is read."""
    fd = descriptor_pb2.FileDescriptorProto(
        name="efdl_fleet_auth_status.proto", package="efdl_fleet", syntax="proto3"
    )
    fd.message_type.add(name="AuthStatusRequest")
    resp = fd.message_type.add(name="AuthStatusResponse")
    resp.field.add(
        name="enabled",
        number=2,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"efdl_fleet.{name}"))
        for name in ("AuthStatusRequest", "AuthStatusResponse")
    )


_AuthStatusRequest, _AuthStatusResponse = _auth_status_messages()


class EtcdUsers(EtcdStore):
    """An etcd client (an :class:`EtcdStore`) that may also make and delete the users of
    agents. Each call is one RPC with the store's failover and token renewal."""

    def auth_enabled(self) -> bool:
        """Whether etcd has authentication on (etcd's AuthStatus, 3.5 and later; a client
        without the root role is refused it, which only an etcd with authentication does)."""

        def call(ch: Any, md: Any, timeout: float) -> bool:
            rpc = ch.channel.unary_unary(
                "/etcdserverpb.Auth/AuthStatus",
                request_serializer=_AuthStatusRequest.SerializeToString,
                response_deserializer=_AuthStatusResponse.FromString,
            )
            return bool(rpc(_AuthStatusRequest(), metadata=md, timeout=timeout).enabled)

        try:
            return self._call("read whether authentication is on", call)
        except StoreAuthError:  # etcd asks for the root role: only with authentication on
            return True

    def check_can_manage_users(self) -> None:
        """Raise ConfigError unless this client may manage etcd's users (the root role)."""
        try:
            self.agent_users(AGENT_USER_PREFIX)
        except StoreAuthError as exc:
            who = repr(self.settings.user) if self.settings.user else "(its client certificate's)"
            raise ConfigError(
                f"etcd has authentication on, and this daemon's user {who} may not manage "
                "etcd's users; give it the root role (etcdctl user grant-role USER root), so "
                "that each job's agents get a user of their own limited to the job's keys "
                f"instead of the daemon's credentials ({exc})"
            ) from None

    def agent_users(self, prefix: str) -> list[str]:
        """The etcd users whose names start with ``prefix``."""
        resp = self._rpc("list users", "UserList", etcdrpc.AuthUserListRequest())
        return sorted(u for u in resp.users if u.startswith(prefix))

    def add_agent_user(self, name: str, password: str, key_prefix: str) -> None:
        """A role ``name`` with read and write on the keys under ``key_prefix`` only, and a
        user ``name`` with that role and ``password``; on a failure, neither."""
        key = key_prefix.encode()
        perm = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=key, range_end=prefix_range_end(key)
        )
        try:
            self._rpc(f"add role {name}", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=name))
            self._rpc(
                f"grant role {name} the keys under {key_prefix}",
                "RoleGrantPermission",
                etcdrpc.AuthRoleGrantPermissionRequest(name=name, perm=perm),
            )
            self._rpc(
                f"add user {name}",
                "UserAdd",
                etcdrpc.AuthUserAddRequest(name=name, password=password),
            )
            self._rpc(
                f"grant user {name} its role",
                "UserGrantRole",
                etcdrpc.AuthUserGrantRoleRequest(user=name, role=name),
            )
        except BaseException:
            self.delete_agent_user(name)
            raise

    def delete_agent_user(self, name: str) -> None:
        """Delete the user and the role ``name``; either already gone is no error."""
        self._rpc(
            f"delete user {name}", "UserDelete", etcdrpc.AuthUserDeleteRequest(name=name), True
        )
        self._rpc(
            f"delete role {name}", "RoleDelete", etcdrpc.AuthRoleDeleteRequest(role=name), True
        )

    def _rpc(self, what: str, method: str, request: Any, missing_ok: bool = False) -> Any:
        """One call of etcd's Auth service (``method``), with the store's failover and token
        renewal; with ``missing_ok``, a user or role not found is None."""

        def call(ch: Any, md: Any, timeout: float) -> Any:
            try:
                return getattr(ch.auth, method)(request, metadata=md, timeout=timeout)
            except grpc.RpcError as exc:
                if missing_ok and "not found" in (exc.details() or ""):
                    return None
                raise

        return self._call(what, call)
