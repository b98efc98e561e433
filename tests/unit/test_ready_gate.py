"""The readiness gate (efdl.worker.ready) with real c10d stores: a generation whose store never
answers does not hold up the declarations of the newer one."""

from __future__ import annotations

import datetime
import socket
import threading
from dataclasses import replace

import pytest
import torch.distributed as dist

from efdl.protocol.messages import Placement
from efdl.worker.ready import ReadinessGate
from tests.wait import wait_until


def placement(generation: int, port: int) -> Placement:
    return Placement(generation, 0, 1, 0, 1, 0, 1, "127.0.0.1", port)


def test_a_generation_whose_store_never_answers_does_not_hold_up_the_next() -> None:
    """Found in the fleet benchmark: the leader (which serves the store) left with three other
    nodes within a second; the stores of the generations it had served took connections and
    never answered, each watcher held the gate's lock through a whole connect timeout, and
    the job stood still for more than a minute. Here the timeout is two minutes: the newer
    generation must go long before one of them could have passed."""
    hole = socket.socket()  # accepts connections into its backlog, never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    server = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60)
    )
    newest = [1]
    gate = ReadinessGate(datetime.timedelta(seconds=120))
    went = threading.Event()
    try:
        gate.watch(placement(1, hole.getsockname()[1]), lambda: newest[0] > 1, lambda: None)
        newest[0] = 2  # the next round came while generation 1's watcher connects
        gate.watch(placement(2, server.port), lambda: newest[0] > 2, went.set)
        assert went.wait(60), "generation 2 waited for generation 1's store"
    finally:
        gate.close()
        hole.close()


def test_a_rank_missing_past_the_join_timeout_is_said_while_the_others_train_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A newcomer that has not reached its training function within the join timeout (its
    setup hangs, say) holds up no one, but its generation waits: the survivors' watch says
    how many ranks declared, once, and keeps waiting; when the last declares, go."""
    server = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60)
    )
    two = Placement(2, 0, 2, 0, 1, 0, 2, "127.0.0.1", server.port)
    gate = ReadinessGate(datetime.timedelta(seconds=30), all_ranks_s=0.3)
    went = threading.Event()
    try:
        with caplog.at_level("WARNING", logger="efdl.worker.ready"):
            gate.watch(two, lambda: False, went.set)
            wait_until("the line", lambda: "1 of its 2 ranks have declared" in caplog.text, 30)
            assert not went.is_set()
            ReadinessGate(datetime.timedelta(seconds=30)).declare(replace(two, rank=1))
            assert went.wait(30), "the last declaration did not open the pause"
        assert caplog.text.count("have declared themselves") == 1
    finally:
        gate.close()
