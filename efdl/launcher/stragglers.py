"""The agent's judgment of its own node's pace (efdl.worker.pace measures it).

Local rank 0 reports, every window of steps, its node's own work per step against the other
nodes'. :class:`PaceJudge` turns that into at most one verdict per generation: the node is
slow (an event, and with ``--evict-stragglers`` a leave in place), or it is not (nothing).
Pure: the agent does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from efdl.protocol.messages import Paced
from efdl.worker.pace import verdict


@dataclass(frozen=True, slots=True)
class Slow:
    """This node was found slow: what to say, and whether it may leave for it."""

    text: str
    ratio: float
    evict: bool


class PaceJudge:
    """At most one verdict per generation, from the node's pace reports."""

    def __init__(self, ratio: float, evict: bool) -> None:
        self._ratio = ratio
        self._evict = evict
        self._judged: int | None = None  # the generation this node was found slow in
        self.last_ratio = 1.0

    def judge(
        self, ev: Paced, workers: int, others: int, spares: int, min_workers: int
    ) -> Slow | None:
        """``ev`` from local rank 0; ``workers`` of this node and ``others`` of the other
        nodes in the round, its ``spares`` (nodes waiting), the job's ``min_workers``: this
        node's verdict, or None."""
        self.last_ratio = ev.node_s / ev.others_s if ev.others_s > 0 else 1.0
        if self._judged == ev.generation or not verdict(ev.node_s, ev.others_s, self._ratio):
            return None
        self._judged = ev.generation
        text = (
            f"slow: its own work per step took {self.last_ratio:.2f}x the other nodes' "
            f"({ev.node_s:.3f} s against {ev.others_s:.3f} s, medians over {ev.steps} steps; "
            f"--straggler-ratio {self._ratio:g})"
        )
        if not self._evict:
            return Slow(text + "; not evicted (--evict-stragglers is off)", self.last_ratio, False)
        if ev.slower:  # one at a time, the slowest first: two slow nodes judging alone
            # that the others keep --min would both leave and break it
            return Slow(
                text + f"; not evicted now: {ev.slower} node(s) slower still leave first",
                self.last_ratio,
                False,
            )
        if others + spares < min_workers:  # (a spare offers at least one worker)
            return Slow(
                text + f"; not evicted: the other nodes hold {others} worker(s) and "
                f"{spares} spare(s) wait, which may not make --min {min_workers}",
                self.last_ratio,
                False,
            )
        return Slow(text + f"; leaving in place ({workers} worker(s))", self.last_ratio, True)
