"""The agent <-> worker messages (efdl.protocol.messages): each one survives its encoding,
and a line that is not a message of the right shape is refused, not half-read."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from efdl.protocol.messages import (
    Agreed,
    Hello,
    Leave,
    Message,
    PeerFailed,
    Persisted,
    Placed,
    Placement,
    Rescaled,
    ResumedFromCache,
    StateLost,
    Stepped,
    Waiting,
    decode,
    encode,
)
from efdl.worker.channel import ChannelServer

PLACEMENT = Placement(7, 3, 16, 1, 2, 1, 8, "ip-10-0-1-17.ec2.internal", 29500, 1200, 6)
EVERY = [
    Hello(4242, 1),
    Stepped(1_764_300_000.25, 4242),
    Agreed(1201, 1200, 7),
    Rescaled(7, 16, 1201, 0.12),
    PeerFailed(7),
    Persisted(1200, None, 16, 524_288_000, 3.5, 7),
    Persisted(1200, 3, 16, 1, 0.0, 7),
    ResumedFromCache(1200),
    StateLost("no rank holds step 1200"),
    Placed(PLACEMENT),
    Leave(),
    Waiting(600.0),
]


@pytest.mark.parametrize("message", EVERY, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_encoding(message: Message) -> None:
    line = encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(json.loads(line)) == message


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {},
        {"type": "nope"},
        {"type": "progress", "step": "12", "agreed": 11, "generation": 1},  # a string step
        {"type": "progress", "step": 12, "agreed": 11},  # a field missing
        {"type": "persisted", "step": 1, "epoch": None, "world_size": True, "bytes": 1,
         "seconds": 1.0, "generation": 1},  # a bool is not a number
        {"type": "round", "generation": 1, "rank": 0},  # a placement without its fields
        {"type": "waiting", "for_s": "long"},
    ],
)  # fmt: skip
def test_what_is_not_a_message_is_refused(data: object) -> None:
    assert decode(data) is None


def test_a_whole_number_for_a_float_field_is_read_as_a_float() -> None:
    assert decode({"type": "waiting", "for_s": 60}) == Waiting(60.0)
    assert isinstance(Waiting(60).for_s, int)  # (the constructor does not convert)
    got = decode({"type": "waiting", "for_s": 60})
    assert isinstance(got, Waiting) and isinstance(got.for_s, float)


def test_the_agents_end_skips_a_bad_line_and_reads_on(tmp_path: Path) -> None:
    """A worker that writes garbage (or a message meant for a worker) does not end its
    channel: the next good message still arrives."""
    got: list[object] = []
    hello, done = threading.Event(), threading.Event()

    def on_message(msg: object) -> None:
        if isinstance(msg, Hello):
            hello.set()
            return
        got.append(msg)
        done.set()

    server = ChannelServer(tmp_path / "a.sock", on_message)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(tmp_path / "a.sock"))
            s.sendall(encode(Hello(99, 0)))
            assert hello.wait(10)
            s.sendall(b"not json\n" + b'{"type": "progress"}\n' + encode(Leave()))
            s.sendall(encode(PeerFailed(3)))
            assert done.wait(10)
        assert got == [PeerFailed(3)]
    finally:
        server.close()


def test_a_message_on_a_connection_without_a_hello_counts_only_if_it_names_its_process(
    tmp_path: Path,
) -> None:
    """A plain script's worker never says hello: its Stepped names its pid and is passed on;
    anything else there has no sender and is dropped."""
    got: list[object] = []
    done = threading.Event()

    def on_message(msg: object) -> None:
        got.append(msg)
        done.set()

    server = ChannelServer(tmp_path / "b.sock", on_message)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(tmp_path / "b.sock"))
            s.sendall(encode(PeerFailed(3)) + encode(Stepped(1.0, 77)))
            assert done.wait(10)
        assert got == [Stepped(1.0, 77)]
    finally:
        server.close()
