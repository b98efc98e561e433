"""Whether a node restarts its failed workers (``--max-restarts``): the decision, pure.

Restarts are for failures that may not come again: a flaky GPU, a NCCL timeout, a host
hiccup. A failure that does come again, the same error as the node's last one with no step
trained in between (a script that raises at import or in its setup, a bad flag, a missing
file, a step that fails the same way after every resume), would fail every restart alike:
it ends the node's part in the job after one retry, not after all of them.

A crash loop is the same error again and again with steps trained in between: a bad GPU, a
node whose disk or NIC fails the workers after a while. ``quarantine_after`` failures with
the same exit code (or signal) and the same error line within ``window_s`` quarantine the
node (efdl.rendezvous.holds) instead of restarting it again: the job loses a round to each
of those failures, not one to every round for as long as the node is let back in. Only
failures that may be the node's own count: a plain script's workers all fail when one peer
dies (their collectives break), so an error that says a collective or a connection failed
(:func:`peer_caused`), and a SIGTERM or SIGKILL (someone else's doing), are not counted: the
node whose worker died first is the one that loops. A node whose NIC breaks its collectives
is not caught here; that is the health checks' and the straggler detector's.
"""

from __future__ import annotations

import enum
import re
import signal
from dataclasses import dataclass, replace

# Error lines of a worker whose collective failed because a peer went: not its node's fault.
_PEER_CAUSED = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed? ?out|nccl|gloo|processgroup|"
    r"distbackenderror|distnetworkerror|peer",
    re.IGNORECASE,
)
_OTHERS_SIGNALS = (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT, -signal.SIGHUP)


def peer_caused(code: int, line: str) -> bool:
    """Whether a failure with exit ``code`` and error ``line`` is likely another's doing: a
    collective or connection that failed, or a signal to stop sent from outside."""
    return code in _OTHERS_SIGNALS or bool(_PEER_CAUSED.search(line))


class Verdict(enum.Enum):
    RESTART = "restart"
    EXHAUSTED = "exhausted"  # --max-restarts used up
    REPEATED = "repeated"  # the same error again, nothing trained since: deterministic
    QUARANTINE = "quarantine"  # the same error --quarantine-after times within the window


@dataclass(frozen=True, slots=True)
class _Seen:
    code: int
    error: str
    step: int | None


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure as the crash-loop count keeps it: its exit code (negative: a signal),
    the first line of its error, and when (seconds on the caller's clock)."""

    code: int
    line: str
    at: float


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a failure means for the node (``verdict``), and its budget after it;
    ``repeats``: how many failures like it (itself included) fell within the window."""

    verdict: Verdict
    budget: RestartBudget
    repeats: int = 1


@dataclass(frozen=True, slots=True)
class RestartBudget:
    """The restarts a node has used, and its last failure: a value, judged without I/O.

    Args:
        max_restarts: worker failures this node restarts from (``--max-restarts``).
        used: the restarts used so far.
        quarantine_after: failures with the same error within ``window_s`` that quarantine
            the node (``--quarantine-after``; 0: never).
        window_s: the window (``--quarantine-window``).
    """

    max_restarts: int
    used: int = 0
    last: _Seen | None = None  # the last failure judged
    quarantine_after: int = 0
    window_s: float = 1800.0
    failures: tuple[Failure, ...] = ()  # within the window, oldest first

    def judge(self, code: int, error: str, step: int | None, now: float = 0.0) -> Judgement:
        """A worker failed with exit ``code`` (negative: a signal) and ``error`` (its
        exception, then its stack; '' if unknown) at ``now``; ``step``: the last step the
        node's workers committed, None if unknown. A RESTART's budget counts the restart as
        used. The crash loop is judged first: a quarantined node is not gone, it comes back
        once its hold ends."""
        seen = _Seen(code, error.strip(), step)
        line = (error.strip().splitlines() or [""])[0]
        recent = tuple(f for f in self.failures if now - f.at < self.window_s)
        failures = recent if peer_caused(code, line) else (*recent, Failure(code, line, now))
        after = replace(self, last=seen, failures=failures)
        repeats = sum(1 for f in failures if (f.code, f.line) == (code, line))
        if peer_caused(code, line):
            repeats = 0
        if self.quarantine_after and repeats >= self.quarantine_after:
            # The hold consumes them: a node let back in starts its count again.
            return Judgement(Verdict.QUARANTINE, replace(after, failures=()), repeats)
        if seen.error != "" and code > 0 and seen == self.last:
            return Judgement(Verdict.REPEATED, after, repeats)
        if self.used >= self.max_restarts:
            return Judgement(Verdict.EXHAUSTED, after, repeats)
        return Judgement(Verdict.RESTART, replace(after, used=self.used + 1), repeats)
