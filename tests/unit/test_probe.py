"""The liveness probe over real sockets on 127.0.0.1: only a refused connection is evidence
that an agent is gone; a listener that never accepts (a stopped agent) and a connection
that times out (a partition) are not."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from efdl.rendezvous import probe
from efdl.rendezvous.probe import ProbeListener, Reply, knock, knock_all


@pytest.fixture()
def listener() -> Iterator[ProbeListener]:
    p = ProbeListener("127.0.0.1")
    try:
        yield p
    finally:
        p.close()


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, never listened, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_live_agent_answers_and_a_closed_one_refuses(listener: ProbeListener) -> None:
    assert knock("127.0.0.1", listener.port) is Reply.ANSWERED
    assert knock("127.0.0.1", listener.port) is Reply.ANSWERED  # it goes on accepting
    listener.close()
    assert knock("127.0.0.1", listener.port) is Reply.REFUSED


def test_a_stopped_agent_is_not_gone() -> None:
    """A process that listens but never accepts (SIGSTOP, too busy): its kernel completes the
    connection, so it is left to its lease."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert knock("127.0.0.1", s.getsockname()[1]) is Reply.ANSWERED


@pytest.mark.parametrize(
    "error",
    [TimeoutError("timed out"), OSError(113, "No route to host"), socket.gaierror(-2, "unknown")],
)
def test_a_timeout_or_no_route_proves_nothing(
    monkeypatch: pytest.MonkeyPatch, error: OSError
) -> None:
    def fails(*args: object, **kwargs: object) -> socket.socket:
        raise error

    monkeypatch.setattr(probe.socket, "create_connection", fails)
    assert knock("ip-10-1-2-3.ec2.internal", 4) is Reply.SILENT


def test_knock_all_knocks_at_every_published_port(listener: ProbeListener) -> None:
    dead = _closed_port()
    targets = [
        ("ip-10-0-0-1.ec2.internal", "127.0.0.1", listener.port),
        ("ip-10-0-0-2.ec2.internal", "127.0.0.1", dead),
        ("old-agent", "127.0.0.1", 0),  # publishes no probe port: never probed
    ]
    assert knock_all(targets) == {
        "ip-10-0-0-1.ec2.internal": Reply.ANSWERED,
        "ip-10-0-0-2.ec2.internal": Reply.REFUSED,
    }
    assert knock_all([]) == {}


def test_a_live_agent_says_what_it_does_and_status_shows_it() -> None:
    from efdl.rendezvous.status import Liveness

    said = {"pid": 1, "generation": 4, "workers": 2, "in_place": True, "step": 120}
    p = ProbeListener("127.0.0.1", lambda: {**said, "step_time": 1000.0})
    try:
        reply, answer = probe.ask("127.0.0.1", p.port)
        assert reply is Reply.ANSWERED and answer == {**said, "step_time": 1000.0}
        assert knock("127.0.0.1", p.port) is Reply.ANSWERED  # a knock that closes at once
        shown = Liveness(reply, answer).describe(now=1003.0)
        assert shown == "step 120 (3 s ago), workers running: 2 (in place)"
        assert probe.ask_all([("a", "127.0.0.1", p.port), ("old", "127.0.0.1", 0)]) == {
            "a": (Reply.ANSWERED, {**said, "step_time": 1000.0})
        }
    finally:
        p.close()
    reply, answer = probe.ask("127.0.0.1", p.port)
    assert (reply, answer) == (Reply.REFUSED, None)
    assert Liveness(reply).describe(now=0).startswith("agent gone")


def test_an_agent_that_cannot_describe_itself_yet_still_answers() -> None:
    def starting() -> dict[str, object]:
        raise AttributeError("not started")

    p = ProbeListener("127.0.0.1", starting)
    try:
        assert probe.ask("127.0.0.1", p.port) == (Reply.ANSWERED, None)
    finally:
        p.close()
