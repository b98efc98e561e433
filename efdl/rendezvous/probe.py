"""Evidence that a node's agent is gone, faster than its lease: a refused connection.

Each agent listens on a probe port (published in its node record) for as long as its process
lives. When a worker's collective fails because a peer's connection closed, its agent reports
it; the leader then connects to the probe port of every node, and the node just before the
reporter in the election order to its predecessor's (the leader itself may be the one that
died). Only "connection refused" from a port that answered before counts: the node's kernel
saying that no process listens there any more, which happens when the agent was killed, and
never while it lives (even stopped or too busy to accept, the kernel completes the
connection). A port that never answered may be behind a firewall that rejects; a timeout, an
unreachable host or any other error proves nothing (a hung or partitioned node): such a node
is still decided by its lease, as before.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

CONNECT_TIMEOUT_S = 1.0  # a live agent's kernel answers in well under a millisecond
PARALLEL = 32  # probes at once: 512 live nodes take a few milliseconds
MAX_REPLY = 65536  # what an agent says of itself is a line of about 200 bytes


class ProbeListener:
    """Accepts connections on ``host`` at a free port, in a daemon thread, until
    :meth:`close`; writes each what ``describe`` says (one JSON line: what ``efdl status``
    shows of a live agent) and closes it.

    Raises:
        OSError: ``host`` cannot be listened on.
    """

    def __init__(self, host: str, describe: Callable[[], dict[str, Any]] | None = None) -> None:
        self._describe = describe
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self.knocks = 0  # connections accepted
        threading.Thread(target=self._accept, name="efdl-probe", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                if self._describe is not None:
                    self._say(conn, self._describe)
            self.knocks += 1

    @staticmethod
    def _say(conn: socket.socket, describe: Callable[[], dict[str, Any]]) -> None:
        try:
            line = json.dumps(describe()).encode() + b"\n"
            conn.settimeout(1.0)
            conn.sendall(line)
        except OSError:
            pass  # a knock closes at once
        except Exception as exc:  # the agent is still starting: say nothing
            log.debug("Nothing to say to a probe: %s", exc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()


class Reply(enum.StrEnum):
    ANSWERED = "answered"  # a process listens: the agent lives (perhaps stopped)
    REFUSED = "refused"  # nothing listens there (or a firewall rejects: see knock_all)
    SILENT = "silent"  # a timeout, no route, no such name: no evidence either way


def knock(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> Reply:
    """Connect to ``host:port`` and close at once; what came back."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return Reply.ANSWERED
    except ConnectionRefusedError:
        return Reply.REFUSED
    except OSError as exc:
        log.debug("Probing %s:%d proved nothing: %s", host, port, exc)
        return Reply.SILENT


def ask(
    host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S
) -> tuple[Reply, dict[str, Any] | None]:
    """Knock at ``host:port`` and read what the agent says of itself (None: nothing
    readable, e.g. an agent of an older version, or a stopped one)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            data = b""
            with contextlib.suppress(OSError):
                while len(data) < MAX_REPLY and (chunk := conn.recv(4096)):
                    data += chunk
    except ConnectionRefusedError:
        return Reply.REFUSED, None
    except OSError as exc:
        log.debug("Asking %s:%d proved nothing: %s", host, port, exc)
        return Reply.SILENT, None
    try:
        said = json.loads(data)
    except ValueError:
        return Reply.ANSWERED, None
    return Reply.ANSWERED, said if isinstance(said, dict) else None


def ask_all(
    targets: Iterable[tuple[str, str, int]],
) -> dict[str, tuple[Reply, dict[str, Any] | None]]:
    """:func:`ask` each of ``targets`` (id, host, probe port; 0: not asked), in parallel."""
    return _each(targets, ask)


def _each(targets: Iterable[tuple[str, str, int]], fn: Callable[[str, int], T]) -> dict[str, T]:
    """``fn(host, port)`` for each of ``targets`` with a port, in parallel, by id."""
    todo = [(node_id, host, port) for node_id, host, port in targets if port]
    if not todo:
        return {}
    with ThreadPoolExecutor(min(PARALLEL, len(todo)), thread_name_prefix="efdl-probe") as pool:
        replies = list(pool.map(lambda t: fn(t[1], t[2]), todo))
    return {node_id: reply for (node_id, _, _), reply in zip(todo, replies, strict=True)}


def knock_all(targets: Iterable[tuple[str, str, int]]) -> dict[str, Reply]:
    """Knock at each of ``targets`` (id, host, probe port), in parallel; a port of 0 (an
    agent that does not listen) is not knocked at and not answered.

    A refusal is evidence only from a port that answered before: a firewall that rejects
    connections (iptables' REJECT) refuses a live node's port too, and such a node must be
    left to its lease. The caller keeps what answered."""
    return _each(targets, knock)
