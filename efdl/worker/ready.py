"""Start a new generation only when every one of its ranks can join it.

A node that joins takes seconds to start its worker processes (importing torch alone takes
several). The survivors are told of the new generation at once; if they paused at once they
would sit idle in ``init_process_group`` until the newcomers arrive. Instead each rank
*declares* itself on the new generation's store (a counter): survivors as soon as they are
told, newcomers when they reach ``init_process_group``. The rank whose declaration completes
the count sets a "go" key; survivors keep training until they see it, then all pause at one
step boundary (the pause agreement), so the job stalls only for the rebuild itself.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from efdl.protocol.messages import Placement

log = logging.getLogger(__name__)

READY_KEY = "efdl/ready"
GO_KEY = "efdl/go"


def connect(
    p: Placement, timeout: datetime.timedelta, superseded: Callable[[], bool] | None = None
) -> Any:
    """A client of generation ``p``'s store, waiting up to ``timeout`` for it to answer.

    A superseded generation's store is closed, and a client would retry the refused
    connection for its whole timeout: with ``superseded``, connecting gives up as soon as it
    says so (raising the last connection error).
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        attempt = min(timeout.total_seconds(), 2.0) if superseded else timeout.total_seconds()
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                p.master_addr,
                p.master_port,
                p.world_size,
                False,
                datetime.timedelta(seconds=attempt),
            )
            store.set_timeout(timeout)
            return store
        except RuntimeError:
            if superseded is None or superseded() or time.monotonic() > deadline:
                raise


class ReadinessGate:
    """This worker's declarations, and which generations every rank has declared for.

    Args:
        timeout: bound on connecting to a generation's store.
        all_ranks_s: bound on waiting for every rank of a generation to declare (their
            processes may still be starting: the job's join timeout by default).
    """

    def __init__(self, timeout: datetime.timedelta, all_ranks_s: float = 600.0) -> None:
        self._timeout = timeout
        self._all_ranks = datetime.timedelta(seconds=all_ranks_s)
        self._lock = threading.Lock()
        self._declared: set[int] = set()
        self._closed = threading.Event()
        self._watchers: list[threading.Thread] = []
        atexit.register(self.close)

    def close(self) -> None:
        """Stop watching (at exit): a thread left inside a store call while the interpreter
        shuts down makes the process abort ("terminate called"), and an agent would take
        that exit for a crash."""
        self._closed.set()
        for t in self._watchers:
            t.join(timeout=1.0)

    def declare(
        self, p: Placement, store: Any = None, superseded: Callable[[], bool] | None = None
    ) -> Any:
        """Count this rank in for generation ``p`` (once per generation); returns the store
        client used, or None if this rank had already declared. Connecting happens outside
        the lock, and gives up when ``superseded()``: a generation whose store does not answer
        (its server's node left with it) must not hold up the declarations of the newer
        ones (found in the fleet benchmark: four of seven nodes leaving within a second, the
        leader among them, stood the job still for more than a minute, one connect timeout
        after another)."""
        with self._lock:
            if p.generation in self._declared:
                return None
        if store is None:
            store = connect(p, self._timeout, superseded)
        with self._lock:
            if p.generation in self._declared:
                return None
            if int(store.add(READY_KEY, 1)) >= p.world_size:
                store.set(GO_KEY, "1")
            self._declared.add(p.generation)
            return store

    def declare_and_wait(self, p: Placement, store: Any) -> None:
        """Declare, then wait until every rank of ``p`` has: only then may the group be made,
        whose connect has the collective timeout (a newcomer that arrives first must not
        time out waiting for another that is still importing torch). The wait ends early,
        with an error, when a newer generation closes this one's store, or after the join
        timeout."""
        self.declare(p, store)
        try:
            store.wait([GO_KEY], self._all_ranks)
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
            raise dist.DistStoreError(
                f"Generation {p.generation}: not every one of its {p.world_size} ranks "
                f"declared itself within {self._all_ranks.total_seconds():g} s (the join "
                "timeout); giving up on it."
            ) from exc

    def watch(
        self, p: Placement, superseded: Callable[[], bool], on_go: Callable[[], None]
    ) -> None:
        """In the background: declare for ``p``, wait until every rank has, call ``on_go``.
        Gives up quietly when ``superseded()`` (a newer generation came and this one's store
        went away); calls ``on_go`` at once if the store cannot be reached otherwise."""

        def run() -> None:
            try:
                store = self.declare(p, superseded=superseded) or connect(
                    p, self._timeout, superseded
                )
                # Polled, not waited on: the wait must end at exit and when a newer generation
                # comes (c10d's wait cannot be interrupted, and logs every slice that times
                # out). A superseded generation's store is also closed when the next one is
                # served, which makes check() raise; one whose server died never answers.
                # This rank trains on meanwhile; a newcomer that takes longer than the join
                # timeout to reach its training function is said, once.
                late = time.monotonic() + self._all_ranks.total_seconds()
                said = False
                while not store.check([GO_KEY]):
                    if self._closed.wait(0.1) or superseded():
                        return
                    if not said and time.monotonic() > late:
                        said = True
                        log.warning(
                            "Generation %d: %s of its %d ranks have declared themselves "
                            "after %.0f s (the join timeout); the others (newcomers still "
                            "starting, or setting up before their training functions) are "
                            "waited for while this rank trains on in its generation.",
                            p.generation,
                            store.add(READY_KEY, 0),
                            p.world_size,
                            self._all_ranks.total_seconds(),
                        )
            except Exception as exc:  # the store is gone, or unreachable: pause now
                if superseded():
                    return
                log.warning(
                    "Cannot count ranks in on generation %d's store at %s:%d (%s); pausing now.",
                    p.generation,
                    p.master_addr,
                    p.master_port,
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                )
            on_go()

        t = threading.Thread(target=run, name=f"efdl-ready-{p.generation}", daemon=True)
        self._watchers = [w for w in self._watchers if w.is_alive()] + [t]
        t.start()
