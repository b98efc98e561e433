"""The breaker: shuts down exactly the recorded generations' connected sockets, when stalled."""

from __future__ import annotations

import socket
import time

import pytest

from efdl.worker import breaker
from efdl.worker.breaker import Breaker


def test_cut_shuts_down_older_generations_connections_only() -> None:
    b = Breaker()
    with b.recording(1):
        old, old_peer = socket.socketpair()
        listener = socket.create_server(("127.0.0.1", 0))
    with b.recording(2):
        new, new_peer = socket.socketpair()
    unrecorded, unrecorded_peer = socket.socketpair()
    try:
        assert b.cut(below=2) == 2  # both ends of the old pair live in this process
        assert old_peer.recv(1) == b""  # the peer sees the connection end
        assert old.fileno() >= 0  # the descriptor still belongs to its owner
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):  # a listener is left alone: gloo aborts otherwise
            listener.accept()
        for a, z in ((new, new_peer), (unrecorded, unrecorded_peer)):
            a.sendall(b"x")
            assert z.recv(1) == b"x"
        assert b.cut(below=2) == 0  # already cut
        assert b.cut(below=3) == 2  # generation 2's pair
    finally:
        for s in (old, old_peer, listener, new, new_peer, unrecorded, unrecorded_peer):
            s.close()


def test_a_reused_descriptor_is_not_cut() -> None:
    b = Breaker()
    with b.recording(1):
        a, z = socket.socketpair()
    fd = a.fileno()
    a.close()
    z.close()
    c, d = socket.socketpair()  # the lowest free descriptors: ``fd`` again, another inode
    try:
        assert fd in (c.fileno(), d.fileno())
        assert b.cut(below=2) == 0
        c.sendall(b"x")
        assert d.recv(1) == b"x"
    finally:
        c.close()
        d.close()


def test_forget_after_the_groups_are_destroyed() -> None:
    b = Breaker()
    with b.recording(1):
        a, z = socket.socketpair()
    b.forget()
    try:
        assert b.cut(below=2) == 0
    finally:
        a.close()
        z.close()


def test_grace_follows_the_longest_recent_step_across_rebuilds() -> None:
    now = [100.0]
    b = Breaker(clock=lambda: now[0])
    assert b.grace() == breaker.MIN_GRACE_S
    with b.recording(1):
        pass
    for dt in (30.0, 0.1, 5.0, 0.1):  # the first: group made -> first commit (sync)
        now[0] += dt
        b.stepped()
    assert b.grace() == pytest.approx(breaker.STEPS_OF_GRACE * 5.0)
    with b.recording(2):  # a new generation: the 5 s steps still count (it is the same model)
        pass
    now[0] += 40.0  # its group made -> first commit (the sync): not a step
    b.stepped()
    assert b.grace() == pytest.approx(breaker.STEPS_OF_GRACE * 5.0)
    for _ in range(9):  # nine short steps push the long ones out
        now[0] += 0.1
        b.stepped()
    assert b.grace() == breaker.MIN_GRACE_S


def test_watch_cuts_a_stalled_worker_and_spares_a_progressing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A grace far above a busy machine's scheduling delays: the progressing worker steps
    # every 10 ms, so only a second without the CPU could look like a stall.
    monkeypatch.setattr(breaker, "MIN_GRACE_S", 1.0)
    stalled, progressing = Breaker(), Breaker()
    with stalled.recording(1):
        s1, s2 = socket.socketpair()
    with progressing.recording(1):
        p1, p2 = socket.socketpair()
    try:
        stalled.watch(2, lambda: True)
        behind = [True]
        progressing.watch(2, lambda: behind[0])
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:  # steps every 10 ms, then pauses (not behind)
            progressing.stepped()
            time.sleep(0.01)
        behind[0] = False  # it paused and joined the new generation
        s2.settimeout(10.0)
        assert s2.recv(1) == b""
        p1.sendall(b"x")
        assert p2.recv(1) == b"x"
    finally:
        for s in (s1, s2, p1, p2):
            s.close()


def test_cut_aborts_the_older_generations_nccl_communicators() -> None:
    """NCCL opens its sockets lazily, unseen by ``recording``: its communicators are aborted."""
    b = Breaker()
    aborted: list[str] = []
    b.on_cut(1, lambda: aborted.append("gen1"))
    b.on_cut(2, lambda: aborted.append("gen2"))

    def gone() -> None:
        raise RuntimeError("ProcessGroupNCCL is already aborted")

    b.on_cut(1, gone)  # a failing abort is logged, the others still happen
    assert b.cut(below=2) == 1 and aborted == ["gen1"]
    assert b.cut(below=2) == 0  # once only
    b.forget()  # the groups were destroyed: nothing of theirs is aborted later
    assert b.cut(below=3) == 0 and aborted == ["gen1"]
