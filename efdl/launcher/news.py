"""What this node's workers tell their agent of their training, and what the agent makes of
it: a step (which ends restart mode's pause: efdl.launcher.pauses), the node's pace (a
straggler's verdict: efdl.launcher.stragglers), a snapshot persisted to the cache (the job's
cache record and the history), a hang found from outside (the worker killed)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from efdl.launcher.hangs import hang_text
from efdl.launcher.job_progress import JobProgress
from efdl.launcher.metrics import Metrics
from efdl.launcher.node_workers import NodeWorkers
from efdl.launcher.pauses import PauseClock
from efdl.launcher.stragglers import PaceJudge, Slow
from efdl.protocol.messages import Paced, Persisted, Stepped
from efdl.rendezvous.records import EventKind
from efdl.worker.hang import Hang

log = logging.getLogger(__name__)

Record = Callable[..., None]  # (kind, generation, text, **fields): into the job's history


class WorkerNews:
    """Judges the news of ``workers`` for the agent; ``record`` writes an event of the job."""

    def __init__(
        self,
        workers: NodeWorkers,
        pace: PaceJudge,
        min_workers: int,
        metrics: Metrics,
        progress: JobProgress,
        record: Record,
        tag: Callable[[], str],
    ) -> None:
        self._workers = workers
        self._pace = pace
        self._min_workers = min_workers
        self._metrics = metrics
        self._progress = progress
        self._record = record
        self._tag = tag
        self.pauses = PauseClock()  # restart mode's measure of a pause

    def stepped(self, ev: Stepped) -> None:
        """A worker of this node stepped: the first step of workers restarted for a round
        ends the time training stood still (efdl.launcher.pauses)."""
        if self._workers.find(ev.pid) is None:
            return  # a worker of a generation that is gone
        r = self._workers.round
        still = self.pauses.stepped(ev.time, ev.pid in self._workers.in_place, r)
        if still is not None and r is not None:
            text = f"training went on at world size {r.world_size} (workers restarted)"
            self._record(
                EventKind.RESCALE, r.generation, text, world_size=r.world_size, seconds=still
            )

    def paced(self, ev: Paced) -> Slow | None:
        """Local rank 0 told how this node's own work per step compares with the other
        nodes' (efdl.worker.pace): a metric, and once per generation a verdict (returned when
        the node is slow, for the agent to hold it out if it says so)."""
        r = self._workers.round
        mine = r.member if r is not None else None
        if r is None or mine is None or ev.generation != r.generation:
            return None  # a report of a generation that is gone
        others = r.world_size - mine.workers
        slow = self._pace.judge(ev, mine.workers, others, r.spares, self._min_workers)
        self._metrics.pace_ratio.set(self._pace.last_ratio)
        if slow is not None:
            log.warning("%s: %s.", self._tag(), slow.text)
            self._record(EventKind.SLOW, ev.generation, slow.text)
        return slow

    def persisted(self, ev: Persisted, url: str, generation: int) -> None:
        """Rank 0 persisted a snapshot to the cache at ``url``: the job's cache record, its
        history and the metrics say so."""
        self._progress.persisted(ev, url)
        self._record(
            EventKind.PERSIST,
            generation,
            f"persisted {ev.bytes / 1e6:.1f} MB to {url}",
            world_size=ev.world_size,
            step=ev.step,
            seconds=ev.seconds,
        )
        self._metrics.persisted(ev.step, ev.bytes, ev.seconds)

    def hung(self, pid: int, hang: Hang, generation: int) -> None:
        """Kill a hung worker (its peers wait on it): its exit then replaces it in place,
        as any lost worker (the job shrinks, then grows back)."""
        worker = self._workers.find(pid)
        if worker is None:
            return
        text = hang_text(worker.rank, pid, hang)
        log.error("%s: %s: killing it.", self._tag(), text)
        self._record(EventKind.HANG, generation, text, step=hang.step)
        worker.signal_group(signal.SIGKILL)
