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

The gRPC channels, messages and error tests are efdl.rendezvous.etcd_channel's; the lease
keep-alive stream efdl.rendezvous.etcd_keepalive's; the watches efdl.rendezvous.etcd_watch's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

# The agent forks workers that exec at once: gRPC's fork handlers only print warnings then.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC's C core logs failed TLS handshakes to stderr at info level; efdl says it clearly.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import grpc._common
from etcd3 import etcdrpc
from etcd3.utils import prefix_range_end

from efdl.errors import CompactedError, StoreAuthError, StoreConnectionError, StoreError
from efdl.rendezvous.api import (
    NO_LEASE,
    Compare,
    Delete,
    Endpoint,
    EtcdSettings,
    KeyValue,
    KVStore,
    Op,
    PrefixSnapshot,
    TxnResult,
    Watch,
    WatchSink,
)
from efdl.rendezvous.etcd_channel import (
    RETRY_CODES,
    EtcdChannel,
    certificate_refused,
    delete_request,
    is_auth_failure,
    is_token_invalid,
    key_bytes,
    key_value,
    request_op,
    tls_credentials,
    txn_compare,
)
from efdl.rendezvous.etcd_keepalive import KeepAliveStream
from efdl.rendezvous.etcd_watch import EtcdWatch
from efdl.rendezvous.plaintext import warn_plaintext

log = logging.getLogger(__name__)

T = TypeVar("T")

CONNECT_SAY_EVERY_S = 30.0  # how often a client that waits for etcd at its start says so

