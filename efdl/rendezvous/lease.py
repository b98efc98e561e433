"""A lease held alive by a background thread: the proof that this agent is alive.

Every key an agent writes about itself is bound to its lease, so the keys vanish when the
agent dies or is cut off from etcd for longer than the TTL. The session notices the loss
itself (fencing): a refresh answered with TTL 0, or no successful refresh for a whole TTL,
means every key bound to the lease may be gone, and the owner must stop acting as a member.
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
        on_expired: called once, from the keep-alive thread, with the reason, when the lease
            expires (or cannot be renewed in time, which counts the same). Keep it short
            (set an event, signal a thread).
        clock: monotonic seconds; an argument for tests.
    """

    def __init__(
        self,
        store: KVStore,
        ttl_s: int,
        on_expired: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 2:
            raise ConfigError(f"The lease TTL ({ttl_s} s) must be at least 2 seconds.")
        self._store = store
        self._ttl_s = ttl_s
        self._on_expired = on_expired
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
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"efdl-lease-{self.lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    @property
    def expired(self) -> bool:
        """Whether the lease is gone, or must be assumed gone: declared so by the keep-alive
        (:attr:`why_expired`), or a whole TTL passed since the last renewal."""
        return bool(self._why_expired) or self._clock() - self._last_ok >= self._ttl_s

    @property
    def why_expired(self) -> str:
        """Why the keep-alive declared the lease expired; empty until it does."""
        return self._why_expired

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if the lease is (or must be assumed) gone."""
        if self.expired:
            raise LeaseLostError(
                self._why_expired
                or f"Lease {self.lease_id:x} was not renewed for a whole TTL ({self._ttl_s} s)."
            )

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
        while not self._stop.wait(max(0.0, next_at - self._clock())):
            sent = self._clock()
            # The server counts the TTL from a refresh it received, at the latest from `sent`:
            # never wait on one refresh past the moment the lease may have expired.
            left_s = self._ttl_s - (sent - self._last_ok)
            try:
                ttl = self._store.refresh_lease(self.lease_id, timeout_s=max(0.2, left_s))
            except StoreError as exc:
                silent_s = self._clock() - self._last_ok
                if silent_s >= self._ttl_s:
                    self._declare_expired(
                        f"Lease {self.lease_id:x} on {self._store.description} was not renewed "
                        f"for {silent_s:.1f} s (TTL {self._ttl_s} s): {exc}. It must be taken "
                        "as expired."
                    )
                    return
                log.warning(
                    "Could not renew lease %x (%.1f s since the last renewal, TTL %d s): %s",
                    self.lease_id,
                    silent_s,
                    self._ttl_s,
                    exc,
                )
                # Retry soon: the store has moved on to another member if this one hung.
                next_at = self._clock() + min(0.25, self._ttl_s / 6)
                continue
            if ttl <= 0:
                self._declare_expired(
                    f"Lease {self.lease_id:x} on {self._store.description} has expired "
                    "(etcd answered TTL 0); every key bound to it is gone."
                )
                return
            self._last_ok = sent
            next_at = sent + self._ttl_s / 3

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
