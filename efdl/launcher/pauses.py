"""Restart mode's measure of the time training stood still for a round.

Plain scripts say nothing of a rescale: restarted with the new ranks, they only step again
(efdl.launcher.stepwatch). So the agent takes the pause from its workers' last step before
the round to the first step of the workers it restarted for it; the node of rank 0 records
it in the job's history, as in-place rank 0 records a rescale's.
"""

from __future__ import annotations

from efdl.rendezvous.records import Round


class PauseClock:
    """When this node's workers last stepped (wall clock), and, while workers restarted for a
    round have not stepped yet, the last step before it."""

    def __init__(self) -> None:
        self._last_step = 0.0
        self._from: float | None = None

    def restarting(self) -> None:
        """The workers are restarted for a round: training stands still from their last step
        (if they made one) to the next."""
        if self._last_step > 0:
            self._from = self._last_step

    def stepped(self, at: float, in_place: bool, r: Round | None) -> float | None:
        """A worker of this node's running ones stepped at ``at`` (``in_place``: an
        efdl-aware one, whose rank 0 says its own rescales; ``r``: the round the workers
        run). Returns how long training stood still if this step ends a pause that this
        node records (it runs rank 0), else None."""
        self._last_step = max(self._last_step, at)
        pause, self._from = self._from, None  # set only after steps: see restarting
        if pause is None or in_place or r is None or r.member is None:
            return None
        if r.member.first_rank != 0:
            return None  # the node of rank 0 says it, once
        return max(0.0, at - pause)