# gRPC Python wakes every thread blocked on a stream 10 times a second (only so that Ctrl-C can
# interrupt the main thread). New data still wakes a reader at once through its condition
# variable; the timer only costs CPU: ~10 wakeups/s per open watch or keep-alive stream.
# Once a second is plenty for Ctrl-C. (A private constant: left alone if it ever goes away.)
if isinstance(getattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT", None), float):
    grpc._common.MAXIMUM_WAIT_TIMEOUT = max(grpc._common.MAXIMUM_WAIT_TIMEOUT, 1.0)


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
        self._credentials = tls_credentials(settings)
        self._lock = threading.Lock()
        self._channels = [EtcdChannel(e, self._credentials) for e in settings.endpoints]
        self._current = 0
        self._token: str | None = None
        self._closed = False
        # Called with each request's seconds, failover included (the agent's metrics).
        self.on_request: Callable[[float], None] | None = None
        self._watches: set[EtcdWatch] = set()
        # What etcd's answers said of it so far (see the module docstring, forgetting).
        self._cluster_id = 0
        self._seen_revision = 0
        self._forgets = 0  # how many times etcd was found to have forgotten
        self._confirming = False  # a check of a suspicious header is under way
        # One attempt's share of a request's time when there are members to fail over to.
        n = len(self._channels)
        self._attempt_s = settings.request_timeout_s / min(n, 3) if n > 1 else float("inf")
        self._connect()
        self._keepalive = KeepAliveStream(self)

    # ---------------------------------------------------------------- plumbing

    @property
    def description(self) -> str:
        return f"etcd at {self._settings.endpoint_list}"

    @property
    def settings(self) -> EtcdSettings:
        return self._settings

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
                    refusals += certificate_refused(exc.details() or "")
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
        if certificate_refused(detail):
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

    def _authenticate(self, ch: EtcdChannel) -> None:
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
        if is_auth_failure(exc) or "permission denied" in (details or "").lower():
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
        fn: Callable[[EtcdChannel, Any, float], T],
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
        self, what: str, fn: Callable[[EtcdChannel, Any, float], T], timeout_s: float | None = None
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
                if exc.code() in RETRY_CODES:
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
                if is_token_invalid(exc) and self._settings.user and not reauthed:
                    reauthed = True
                    log.info("Renewing the etcd auth token at %s.", ch.endpoint)
                    self._authenticate(ch)
                    continue
                raise self._translate(exc, ch.endpoint, what) from exc

    def _rotate(self, ch: EtcdChannel) -> None:
        """Move on from ``ch`` to the next endpoint (if ``ch`` is still the current one)."""
        with self._lock:
            if self._channels[self._current] is ch and len(self._channels) > 1:
                self._current = (self._current + 1) % len(self._channels)

    def _suspect(self, ch: EtcdChannel, why: str) -> None:
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
        request = etcdrpc.RangeRequest(key=key_bytes(key), revision=revision)
        resp = self._call(
            f"get {key}" + (f" at revision {revision}" if revision else ""),
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return key_value(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, revision: int = 0) -> PrefixSnapshot:
        request = etcdrpc.RangeRequest(
            key=key_bytes(prefix), range_end=prefix_range_end(key_bytes(prefix)), revision=revision
        )
        resp = self._call(
            f"get prefix {prefix}" + (f" at revision {revision}" if revision else ""),
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return PrefixSnapshot(tuple(key_value(kv) for kv in resp.kvs), resp.header.revision)

    def get_range(self, start: str, end: str) -> PrefixSnapshot:
        request = etcdrpc.RangeRequest(key=key_bytes(start), range_end=key_bytes(end))
        resp = self._call(
            f"get the keys from {start} to {end}",
            lambda ch, md, t: ch.kv.Range(request, timeout=t, metadata=md),
            observe=True,
        )
        return PrefixSnapshot(tuple(key_value(kv) for kv in resp.kvs), resp.header.revision)

    def last_created(self, prefix: str, before: int) -> PrefixSnapshot:
        request = etcdrpc.RangeRequest(
            key=key_bytes(prefix),
            range_end=prefix_range_end(key_bytes(prefix)),
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
        return PrefixSnapshot(tuple(key_value(kv) for kv in resp.kvs), resp.header.revision)

    def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        request = etcdrpc.PutRequest(key=key_bytes(key), value=value, lease=lease)
        resp = self._call(
            f"put {key}",
            lambda ch, md, t: ch.kv.Put(request, timeout=t, metadata=md),
            observe=True,
        )
        return int(resp.header.revision)

    def delete(self, key: str, *, prefix: bool = False) -> int:
        request = delete_request(Delete(key, prefix))
        resp = self._call(
            f"delete {key}",
            lambda ch, md, t: ch.kv.DeleteRange(request, timeout=t, metadata=md),
            observe=True,
        )
        return int(resp.deleted)

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        request = etcdrpc.TxnRequest(
            compare=[txn_compare(c) for c in compare],
            success=[request_op(op) for op in success],
            failure=[request_op(op) for op in failure],
        )
        keys = ",".join(c.key for c in compare) or "(unconditional)"
        resp = self._call(
            f"transaction on {keys}",
            lambda ch, md, t: ch.kv.Txn(request, timeout=t, metadata=md),
            observe=True,
        )
        gets = tuple(
            tuple(key_value(kv) for kv in r.response_range.kvs)
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
        w = EtcdWatch(self, key, prefix, start_revision, sink)
        with self._lock:
            self._watches.add(w)
        w.start()
        return w

    def _revision_now(self, key: str) -> int:
        request = etcdrpc.RangeRequest(key=key_bytes(key), count_only=True)
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

    def _forget(self, w: EtcdWatch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _stream_channel(self) -> tuple[EtcdChannel, Any]:
        """The channel (and auth metadata) a long-lived stream opens on now: watches and
        lease keep-alives, which fail over by opening again."""
        with self._lock:
            return self._channels[self._current], self._metadata()

    def _watch_failed_over(self, ch: EtcdChannel, exc: grpc.RpcError) -> None:
        """A watch stream broke: move on to the next endpoint, renew the token if needed."""
        if is_token_invalid(exc) and self._settings.user:
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


__all__ = ["EtcdStore"]
