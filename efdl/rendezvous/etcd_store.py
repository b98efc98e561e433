"""The etcd v3 implementation of :class:`~efdl.rendezvous.api.KVStore`.

It speaks gRPC through the protobuf stubs that ``python3-etcd3`` ships (``etcd3.etcdrpc``),
not through its client class, because that class marks a failed endpoint dead for five
minutes, never renews an expired auth token, and its watcher dies silently when the server
restarts. This adapter owns those three things:

- failover: endpoints are tried in order; an unavailable one is skipped and the request goes
  to the next, for up to ``request_timeout_s`` (so a short etcd restart is invisible);
- auth: the token is fetched at connect and fetched again when etcd says it is invalid;
- watches: one thread per watch resumes after the last delivered revision on any stream
  error, and re-lists when that revision was compacted;
- forgetting: an etcd that lost its data comes back empty (a new cluster id, revisions from
  1), one restored from a backup comes back older (revisions below those it reported). Every
  answer's header is compared with what was seen; when etcd forgot, every watch re-lists
  (a resumed watch would wait for a revision etcd does not have yet: its events would never
  come) and the store's listeners are told (:meth:`KVStore.on_forgot`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

# The agent forks workers that exec at once: gRPC's fork handlers only print warnings then.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC's C core logs failed TLS handshakes to stderr at info level; efdl says it clearly.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import grpc._common
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2
from etcd3.utils import prefix_range_end

from efdl.errors import CompactedError, StoreAuthError, StoreConnectionError, StoreError
from efdl.rendezvous.api import (
    NO_LEASE,
    Compare,
    CompareTarget,
    Delete,
    Endpoint,
    EtcdSettings,
    EventType,
    Get,
    KeyValue,
    KVStore,
    Op,
    PrefixSnapshot,
    Put,
    TxnResult,
    Watch,
    WatchBatch,
    WatchEvent,
    WatchSink,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

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
_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Watches ask for a member with a leader: one cut off from the quorum ends them ("no leader")
# instead of keeping them open and silent (etcd's clientv3.WithRequireLeader).
_REQUIRE_LEADER = ("hasleader", "true")
CONNECT_SAY_EVERY_S = 30.0  # how often a client that waits for etcd at its start says so

# gRPC Python wakes every thread blocked on a stream 10 times a second (only so that Ctrl-C can
# interrupt the main thread). New data still wakes a reader at once through its condition
# variable; the timer only costs CPU: ~10 wakeups/s per open watch or keep-alive stream.
# Once a second is plenty for Ctrl-C. (A private constant: left alone if it ever goes away.)
if isinstance(getattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", None), float):
    grpc._common.MAXIMUM_WAIT_TIMEOUT = max(grpc._common.MAXIMUM_WAIT_TIMEOUT, 1.0)


def _b(text: str) -> bytes:
    return text.encode()


def _kv(pb: Any) -> KeyValue:
    return KeyValue(
        key=pb.key.decode(),
        value=bytes(pb.value),
        create_revision=pb.create_revision,
        mod_revision=pb.mod_revision,
        version=pb.version,
        lease=pb.lease,
    )


def _is_auth_failure(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
        "authentication failed" in details
    )


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP, or ``localhost``) is reachable from this host alone; a
    name other than ``localhost`` is taken for reachable from others."""
    text = address.strip("[]")
    if text == "localhost":
        return True
    try:
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def plaintext_endpoints(settings: EtcdSettings) -> tuple[Endpoint, ...]:
    """The endpoints a password (or job token) would reach in clear: none without one or
    with TLS; else every endpoint not on loopback, whose traffic never leaves the host. Pure."""
    if settings.password is None or settings.tls:
        return ()
    return tuple(e for e in settings.endpoints if not is_loopback(e.host))


