"""The c10d store a rank-0 node's agent serves for one generation at a time.

Each generation gets a fresh ``TCPStore`` (torch's env:// workers use the agent's store with
no key prefix, so a store that outlived its generation would hand new workers stale keys).
The listening socket is bound here, to the node's ``--host`` address, not to every interface.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from typing import Any

from efdl.errors import ConfigError
from efdl.rendezvous.records import Round

log = logging.getLogger(__name__)


def preload() -> None:
    """Import torch's c10d in the background now: the agent needs it only when it serves a
    store, but that is on the path to the first step (over a second to import here), and
    the agent has time to spare while it joins and the settle window runs."""

    def load() -> None:
        try:
            import torch.distributed  # noqa: F401
        except Exception as exc:  # the import is retried (and its error raised) when needed
            log.debug("Preloading torch.distributed failed: %s", exc)

    threading.Thread(target=load, name="efdl-preload-torch", daemon=True).start()


class TCPStoreServer:
    """Serves one generation's TCPStore on ``host`` (a fixed ``port``, or a free one each time).

    Args:
        host: the address to listen on (the node's ``--host``).
        port: a fixed port (checked now: an error if it is in use), or 0 for any free port.
    """

    def __init__(self, host: str, port: int = 0) -> None:
        self._host = host
        self._port = port
        self._store: Any = None
        self._starting: threading.Thread | None = None
        self.generation = 0
        if port:
            self._listen().close()  # fail at start, not at the first round, if it is taken

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise ConfigError(
                f"Cannot listen on {self._host}:{self._port} for the c10d store: {exc.strerror}"
                " (is the port in use, or --host not an address of this machine?)."
            ) from None
        sock.listen(1024)
        return sock

    def serve(self, rnd: Round) -> int:
        """Replace the store with a fresh one for ``rnd``; returns its port at once.

        The port is bound and listening now; the TCPStore that answers on it is created on a
        helper thread (the agent imports torch only for it, over a second here), so the round
        goes out and the workers start meanwhile. A client that connects early is held in
        the listen backlog until the store answers, within the client's timeout.
        """
        self.close()
        sock = self._listen()
        port = int(sock.getsockname()[1])
        fd = sock.detach()
        self.generation = rnd.generation

        def start() -> None:
            try:
                from torch.distributed import TCPStore  # type: ignore[attr-defined]

                self._store = TCPStore(
                    self._host,
                    port,
                    None,
                    True,
                    datetime.timedelta(seconds=60),
                    wait_for_workers=False,
                    master_listen_fd=fd,
                )
            except Exception as exc:
                os.close(fd)
                log.error("Could not serve the c10d store on %s:%d: %s", self._host, port, exc)

        self._starting = threading.Thread(target=start, name="efdl-store", daemon=True)
        self._starting.start()
        # Said now, while the round is made (the helper may finish after a short job ended).
        log.info(
            "Serving the c10d store of generation %d on %s:%d.", rnd.generation, self._host, port
        )
        return port

    def close(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        self._store = None  # the store's daemon stops with the object
