"""The agent channel over a real Unix socket: a worker's wait for its next placement is
bounded, and longer while the agent says the job waits for members."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.protocol.messages import Hello, Placed, Placement, Waiting
from efdl.worker.channel import AgentChannel, ChannelServer

Pair = tuple[ChannelServer, AgentChannel, int]


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[Pair]:
    hello = threading.Event()
    pids: list[int] = []

    def on_message(msg: object) -> None:
        if isinstance(msg, Hello):
            pids.append(msg.pid)
            hello.set()

    server = ChannelServer(tmp_path / "agent.sock", on_message)
    worker = AgentChannel(str(tmp_path / "agent.sock"), 0)
    assert hello.wait(10)
    yield server, worker, pids[0]
    server.close()


def placement(generation: int) -> Placement:
    return Placement(generation, 0, 1, 0, 1, 0, 1, "127.0.0.1", 29500)


def test_the_wait_for_a_placement_ends_at_its_deadline(pair: Pair) -> None:
    _, worker, _ = pair
    t0 = time.monotonic()
    assert worker.wait(1, timeout_s=0.3) is None
    assert 0.3 <= time.monotonic() - t0 < 10


def test_a_placement_ends_the_wait(pair: Pair) -> None:
    server, worker, pid = pair
    threading.Timer(0.2, lambda: server.send(pid, Placed(placement(2)))).start()
    got = worker.wait(1, timeout_s=30)
    assert got == placement(2)


def test_a_job_waiting_for_members_extends_the_wait(pair: Pair) -> None:
    server, worker, pid = pair
    server.send(pid, Waiting(60))
    deadline = time.monotonic() + 10  # the message reaches the worker's reader thread
    while worker._waits_until == 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Beyond the 0.2 s timeout the wait goes on; the placement ends it.
    threading.Timer(1.0, lambda: server.send(pid, Placed(placement(2)))).start()
    t0 = time.monotonic()
    assert worker.wait(1, timeout_s=0.2) == placement(2)
    assert time.monotonic() - t0 >= 0.9