_warned_plaintext: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_plaintext(settings: EtcdSettings) -> bool:
    """Log a warning, once per process for these endpoints and user, when credentials go to
    etcd over plain http (see :func:`plaintext_endpoints`); whether it did now."""
    exposed = plaintext_endpoints(settings)
    if not exposed:
        return False
    key = (settings.endpoint_list, settings.user or "")
    with _warned_lock:
        if key in _warned_plaintext:
            return False
        _warned_plaintext.add(key)
    log.warning(
        "etcd credentials (user %r and its password, or the job token) go over plain http "
        "to %s: whoever can watch that network can read them, and with them stop the job, "
        "join it and be sent its model state. Give etcd TLS (https:// endpoints and "
        "--etcd-ca), or keep it on this host.",
        settings.user,
        ", ".join(str(e) for e in exposed),
    )
    return True


def _is_token_invalid(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED and (
        "invalid auth token" in details or "token" in details
    )


class _Channel:
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


class EtcdStore(KVStore):
    """A :class:`KVStore` on a real etcd v3 cluster.

    Construction connects (trying every endpoint for up to ``connect_timeout_s``) and
    authenticates, so a wrong endpoint or password fails here with a clear error.

    Args:
        settings: endpoints, TLS files, credentials and timeouts.
    """

    def __init__(self, settings: EtcdSettings) -> None:
        self._settings = settings
        warn_plaintext(settings)
        self._credentials = self._tls_credentials(settings)
        self._lock = threading.Lock()
        self._channels = [_Channel(e, self._credentials) for e in settings.endpoints]
        self._current = 0
        self._token: str | None = None
        self._closed = False
        # Called with each request's seconds, failover included (the agent's metrics).
        self.on_request: Callable[[float], None] | None = None
        self._watches: set[_EtcdWatch] = set()
        # What etcd's answers said of it so far (see the module docstring, forgetting).
        self._cluster_id = 0
        self._seen_revision = 0
        self._forgets = 0  # how many times etcd was found to have forgotten
        self._confirming = False  # a check of a suspicious header is under way
        # One attempt's share of a request's time when there are members to fail over to.
        n = len(self._channels)
        self._attempt_s = settings.request_timeout_s / min(n, 3) if n > 1 else float("inf")
        self._connect()
        self._keepalive = _KeepAliveStream(self)

    # ---------------------------------------------------------------- plumbing

    @property
    def description(self) -> str:
        return f"etcd at {self._settings.endpoint_list}"

    @property
    def settings(self) -> EtcdSettings:
        return self._settings

    @staticmethod
    def _tls_credentials(settings: EtcdSettings) -> Any:
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

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("token", self._token),) if self._token else None

    def _connect(self) -> None:
        start = time.monotonic()
        deadline = start + self._settings.connect_timeout_s
        last: grpc.RpcError | None = None
        say_at = start + 1.0  # a second of silence is long enough to say what we wait for
        while True:
            refusals = 0  # TLS handshakes refused for the client certificate: not transient
            for index, ch in enumerate(self._channels):
                try:
                    ch.maintenance.Status(
                        etcdrpc.StatusRequest(), timeout=min(2.0, self._settings.request_timeout_s)
                    )
                    self._current = index
                    if self._settings.user is not None:
                        self._authenticate(ch)
                    return
                except grpc.RpcError as exc:
                    if exc.code() not in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ):
                        raise self._translate(exc, ch.endpoint, "connect") from exc
                    last = exc
                    refusals += _certificate_refused(exc.details() or "")
            if refusals == len(self._channels) or time.monotonic() >= deadline:
                break
            if (now := time.monotonic()) >= say_at:  # then again every half minute
                say_at = now + CONNECT_SAY_EVERY_S
                log.warning(
                    "%s for etcd at %s (%s): %.0f s so far, giving up %.0f s from now.",
                    "Waiting" if now - start < CONNECT_SAY_EVERY_S else "Still waiting",
                    self._settings.endpoint_list,
                    (last.details() or "no answer").splitlines()[0][:160] if last else "",
                    now - start,
                    deadline - now,
                )
            time.sleep(0.2)
        detail = last.details() if last is not None else "no answer"
        if _certificate_refused(detail):
            given = (
                "no client certificate was given"
                if not self._settings.cert_file
                else (f"the client certificate {self._settings.cert_file} was refused")
            )
            raise StoreConnectionError(
                f"etcd at {self._settings.endpoint_list} refused the TLS handshake: it requires "
                f"a client certificate its CA signed, and {given} (--etcd-cert, --etcd-key)."
            )
        raise StoreConnectionError(
            f"Cannot reach etcd at {self._settings.endpoint_list} within "
            f"{self._settings.connect_timeout_s:g} s: {detail}. Check that the endpoints are "
            "right and that etcd is running (and, for https, that the CA file matches)."
        )

    def _authenticate(self, ch: _Channel) -> None:
        try:
            resp = ch.auth.Authenticate(
                etcdrpc.AuthenticateRequest(
                    name=self._settings.user, password=self._settings.password
                ),
                timeout=self._settings.request_timeout_s,
            )
        except grpc.RpcError as exc:
            raise self._translate(exc, ch.endpoint, "authenticate") from exc
        self._token = resp.token

    def _translate(self, exc: grpc.RpcError, endpoint: Endpoint, what: str) -> StoreError:
        code, details = exc.code(), exc.details()
        if "user name is empty" in (details or ""):
            return StoreAuthError(
                f"etcd at {endpoint} has authentication on and refused {what} from a client "
                "without a user: pass --etcd-user and the password (EFDL_ETCD_PASSWORD or "
                "--etcd-password-file)."
            )
        if _is_auth_failure(exc) or "permission denied" in (details or "").lower():
            who = f"user {self._settings.user!r}" if self._settings.user else "an anonymous client"
            return StoreAuthError(
                f"etcd at {endpoint} refused {what} for {who}: {details}. Check the user, the "
                "password (EFDL_ETCD_PASSWORD or --etcd-password-file) and the user's role."
            )
        if code is grpc.StatusCode.OUT_OF_RANGE and "compacted" in (details or ""):
            return CompactedError(f"etcd at {endpoint} could not {what}: {details}.")
        if code is grpc.StatusCode.OUT_OF_RANGE and "future revision" in (details or ""):
            # A revision it reported before is in its future: it went back (see _forgotten).
            self._suspect_forgotten()
            return CompactedError(
                f"etcd at {endpoint} could not {what}: {details} (it holds less than it did)."
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return StoreConnectionError(
                f"etcd at {endpoint} did not answer {what} ({code.name}: {details})."
            )
        return StoreError(f"etcd at {endpoint} failed {what} ({code.name}: {details}).")

    def _call(
        self,
        what: str,
        fn: Callable[[_Channel, Any, float], T],
        timeout_s: float | None = None,
        observe: bool = False,
    ) -> T:
        """One RPC (see :meth:`_failing_over`); with ``observe``, a linearizable one whose
        answer's header is compared with what etcd said before it was sent (see
        :meth:`_observe`)."""
        started = time.monotonic()
        floor, forgets = self._seen_revision, self._forgets
        try:
            resp = self._failing_over(what, fn, timeout_s)
        finally:
            if self.on_request is not None:
                self.on_request(time.monotonic() - started)
        if observe and forgets == self._forgets:  # else: compared with what etcd forgot
            self._observe(resp.header, floor)  # type: ignore[attr-defined]
        return resp

    def _failing_over(
        self, what: str, fn: Callable[[_Channel, Any, float], T], timeout_s: float | None = None
    ) -> T:
        """Run one RPC, failing over between endpoints and renewing the auth token.

        ``fn`` gets the channel, the call metadata and the attempt's timeout. With several
        endpoints, one attempt may take a share of ``timeout_s`` only, so that a member that
        hangs leaves time to ask the others; refused or unanswered attempts move on to the
        next endpoint until ``timeout_s`` has passed.
        """
        if self._closed:
            raise StoreError(f"The connection to {self.description} is closed.")
        budget_s = self._settings.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget_s
        reauthed = False
        tried: list[str] = []
        while True:
            with self._lock:
                ch = self._channels[self._current]
                md = self._metadata()
            left = deadline - time.monotonic()
            try:
                return fn(ch, md, max(0.05, min(left, self._attempt_s)))
            except grpc.RpcError as exc:
                if exc.code() in _RETRY_CODES:
                    tried.append(f"{ch.endpoint} ({exc.code().name}: {exc.details()})")
                    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                        self._suspect(ch, f"{what} got no answer")
                    else:
                        self._rotate(ch)
                    if time.monotonic() < deadline:
                        if len(tried) % len(self._channels) == 0:
                            time.sleep(0.1)
                        continue
                    raise StoreConnectionError(
                        f"No etcd endpoint answered {what} within {budget_s:g} s; tried "
                        f"{', '.join(dict.fromkeys(tried))}."
                    ) from exc
                if _is_token_invalid(exc) and self._settings.user and not reauthed:
                    reauthed = True
                    log.info("Renewing the etcd auth token at %s.", ch.endpoint)
                    self._authenticate(ch)
                    continue
                raise self._translate(exc, ch.endpoint, what) from exc

    def _rotate(self, ch: _Channel) -> None:
        """Move on from ``ch`` to the next endpoint (if ``ch`` is still the current one)."""
        with self._lock:
            if self._channels[self._current] is ch and len(self._channels) > 1:
                self._current = (self._current + 1) % len(self._channels)

    def _suspect(self, ch: _Channel, why: str) -> None:
        """``ch``'s member did not answer in time: leave it, with the lease keep-alive stream
        and every watch on it (they resume on the next member from their last revision)."""
        if len(self._channels) < 2:
            return
        with self._lock:
            moved = self._channels[self._current] is ch
            watches = list(self._watches)
        self._rotate(ch)
        if moved:
            log.warning(
                "etcd member %s does not answer (%s); moving to %s.",
                ch.endpoint,
                why,
                self._channels[self._current].endpoint,
            )
        self._keepalive.leave(ch)
        for w in watches:
            w.leave(ch)

    # ---------------------------------------------------------------- KV

    def get(self, key: str, revision: int = 0) -> KeyValue | None:
        request = etcdrpc.RangeRequest(key=_b(key), revision=revision)
        resp = self._call(
            f"get {key}" + (f" at revision {revision}" if revision else ""),
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return _kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, revision: int = 0) -> PrefixSnapshot:
        request = etcdrpc.RangeRequest(
            key=_b(prefix), range_end=prefix_range_end(_b(prefix)), revision=revision
        )
        resp = self._call(
            f"get prefix {prefix}" + (f" at revision {revision}" if revision else ""),
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return PrefixSnapshot(tuple(_kv(kv) for kv in resp.kvs), resp.header.revision)

    def get_range(self, start: str, end: str) -> PrefixSnapshot:
        request = etcdrpc.RangeRequest(key=_b(start), range_end=_b(end))
        resp = self._call(
            f"get the keys from {start} to {end}",
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return PrefixSnapshot(tuple(_kv(kv) for kv in resp.kvs), resp.header.revision)

    def last_created(self, prefix: str, before: int) -> PrefixSnapshot:
        request = etcdrpc.RangeRequest(
            key=_b(prefix),
            range_end=prefix_range_end(_b(prefix)),
            limit=1,
            sort_order=etcdrpc.RangeRequest.DESCEND,
            sort_target=etcdrpc.RangeRequest.CREATE,
            # 0 would mean no bound to etcd; nothing is created before revision 1 (count only).
            max_create_revision=before - 1,
            count_only=before <= 1,
        )
        resp = self._call(
            f"get the last key created under {prefix} before revision {before}",
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return PrefixSnapshot(tuple(_kv(kv) for kv in resp.kvs), resp.header.revision)

    def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        request = etcdrpc.PutRequest(key=_b(key), value=value, lease=lease)
        resp = self._call(
            f"put {key}",
            lambda ch, md, t: ch.kv.Put(request, timeout=t, metadata=md),
            observe=True,
        )
        return int(resp.header.revision)

    def delete(self, key: str, *, prefix: bool = False) -> int:
        request = self._delete_request(Delete(key, prefix))
        resp = self._call(
            f"delete {key}",
            lambda ch, md, t: ch.kv.DeleteRange(request, timeout=t, metadata=md),
            observe=True,
        )
        return int(resp.deleted)

    @staticmethod
    def _delete_request(op: Delete) -> Any:
        if op.prefix:
            return etcdrpc.DeleteRangeRequest(
                key=_b(op.key), range_end=prefix_range_end(_b(op.key))
            )
        return etcdrpc.DeleteRangeRequest(key=_b(op.key))

    @staticmethod
    def _request_op(op: Op) -> Any:
        if isinstance(op, Put):
            return etcdrpc.RequestOp(
                request_put=etcdrpc.PutRequest(key=_b(op.key), value=op.value, lease=op.lease)
            )
        if isinstance(op, Delete):
            return etcdrpc.RequestOp(request_delete_range=EtcdStore._delete_request(op))
        range_end = prefix_range_end(_b(op.key)) if op.prefix else b""
        return etcdrpc.RequestOp(
            request_range=etcdrpc.RangeRequest(key=_b(op.key), range_end=range_end)
        )

    @staticmethod
    def _compare(c: Compare) -> Any:
        msg = etcdrpc.Compare(key=_b(c.key), result=etcdrpc.Compare.EQUAL)
        if c.target is CompareTarget.CREATE:
            msg.target, msg.create_revision = etcdrpc.Compare.CREATE, c.revision
        else:
            msg.target, msg.mod_revision = etcdrpc.Compare.MOD, c.revision
        return msg

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        request = etcdrpc.TxnRequest(
            compare=[self._compare(c) for c in compare],
            success=[self._request_op(op) for op in success],
            failure=[self._request_op(op) for op in failure],
        )
        keys = ",".join(c.key for c in compare) or "(unconditional)"
        resp = self._call(
            f"transaction on {keys}",
            lambda ch, md, t: ch.kv.Txn(request, timeout=t, metadata=md),
            observe=True,
        )
        gets = tuple(
            tuple(_kv(kv) for kv in r.response_range.kvs)
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        )
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), gets)

    def compact(self, revision: int) -> None:
        request = etcdrpc.CompactionRequest(revision=revision, physical=True)
        self._call(
            f"compact to {revision}",
            lambda ch, md, t: ch.kv.Compact(request, timeout=t, metadata=md),
        )

    # ---------------------------------------------------------------- leases

    def grant_lease(self, ttl_s: int) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=ttl_s)
        resp = self._call(
            "grant a lease",
            lambda ch, md, t: ch.lease.LeaseGrant(request, timeout=t, metadata=md),
        )
        if resp.error:
            raise StoreError(f"{self.description} refused a lease of {ttl_s} s: {resp.error}.")
        return int(resp.ID)

    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        if self._closed:
            raise StoreError(f"The connection to {self.description} is closed.")
        limit = self._settings.request_timeout_s
        wait_s = min(limit, timeout_s) if timeout_s else limit
        if len(self._channels) > 1:
            # Half the time left at most: a member that hangs leaves the other half to
            # refresh through another before the lease runs out. (With one member, waiting
            # longer is the only hope: an overloaded etcd answers late, not never.)
            wait_s = min(wait_s / 2, self._attempt_s)
        return self._keepalive.refresh(lease_id, wait_s)

    def revoke_lease(self, lease_id: int) -> None:
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call(
                f"revoke lease {lease_id:x}",
                lambda ch, md, t: ch.lease.LeaseRevoke(request, timeout=t, metadata=md),
            )
        except StoreError as exc:
            if "lease not found" not in str(exc):
                raise

    # ---------------------------------------------------------------- watches

    def watch(
        self,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        sink: WatchSink | None = None,
    ) -> Watch:
        if start_revision is None:
            start_revision = self._revision_now(key) + 1
        w = _EtcdWatch(self, key, prefix, start_revision, sink)
        with self._lock:
            self._watches.add(w)
        w.start()
        return w

    def _revision_now(self, key: str) -> int:
        request = etcdrpc.RangeRequest(key=_b(key), count_only=True)
        resp = self._call(
            f"get {key}",
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return int(resp.header.revision)

    # ---------------------------------------------------------------- forgetting

    def _observe(self, header: Any, floor: int) -> None:
        """A linearizable answer's header (its revision is etcd's newest when it answered):
        compare it with what etcd said before; a new cluster id, or a revision below
        ``floor`` (the highest seen when the request was sent: every revision seen then was
        applied before this request), means it forgot. (Below a revision seen *after* it
        was sent is no sign: answers to requests sent at once may arrive in any order.)"""
        cluster_id, revision = int(header.cluster_id), int(header.revision)
        why = ""
        with self._lock:
            known, seen = self._cluster_id, self._seen_revision
            if known and cluster_id and cluster_id != known:
                why = (
                    f"its cluster id changed from {known:x} to {cluster_id:x} (it was made anew: "
                    "its data directory was lost, or it was restored from a backup)"
                )
            elif revision < floor:
                why = (
                    f"its revision is {revision}, below the {floor} it reported before (it was "
                    "restored from a backup, or its data directory was lost)"
                )
            if why:
                self._cluster_id, self._seen_revision = cluster_id, revision
                self._forgets += 1
            else:
                self._cluster_id = cluster_id or known
                self._seen_revision = max(seen, revision)
        if why:
            self._forgotten(why)

    def _suspect_forgotten(self, header: Any = None) -> None:
        """An answer that is not linearizable (a keep-alive, a watch event) or an error hints
        that etcd forgot: check with a linearizable read, on a thread (once at a time)."""
        if header is not None:
            with self._lock:
                known, seen = self._cluster_id, self._seen_revision
            cluster_id, revision = int(header.cluster_id), int(header.revision)
            if (not known or cluster_id in (0, known)) and revision >= seen:
                return
        with self._lock:
            if self._confirming or self._closed:
                return
            self._confirming = True

        def confirm() -> None:
            try:
                self._revision_now("/")
            except StoreError as exc:
                log.debug("Could not check whether etcd forgot: %s", exc)
            finally:
                with self._lock:
                    self._confirming = False

        threading.Thread(target=confirm, name="efdl-etcd-check", daemon=True).start()

    def _forgotten(self, why: str) -> None:
        """etcd forgot what it held: every watch re-lists, the listeners are told."""
        log.error(
            "etcd at %s has forgotten what it held: %s. Every watch reads what is there now, "
            "and this node writes its records again.",
            self._settings.endpoint_list,
            why,
        )
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.recheck()
        self._forgot(why)

    def _forget(self, w: _EtcdWatch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _stream_channel(self) -> tuple[_Channel, Any]:
        """The channel (and auth metadata) a long-lived stream opens on now: watches and
        lease keep-alives, which fail over by opening again."""
        with self._lock:
            return self._channels[self._current], self._metadata()

    def _watch_failed_over(self, ch: _Channel, exc: grpc.RpcError) -> None:
        """A watch stream broke: move on to the next endpoint, renew the token if needed."""
        if _is_token_invalid(exc) and self._settings.user:
            try:
                self._authenticate(ch)
            except StoreError as auth_exc:
                log.warning("%s", auth_exc)
            return
        self._rotate(ch)

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.cancel()
        self._keepalive.close()
        self._closed = True
        for ch in self._channels:
            ch.close()


class _KeepAliveStream:
    """One long-lived LeaseKeepAlive stream per store, shared by all its leases.

    A refresh is one message on it, not a new stream (and thread) per call: at hundreds of
    agents per process that is the difference between idle and busy. The stream is reopened,
    on the next endpoint if need be, after any error.
    """

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._requests: queue.Queue[Any] | None = None
        self._call: Any = None
        self._channel: _Channel | None = None  # where the open stream goes
        self._waiters: dict[int, list[_Waiter]] = {}

    def refresh(self, lease_id: int, timeout_s: float) -> int:
        waiter = _Waiter()
        with self._lock:
            requests = self._requests or self._open()
            self._waiters.setdefault(lease_id, []).append(waiter)
            ch = self._channel
        requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        if not waiter.done.wait(timeout_s):
            with self._lock:
                if waiter in self._waiters.get(lease_id, []):
                    self._waiters[lease_id].remove(waiter)
            self._reset(f"no answer within {timeout_s:g} s")
            if ch is not None:  # the next refresh goes to another member
                self._store._suspect(ch, f"a lease refresh got no answer in {timeout_s:.1f} s")
            raise StoreConnectionError(
                f"etcd at {self._store.settings.endpoint_list} did not answer the refresh of "
                f"lease {lease_id:x} within {timeout_s:g} s."
            )
        if waiter.error is not None:
            raise waiter.error
        return waiter.ttl

    def _open(self) -> queue.Queue[Any]:
        """Open the stream (caller holds the lock)."""
        ch, md = self._store._stream_channel()
        requests: queue.Queue[Any] = queue.Queue()
        call = ch.lease.LeaseKeepAlive(_drain(requests), metadata=md)
        self._requests, self._call, self._channel = requests, call, ch
        threading.Thread(
            target=self._read, args=(call, requests, ch), name="efdl-keepalive", daemon=True
        ).start()
        return requests

    def _read(self, call: Any, requests: queue.Queue[Any], ch: _Channel) -> None:
        error: StoreError | None = None
        try:
            for resp in call:
                self._store._suspect_forgotten(resp.header)
                with self._lock:
                    waiters = self._waiters.pop(int(resp.ID), [])
                for w in waiters:
                    w.ttl = int(resp.TTL)  # 0: the lease has expired (not an error)
                    w.done.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._store._watch_failed_over(ch, exc)
                error = self._store._translate(exc, ch.endpoint, "refresh a lease")
        with self._lock:
            if self._requests is requests:
                self._requests, self._call = None, None
            if self._requests is None:  # fail whoever still waits on this stream
                waiters = [w for ws in self._waiters.values() for w in ws]
                self._waiters.clear()
            else:
                waiters = []
        requests.put(None)
        for w in waiters:
            w.error = error or StoreConnectionError(
                f"The lease keep-alive stream to {self._store.description} ended."
            )
            w.done.set()

    def _reset(self, why: str) -> None:
        with self._lock:
            call, requests = self._call, self._requests
            self._requests, self._call = None, None
        if call is not None:
            log.debug("Reopening the lease keep-alive stream: %s.", why)
            call.cancel()
        if requests is not None:
            requests.put(None)

    def leave(self, ch: _Channel) -> None:
        """Reopen the stream elsewhere if it goes to ``ch``."""
        with self._lock:
            on_it = self._channel is ch and self._call is not None
        if on_it:
            self._reset(f"leaving {ch.endpoint}")

    def close(self) -> None:
        self._reset("closing")


class _Waiter:
    __slots__ = ("done", "error", "ttl")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ttl = 0
        self.error: StoreError | None = None


def _drain(requests: queue.Queue[Any]) -> Iterator[Any]:
    """A request stream fed from a queue; ends at None."""
    while (item := requests.get()) is not None:
        yield item


def _hold_open(first: Any, done: threading.Event) -> Iterator[Any]:
    """A request stream of one message that stays open until ``done`` (the stream ended)."""
    yield first
    done.wait()


class _EtcdWatch(Watch):
    """One watch: a thread that keeps a gRPC watch stream open and resumes it after errors."""

    def __init__(
        self,
        store: EtcdStore,
        key: str,
        prefix: bool,
        start_revision: int,
        sink: WatchSink | None,
    ) -> None:
        super().__init__(
            f"watch {'prefix ' if prefix else ''}{key} on {store.description}", sink=sink
        )
        self._store = store
        self._key = key
        self._prefix = prefix
        self._next_revision = start_revision
        self._call: Any = None
        self._call_channel: _Channel | None = None
        self._call_lock = threading.Lock()
        # Before the stream opens again, check that etcd has the revision to resume from (it
        # may have forgotten: then there is nothing to resume, and the watch re-lists).
        self._check = False
        self._thread = threading.Thread(target=self._run, name=f"efdl-watch{key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _create_request(self) -> Any:
        create = etcdrpc.WatchCreateRequest(key=_b(self._key), start_revision=self._next_revision)
        if self._prefix:
            create.range_end = prefix_range_end(_b(self._key))
        return etcdrpc.WatchRequest(create_request=create)

    def _run(self) -> None:
        backoff = 0.1
        failures = 0
        while not self.cancelled:
            ch, md = self._store._stream_channel()
            stream_done = threading.Event()
            try:
                if self._check or failures:
                    self._resume_or_relist()
                    self._check = False
                request_stream = _hold_open(self._create_request(), stream_done)
                call = ch.watch.Watch(request_stream, metadata=(*(md or ()), _REQUIRE_LEADER))
                with self._call_lock:
                    self._call, self._call_channel = call, ch
                if self.cancelled or self._check:  # cancelled, or etcd forgot, meanwhile
                    call.cancel()
                for response in call:
                    backoff, failures = 0.1, 0
                    if not self._handle(response):
                        break
            except grpc.RpcError as exc:
                if self.cancelled:
                    break
                if _is_auth_failure(exc) and not _is_token_invalid(exc):
                    self._deliver(self._store._translate(exc, ch.endpoint, self.description))
                    break
                failures += 1
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "The %s broke (%s: %s); resuming from revision %d.",
                    self.description,
                    exc.code().name,
                    exc.details(),
                    self._next_revision,
                )
                self._store._watch_failed_over(ch, exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except StoreError as exc:  # from a re-list (after compaction, or forgetting)
                if not self.cancelled:
                    log.warning("The %s could not re-list (%s); retrying.", self.description, exc)
                    time.sleep(backoff)
            finally:
                stream_done.set()
        self._store._forget(self)

    def _handle(self, response: Any) -> bool:
        """Deliver one response; False when the stream must be re-opened."""
        self._store._suspect_forgotten(response.header)
        if response.compact_revision:
            self._relist(response.compact_revision)
            return False
        if response.canceled:
            reason = response.cancel_reason or "no reason given"
            if "permission denied" in reason.lower():
                self._deliver(StoreAuthError(f"etcd refused the {self.description}: {reason}."))
                self.cancel()
            return False
        if not response.events:
            return True
        events = []
        for ev in response.events:
            kind = EventType.DELETE if ev.type == kv_pb2.Event.DELETE else EventType.PUT
            events.append(WatchEvent(kind, _kv(ev.kv)))
        last = max(e.kv.mod_revision for e in events)
        self._next_revision = last + 1
        self._deliver(WatchBatch(tuple(events), max(last, response.header.revision)))
        return True

    def _resume_or_relist(self) -> None:
        """Before resuming from ``_next_revision``: re-list if etcd's revision is below the
        last one delivered (it forgot: a resumed watch would wait for events that never
        come)."""
        now = self._store._revision_now(self._key)
        if now < self._next_revision - 1:
            log.warning(
                "The %s would resume from revision %d, but etcd is at revision %d; re-listing.",
                self.description,
                self._next_revision,
                now,
            )
            self._relist_now()

    def recheck(self) -> None:
        """etcd forgot: open the stream again, checking first where etcd stands."""
        self._check = True
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def _relist(self, compact_revision: int) -> None:
        log.warning(
            "The %s asked for revision %d, compacted up to %d; re-listing.",
            self.description,
            self._next_revision,
            compact_revision,
        )
        self._relist_now()

    def _relist_now(self) -> None:
        """Deliver what is there now as a reset batch, and watch on from there."""
        if self._prefix:
            snap = self._store.get_prefix(self._key)
            kvs, revision = snap.kvs, snap.revision
        else:
            txn = self._store.txn([], [Get(self._key)])
            kvs, revision = txn.gets[0], txn.revision
        events = tuple(WatchEvent(EventType.PUT, kv) for kv in kvs)
        self._deliver(WatchBatch(events, revision, reset=True))
        self._next_revision = revision + 1

    def _on_cancel(self) -> None:
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def leave(self, ch: _Channel) -> None:
        """Resume on another member if the stream goes to ``ch`` (which does not answer)."""
        with self._call_lock:
            if self._call is not None and self._call_channel is ch:
                self._call.cancel()


__all__ = ["EtcdStore"]


def _certificate_refused(detail: str) -> bool:
    """Whether a connect error is the server refusing our (missing) client certificate."""
    return "BAD_CERTIFICATE" in detail or "CERTIFICATE_REQUIRED" in detail
