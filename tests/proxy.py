"""A TCP forwarder on 127.0.0.1 that a test can cut: one client's link to a server goes down
(every connection reset, new ones refused) and comes back, while the server serves others.
Or, harder, the link stalls: packets just stop, both ways (nothing is reset or refused: new
connections are accepted and never answered), as when a switch port dies."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` until :meth:`close`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._up = True
        self._stalled = False  # everything is swallowed; nothing is reset
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Reset every connection; refuse new ones until :meth:`heal`."""
        with self._lock:
            self._up = False
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
                c.close()

    def stall(self) -> None:
        """Stop forwarding, both ways, without a word: data sent is swallowed, connections
        stay open, new ones are accepted and never answered, until :meth:`heal`."""
        with self._lock:
            self._stalled = True

    def heal(self) -> None:
        """Forward again. After a stall the connections it swallowed data of are reset (their
        streams lost bytes): the clients connect again."""
        with self._lock:
            self._up = True
            stalled, self._stalled = self._stalled, False
            conns = self._conns if stalled else []
            if stalled:
                self._conns = []
        for c in conns:
            with contextlib.suppress(OSError):
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
                c.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                up, stalled = self._up, self._stalled
                if stalled:
                    self._conns.append(client)  # held open, never answered
            if stalled:
                continue
            if not up:
                client.close()
                continue
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self._stalled:
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        self.cut()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
