"""A lease held alive by a background thread: the proof that this agent is alive.

Every key an agent writes about itself is bound to its lease, so the keys vanish when the
agent dies or is cut off from etcd for longer than the TTL. Only etcd can say that a lease is
gone (a refresh answered with TTL 0): silence says nothing, since a restarted etcd, or a
new raft leader, extends every lease it holds. So while etcd does not answer, the session
keeps asking (the owner's workers train on meanwhile: etcd is not on the training path), and
the owner learns of the loss from etcd's own answer, when there is one, and registers again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from efdl.errors import ConfigError, LeaseLostError, StoreConnectionError, StoreError
from efdl.rendezvous.api import KVStore

log = logging.getLogger(__name__)


class LeaseSession:
    """Grants a lease of ``ttl_s`` seconds and refreshes it every ``ttl_s / 3``.

    Args:
        store: where the lease lives.
        ttl_s: the lease's time to live. A dead agent is noticed after at most this long;
            it must be longer than the longest stall (GC pause, etcd leader election) that
            should *not* count as death.
        on_expired: called once, from the keep-alive thread, with the reason, when etcd says
            the lease has expired (or was revoked). Keep it short (set an event, signal a
            thread).
        on_silent: called from the keep-alive thread when a whole TTL passed without an
            answer (etcd is away; the lease may or may not hold), once per such silence.
        clock: monotonic seconds; an argument for tests.
        on_contact: called with the monotonic time a request was sent whose answer shows
            the lease alive (the grant, then each refresh etcd answered with a TTL): this
            agent reached etcd then, at the latest (efdl.worker.fence). Keep it short.
    """

    def __init__(
        self,
        store: KVStore,
        ttl_s: int,
        on_expired: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_silent: Callable[[], None] | None = None,
        on_contact: Callable[[float], None] | None = None,
    ) -> None:
        if ttl_s < 2:
            raise ConfigError(f"The lease TTL ({ttl_s} s) must be at least 2 seconds.")
        self._store = store
        self._ttl_s = ttl_s
        self._on_expired = on_expired
        self._on_silent = on_silent
        self._on_contact = on_contact
        self._clock = clock
        self._stop = threading.Event()
        self._why_expired = ""
        self._last_ok = clock()
        self.lease_id = store.grant_lease(ttl_s)
        granted_in = clock() - self._last_ok
        if granted_in >= ttl_s:
            # The server counts the TTL from when it got the request: the lease may be gone
            # already, and a member whose lease counts as expired from birth would never act.
            # (Seen after a network partition healed: the grant hung until the link came back.)
            with contextlib.suppress(StoreError):
                store.revoke_lease(self.lease_id)
            raise StoreConnectionError(
                f"{store.description} took {granted_in:.1f} s to grant a lease of TTL "
                f"{ttl_s} s: it may have expired already."
            )
        self._contact(self._last_ok)
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"efdl-lease-{self.lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    @property
    def expired(self) -> bool:
        """Whether etcd said that the lease has expired (:attr:`why_expired`)."""
        return bool(self._why_expired)

    @property
    def why_expired(self) -> str:
        """Why the lease expired, as etcd said it; empty until it does."""
        return self._why_expired

    @property
    def silent_s(self) -> float:
        """Seconds since the last renewal: past the TTL, the lease may have expired in etcd
        (the keys bound to it may be gone), or etcd may still hold it (it was away)."""
        return self._clock() - self._last_ok

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if etcd said the lease is gone."""
        if self._why_expired:
            raise LeaseLostError(self._why_expired)

    def _declare_expired(self, reason: str) -> None:
        """Record the loss, then run the callback (once)."""
        if self._why_expired:
            return
        self._why_expired = reason
        log.error("%s", reason)
        if self._on_expired is not None:
            try:
                self._on_expired(reason)
            except Exception:
                log.exception("The lease-expired callback failed.")

    def _keep_alive(self) -> None:
        # Timed from the grant's request, which may have taken a while (the server's TTL runs
        # from when it got it), then from each successful refresh's.
        next_at = self._last_ok + self._ttl_s / 3
        warned = False  # the TTL passed without an answer, and the log said so
        failures = 0  # refreshes that failed in a row
        while not self._stop.wait(max(0.0, next_at - self._clock())):
            sent = self._clock()
            # The server counts the TTL from a refresh it received, at the latest from `sent`:
            # never wait on one refresh past the moment the lease may have expired (another
            # member may answer in time); after that, a refresh may take a third of the TTL.
            left_s = self._ttl_s - (sent - self._last_ok)
            wait_s = max(0.2, left_s) if left_s > 0 else max(0.5, self._ttl_s / 3)
            try:
                ttl = self._store.refresh_lease(self.lease_id, timeout_s=wait_s)
            except StoreError as exc:
                silent_s = self._clock() - self._last_ok
                if silent_s >= self._ttl_s and not warned:
                    warned = True
                    log.warning(
                        "Lease %x on %s was not renewed for %.1f s (TTL %d s): %s It may have "
                        "expired there; this node goes on as it is and asks again until etcd "
                        "answers.",
                        self.lease_id,
                        self._store.description,
                        silent_s,
                        self._ttl_s,
                        _sentence(exc),
                    )
                    if self._on_silent is not None:
                        self._on_silent()
                else:  # the first failure says it; the next ones, and the TTL, are enough
                    log.log(
                        logging.DEBUG if failures else logging.WARNING,
                        "Could not renew lease %x (%.1f s since the last renewal, TTL %d s): %s",
                        self.lease_id,
                        silent_s,
                        self._ttl_s,
                        exc,
                    )
                failures += 1
                # Retry soon: the store has moved on to another member if this one hung.
                next_at = self._clock() + min(0.25, self._ttl_s / 6)
                continue
            if ttl <= 0:
                self._declare_expired(
                    f"Lease {self.lease_id:x} on {self._store.description} has expired "
                    "(etcd answered TTL 0); every key bound to it is gone."
                )
                return
            if warned:
                log.warning(
                    "Lease %x on %s renewed after %.1f s without an answer: it held.",
                    self.lease_id,
                    self._store.description,
                    sent - self._last_ok,
                )
                warned = False
            self._last_ok, failures = sent, 0
            self._contact(sent)
            next_at = sent + self._ttl_s / 3

    def _contact(self, sent: float) -> None:
        if self._on_contact is not None:
            try:
                self._on_contact(sent)
            except Exception:
                log.exception("The lease-contact callback failed.")

    def close(self, revoke: bool = True) -> None:
        """Stop refreshing; with ``revoke`` end the lease now so its keys go at once."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._ttl_s)
        if revoke and not self._why_expired:
            try:
                self._store.revoke_lease(self.lease_id)
            except StoreError as exc:
                log.warning("Could not revoke lease %x: %s", self.lease_id, exc)

    def __enter__(self) -> LeaseSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _sentence(exc: BaseException) -> str:
    """``exc``'s message ending with one full stop."""
    text = str(exc).rstrip()
    return text if text.endswith(".") else text + "."
