"""LatestPublisher: newest value wins, failures retried, the caller never waits."""

from __future__ import annotations

import threading
import time

import pytest

from efdl.errors import StoreError
from efdl.launcher import publish
from efdl.launcher.publish import LatestPublisher
from tests.wait import wait_until


def test_offers_never_wait_and_only_the_newest_is_written_after_a_slow_put() -> None:
    written: list[bytes] = []
    slow = threading.Event()

    def put(value: bytes) -> None:
        if value == b"1":
            slow.wait(5)
        written.append(value)

    p = LatestPublisher(put, "test")
    t0 = time.monotonic()
    for i in range(1, 6):
        p.offer(str(i).encode())
        time.sleep(0.02)
    assert time.monotonic() - t0 < 1.0  # the put of "1" blocks its thread, not the caller
    slow.set()
    wait_until("the newest value written", lambda: written and written[-1] == b"5", 5)
    p.close(1.0)
    assert written == [b"1", b"5"]


def test_a_failed_put_is_retried_until_it_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publish, "RETRY_S", 0.05)
    attempts: list[bytes] = []

    def put(value: bytes) -> None:
        attempts.append(value)
        if len(attempts) < 3:
            raise StoreError("etcd down")

    p = LatestPublisher(put, "test")
    p.offer(b"7")
    wait_until("three attempts", lambda: len(attempts) >= 3, 5)
    p.offer(b"8")  # after the success, the next value is the next put: no "7" again
    wait_until("the next value", lambda: attempts[-1] == b"8", 5)
    p.close(1.0)
    assert attempts == [b"7", b"7", b"7", b"8"]
