"""Whether a node restarts its failed workers (``--max-restarts``): the decision, pure.

Restarts are for failures that may not come again: a flaky GPU, a NCCL timeout, a host
hiccup. A failure that does come again, the same error as the node's last one with no step
trained in between (a script that raises at import or in its setup, a bad flag, a missing
file, a step that fails the same way after every resume), would fail every restart alike:
it ends the node's part in the job after one retry, not after all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    RESTART = "restart"
    EXHAUSTED = "exhausted"  # --max-restarts used up
    REPEATED = "repeated"  # the same error again, nothing trained since: deterministic


@dataclass(frozen=True, slots=True)
class _Seen:
    code: int
    error: str
    step: int | None


class RestartBudget:
    """The restarts a node has used, and its last failure.

    Args:
        max_restarts: worker failures this node restarts from (``--max-restarts``).
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.used = 0
        self._last: _Seen | None = None

    def decide(self, code: int, error: str, step: int | None) -> Verdict:
        """A worker failed with exit ``code`` (negative: a signal) and ``error`` (its
        exception line, '' if unknown); ``step``: the last step the node's workers committed,
        None if unknown. RESTART counts the restart as used."""
        seen = _Seen(code, error.strip(), step)
        repeated = seen.error != "" and code > 0 and seen == self._last
        self._last = seen
        if repeated:
            return Verdict.REPEATED
        if self.used >= self.max_restarts:
            return Verdict.EXHAUSTED
        self.used += 1
        return Verdict.RESTART
