"""The local channel between a node agent and its workers: the messages of
:mod:`efdl.protocol.messages` on a Unix socket.

A worker that can rebuild in place says so (:class:`Hello`); from then on the agent tells it
about new rounds (:class:`Placed`) instead of restarting it, or asks it to leave at the next
step boundary (:class:`Leave`). Nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from efdl.errors import ConfigError
from efdl.protocol.env import GENERATION_ENV, JOB_GENERATION_ENV, JOB_STEP_ENV, LOCAL_RANK_ENV
from efdl.protocol.messages import (
    Hello,
    Leave,
    Message,
    Placed,
    Placement,
    Stepped,
    ToAgent,
    Waiting,
    decode,
    encode,
)

log = logging.getLogger(__name__)

SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, less the terminating NUL


def placement_from_env(env: dict[str, str] | None = None) -> Placement:
    """The placement a worker was started with (torchrun's variables and efdl's)."""
    e = dict(os.environ) if env is None else env
    return Placement(
        int(e.get(GENERATION_ENV, "0")),
        int(e["RANK"]),
        int(e["WORLD_SIZE"]),
        int(e.get(LOCAL_RANK_ENV) or e.get("LOCAL_RANK", "0")),
        int(e.get("LOCAL_WORLD_SIZE", "1")),
        int(e.get("GROUP_RANK", "0")),
        int(e.get("GROUP_WORLD_SIZE", "1")),
        e["MASTER_ADDR"],
        int(e["MASTER_PORT"]),
        int(e.get(JOB_STEP_ENV, "0")),
        int(e.get(JOB_GENERATION_ENV, "0")),
    )


def _send(sock: socket.socket, message: Message, lock: threading.Lock) -> None:
    data = encode(message)
    with lock:
        sock.sendall(data)


def _messages(sock: socket.socket) -> Iterator[Message]:
    with sock.makefile("rb") as f:
        for line in f:
            try:
                message = decode(json.loads(line))
            except ValueError:
                message = None
            if message is None:
                log.error("Ignoring a bad message on the agent channel: %r", line[:200])
                continue
            yield message


class ChannelServer:
    """The agent's end: accepts workers, reports their hellos, sends them rounds.

    Args:
        path: the socket path (in the agent's private run directory).
        on_message: called (from a channel thread) with each message of a worker: its
            :class:`~efdl.protocol.messages.Hello` (it rebuilds in place; the agent may send
            to it from then on), then any other. A message on a connection without a hello
            is passed on only if it names its process (a plain script's
            :class:`~efdl.protocol.messages.Stepped`).
    """

    def __init__(
        self,
        path: Path,
        on_message: Callable[[ToAgent], None],
    ) -> None:
        self.path = path
        self._on_message = on_message
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[socket.socket, threading.Lock]] = {}  # pid -> connection
        if len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise ConfigError(
                f"The agent's socket path {str(path)!r} is longer than the {SOCKET_PATH_MAX} "
                "bytes a Unix socket allows: set TMPDIR to a shorter directory."
            )
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        os.chmod(path, 0o600)
        self._server.listen(64)
        threading.Thread(target=self._accept, name="efdl-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pid = None
        try:
            for msg in _messages(conn):
                if isinstance(msg, Hello):
                    pid = msg.pid
                    with self._lock:
                        self._conns[pid] = (conn, threading.Lock())
                    self._on_message(msg)
                elif isinstance(msg, Placed | Leave | Waiting):
                    log.error("Ignoring a message for a worker sent to the agent: %s", msg)
                elif pid is not None or isinstance(msg, Stepped):
                    self._on_message(msg)
        except OSError:
            pass
        finally:
            if pid is not None:
                with self._lock:
                    self._conns.pop(pid, None)
            conn.close()

    def send(self, pid: int, message: Placed | Leave | Waiting) -> bool:
        """Send to the worker with ``pid``; False if it is not connected."""
        with self._lock:
            entry = self._conns.get(pid)
        if entry is None:
            return False
        try:
            _send(entry[0], message, entry[1])
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._server.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn, _ in conns:
            conn.close()


class Reporter:
    """A worker's send-only line to its agent, without a hello: the worker of a plain script
    does not rebuild in place, but says how it trains (efdl.launcher.stepwatch). Connects at
    its first message, names its process in each, and goes quiet for good once the agent
    cannot be reached; nothing waits on it."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._broken = False

    def send(self, message: Stepped) -> None:
        if self._broken:
            return
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(1.0)
                sock.connect(self._path)
                self._sock = sock
            _send(self._sock, message, self._lock)
        except OSError:
            self._broken = True


class AgentChannel:
    """The worker's end: announces in-place support, then receives rounds and leave requests.

    Args:
        path: the agent's socket.
        local_rank: this worker's local rank.
        on_round: called (on the channel's thread) with each new placement; whoever handles
            it calls :meth:`open` when the whole new generation is ready to start.
    """

    def __init__(
        self, path: str, local_rank: int, on_round: Callable[[Placement], None] | None = None
    ) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._latest: Placement | None = None
        self._opened = 0  # the newest generation every rank is ready for
        self._waits_until = 0.0  # the job waits below --min: placements may take this long
        self._on_round = on_round
        self.leave_requested = False
        self.closed = False
        _send(self._sock, Hello(os.getpid(), local_rank), self._lock)
        threading.Thread(target=self._read, name="efdl-agent-channel", daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in _messages(self._sock):
                with self._cond:
                    if isinstance(msg, Placed):
                        self._latest = msg.placement
                        if self._on_round is None:
                            self._opened = self._latest.generation
                        else:
                            self._on_round(self._latest)
                    elif isinstance(msg, Leave):
                        self.leave_requested = True
                    elif isinstance(msg, Waiting):
                        self._waits_until = time.monotonic() + msg.for_s
                    self._cond.notify_all()
        except OSError:
            pass
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def notify(self, message: ToAgent) -> None:
        """Tell the agent something (e.g. a persisted step); lost if the agent is gone."""
        try:
            _send(self._sock, message, self._lock)
        except OSError as exc:
            log.debug("Could not tell the agent %s: %s", message.KIND, exc)

    def open(self, generation: int) -> None:
        """Every rank of ``generation`` is ready: pausing for it will not leave anyone idle."""
        with self._cond:
            self._opened = max(self._opened, generation)

    def superseded(self, generation: int) -> bool:
        """Whether a placement newer than ``generation`` has come."""
        latest = self._latest
        return latest is not None and latest.generation > generation

    def pending(self, generation: int) -> bool:
        """Whether to pause after ``generation``: the agent asked this worker to leave, or
        sent a newer placement that every rank of the new generation is ready for."""
        latest = self._latest
        return self.leave_requested or (
            latest is not None
            and latest.generation > generation
            and self._opened >= latest.generation
        )

    def wait(self, generation: int, timeout_s: float) -> Placement | None:
        """The next placement after ``generation``; None if asked to leave (or the agent is
        gone, or ``timeout_s`` passed: longer while the agent says the job waits for members,
        up to the join timeout it names)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (
                self.leave_requested
                or self.closed
                or (self._latest is not None and self._latest.generation > generation)
            ):
                left = max(deadline, self._waits_until) - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self.leave_requested or self._latest is None:
                return None
            return self._latest if self._latest.generation > generation else None
