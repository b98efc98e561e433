"""What a worker tells its agent of its optimizer steps, efdl-aware or not.

A plain torchrun script never speaks to efdl, so in restart mode the agent could not tell
when training went on after a restart: ``efdl status`` said "stood still 0.0 s" for jobs
that stood still for seconds per event. Every Python worker starts through
:mod:`efdl.launcher.warm` (warm or not), which installs this watch before the script runs:
a global optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``,
a few microseconds per step) that sends the agent ``{"type": "stepped", "pid", "count",
"time"}`` on the first step and then at most every 0.1 s, over the agent's socket
(``EFDL_AGENT_SOCKET``). Lost if the agent is gone; nothing waits on it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

SOCKET_ENV = "EFDL_AGENT_SOCKET"  # as efdl.state.channel's
REPORT_EVERY_S = 0.1  # the pause it measures starts at most this much early


class _Watch:
    def __init__(self, path: str) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._count = 0
        self._sent_at = 0.0
        self._broken = False

    def stepped(self, *_: Any) -> None:
        self._count += 1
        now = time.monotonic()
        if self._count > 1 and now - self._sent_at < REPORT_EVERY_S:
            return
        self._sent_at = now
        self._send(
            {"type": "stepped", "pid": os.getpid(), "count": self._count, "time": time.time()}
        )

    def _send(self, message: dict[str, object]) -> None:
        if self._broken:
            return
        data = json.dumps(message).encode() + b"\n"
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._sock.settimeout(1.0)
                    self._sock.connect(self._path)
                self._sock.sendall(data)
            except OSError:
                self._broken = True  # the agent is gone or never listened: say nothing more


def install() -> bool:
    """Watch this process's optimizer steps for its agent; False where no agent listens."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return False
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_Watch(path).stepped)
    return True
