"""What a worker tells its agent of its optimizer steps, efdl-aware or not.

A plain torchrun script never speaks to efdl, so in restart mode the agent could not tell
when training went on after a restart: ``efdl status`` said "stood still 0.0 s" for jobs
that stood still for seconds per event. Every Python worker starts through
:mod:`efdl.launcher.warm` (warm or not), which installs this watch before the script runs:
a global optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``;
a clock read per step) that sends the agent a :class:`~efdl.protocol.messages.Stepped` on the first
step and then at most every 0.1 s, over the agent's socket (``EFDL_AGENT_SOCKET``, through
:class:`efdl.worker.channel.Reporter`). Lost if the agent is gone; nothing waits on it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from efdl.protocol.env import SOCKET_ENV
from efdl.protocol.messages import Stepped
from efdl.worker.channel import Reporter

REPORT_EVERY_S = 0.1  # the pause it measures starts at most this much early


class _Watch:
    def __init__(self, reporter: Reporter) -> None:
        self._reporter = reporter
        self._sent_at: float | None = None  # monotonic; None: no step yet

    def stepped(self, *_: Any) -> None:
        now = time.monotonic()
        if self._sent_at is not None and now - self._sent_at < REPORT_EVERY_S:
            return
        self._sent_at = now
        self._reporter.send(Stepped(time.time(), os.getpid()))


def install() -> bool:
    """Watch this process's optimizer steps for its agent; False where no agent listens."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return False
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_Watch(Reporter(path)).stepped)
    return True
