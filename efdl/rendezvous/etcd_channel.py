"""The gRPC side of the etcd store (efdl.rendezvous.etcd_store): a channel to one endpoint
with its stubs, TLS credentials, the protobuf messages efdl sends and reads, what an RPC's
error means, and what the store's long-lived streams (its lease keep-alive, its watches)
need of it (:class:`StreamOwner`).

Imported through efdl.rendezvous.etcd_store, which sets gRPC's environment before gRPC loads.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from etcd3 import etcdrpc
from etcd3.utils import prefix_range_end

from efdl.errors import StoreError
from efdl.rendezvous.api import (
    Compare,
    CompareTarget,
    Delete,
    Endpoint,
    EtcdSettings,
    KeyValue,
    Op,
    Put,
)

_CHANNEL_OPTIONS = [
    # One TCP connection per store: gRPC otherwise puts every channel to the same target in
    # the process on one connection, whose HTTP/2 stream limit then caps how many watches and
    # keep-alive streams all of them can hold.
    ("grpc.use_local_subchannel_pool", 1),
    # Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# A member that refuses (UNAVAILABLE) or does not answer in time (DEADLINE_EXCEEDED: hung,
# black-holed, cut off from the quorum) is left for the next one.
RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Watches ask for a member with a leader: one cut off from the quorum ends them ("no leader")
# instead of keeping them open and silent (etcd's clientv3.WithRequireLeader).
REQUIRE_LEADER = ("hasleader", "true")


def key_bytes(text: str) -> bytes:
    """A key as etcd's messages carry it."""
    return text.encode()


def key_value(pb: Any) -> KeyValue:
    """etcd's mvccpb.KeyValue as efdl's."""
    return KeyValue(
        key=pb.key.decode(),
        value=bytes(pb.value),
        create_revision=pb.create_revision,
        mod_revision=pb.mod_revision,
        version=pb.version,
        lease=pb.lease,
    )


def is_auth_failure(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
        "authentication failed" in details
    )


def is_token_invalid(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED and (
        "invalid auth token" in details or "token" in details
    )


def certificate_refused(detail: str) -> bool:
    """Whether a connect error is the server refusing our (missing) client certificate."""
    return "BAD_CERTIFICATE" in detail or "CERTIFICATE_REQUIRED" in detail


class EtcdChannel:
    """A gRPC channel to one endpoint with the stubs on it."""

    def __init__(self, endpoint: Endpoint, credentials: Any) -> None:
        self.endpoint = endpoint
        if credentials is not None:
            self.channel = grpc.secure_channel(endpoint.target, credentials, _CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(endpoint.target, _CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)

    def close(self) -> None:
        self.channel.close()


def tls_credentials(settings: EtcdSettings) -> Any:
    """gRPC's credentials for ``settings``' TLS files (None: plain http)."""
    if not settings.tls:
        return None

    def read(path: object) -> bytes | None:
        if path is None:
            return None
        with open(str(path), "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(settings.ca_file),
        private_key=read(settings.key_file),
        certificate_chain=read(settings.cert_file),
    )


def delete_request(op: Delete) -> Any:
    """The DeleteRangeRequest of ``op``."""
    if op.prefix:
        return etcdrpc.DeleteRangeRequest(
            key=key_bytes(op.key), range_end=prefix_range_end(key_bytes(op.key))
        )
    return etcdrpc.DeleteRangeRequest(key=key_bytes(op.key))


def request_op(op: Op) -> Any:
    """The RequestOp of ``op`` (a transaction's operation)."""
    if isinstance(op, Put):
        return etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=key_bytes(op.key), value=op.value, lease=op.lease)
        )
    if isinstance(op, Delete):
        return etcdrpc.RequestOp(request_delete_range=delete_request(op))
    range_end = prefix_range_end(key_bytes(op.key)) if op.prefix else b""
    return etcdrpc.RequestOp(
        request_range=etcdrpc.RangeRequest(key=key_bytes(op.key), range_end=range_end)
    )


def txn_compare(c: Compare) -> Any:
    """The Compare message of ``c`` (a transaction's condition)."""
    msg = etcdrpc.Compare(key=key_bytes(c.key), result=etcdrpc.Compare.EQUAL)
    if c.target is CompareTarget.CREATE:
        msg.target, msg.create_revision = etcdrpc.Compare.CREATE, c.revision
    else:
        msg.target, msg.mod_revision = etcdrpc.Compare.MOD, c.revision
    return msg


class StreamOwner(Protocol):
    """What a long-lived stream of the store (its lease keep-alive, a watch) asks of it: where
    to open, and what to do when an answer or an error says something of etcd."""

    @property
    def description(self) -> str: ...

    @property
    def settings(self) -> EtcdSettings: ...

    def _stream_channel(self) -> tuple[EtcdChannel, Any]: ...

    def _suspect(self, ch: EtcdChannel, why: str) -> None: ...

    def _suspect_forgotten(self, header: Any = None) -> None: ...

    def _watch_failed_over(self, ch: EtcdChannel, exc: grpc.RpcError) -> None: ...

    def _translate(self, exc: grpc.RpcError, endpoint: Endpoint, what: str) -> StoreError: ...
