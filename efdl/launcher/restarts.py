"""Whether a node restarts its failed workers (``--max-restarts``): the decision, pure.

Restarts are for failures that may not come again: a flaky GPU, a NCCL timeout, a host
hiccup. A failure that does come again, the same error as the node's last one with no step
trained in between (a script that raises at import or in its setup, a bad flag, a missing
file, a step that fails the same way after every resume), would fail every restart alike:
it ends the node's part in the job after one retry, not after all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Verdict(enum.Enum):
    RESTART = "restart"
    EXHAUSTED = "exhausted"  # --max-restarts used up
    REPEATED = "repeated"  # the same error again, nothing trained since: deterministic


@dataclass(frozen=True, slots=True)
class _Seen:
    code: int
    error: str
    step: int | None


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a failure means for the node (``verdict``), and its budget after it."""

    verdict: Verdict
    budget: RestartBudget


@dataclass(frozen=True, slots=True)
class RestartBudget:
    """The restarts a node has used, and its last failure: a value, judged without I/O.

    Args:
        max_restarts: worker failures this node restarts from (``--max-restarts``).
        used: the restarts used so far.
    """

    max_restarts: int
    used: int = 0
    last: _Seen | None = None  # the last failure judged

    def judge(self, code: int, error: str, step: int | None) -> Judgement:
        """A worker failed with exit ``code`` (negative: a signal) and ``error`` (its
        exception line, '' if unknown); ``step``: the last step the node's workers committed,
        None if unknown. A RESTART's budget counts the restart as used."""
        seen = _Seen(code, error.strip(), step)
        after = replace(self, last=seen)
        if seen.error != "" and code > 0 and seen == self.last:
            return Judgement(Verdict.REPEATED, after)
        if self.used >= self.max_restarts:
            return Judgement(Verdict.EXHAUSTED, after)
        return Judgement(Verdict.RESTART, replace(after, used=self.used + 1))
