"""Write the newest of a stream of values to etcd on a thread of its own.

The agent publishes each persisted step of the cache (``/efdl/<job>/cache``). Done on the
agent's event loop, a slow or unreachable etcd held the loop for the store's timeout per
step (5 s), and a backlog of steps kept it from handling the lost lease behind them: the
node could not learn that its lease was gone. Here the loop only hands the value over; the newest
value that came while a put was under way replaces the older ones (only the newest step
matters), and a failed put is retried until a newer value or ``close``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from efdl.errors import StoreError

log = logging.getLogger(__name__)

RETRY_S = 1.0


class LatestPublisher:
    """Puts the newest offered value with ``put``; a ``StoreError`` is logged and retried.

    Args:
        put: writes one value (e.g. a record's JSON under its key).
        name: what the value is, for the log and the thread.
    """

    def __init__(self, put: Callable[[bytes], object], name: str) -> None:
        self._put = put
        self._name = name
        self._cond = threading.Condition()
        self._pending: bytes | None = None
        self._closed = False
        self._failing = False  # the last put failed (and the log said so)
        self._thread = threading.Thread(target=self._run, name=f"efdl-{name}", daemon=True)
        self._thread.start()

    def offer(self, value: bytes) -> None:
        """Publish ``value`` soon, instead of any value not yet published."""
        with self._cond:
            self._pending = value
            self._cond.notify()

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop; wait up to ``timeout_s`` for a put under way."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending is not None)
                if self._closed:
                    return
                value, self._pending = self._pending, None
            assert value is not None
            try:
                self._put(value)
            except StoreError as exc:
                # Said once per outage: an etcd away for minutes would fill the log.
                level = logging.DEBUG if self._failing else logging.WARNING
                log.log(level, "Could not publish the %s (retrying): %s", self._name, exc)
                self._failing = True
                with self._cond:
                    if self._pending is None:
                        self._pending = value
                    self._cond.wait(RETRY_S)
                continue
            if self._failing:
                self._failing = False
                log.info("Published the %s again.", self._name)
