"""The fleet's one allocator: elected among candidates (every ``efdl node`` daemon, or
``efdl allocator``), it reads the fleet, decides (efdl.fleet.allocate) and writes the decision
with compare-and-swap (efdl.fleet.registry).

The election is the rendezvous's (efdl.rendezvous.election): each candidate puts
``leader/<id>`` under its lease; the one whose key was created first leads, and each other
watches the key created just before its own, so a leader's death (its lease expires) hands
over to exactly one successor without a herd. The leader decides when a host or a job record
changes, and at least every ``period_s`` (a job's resize interval ends with no record
changing), but at most once per ``gap_s``: what changes meanwhile (a thousand hosts'
records at a fleet's start, inference moving on many hosts) makes one decision.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from efdl.errors import StoreError
from efdl.fleet.allocate import Allocation, allocate
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import FleetKeys
from efdl.fleet.registry import FleetView, prune_events, read_fleet, write_decision
from efdl.rendezvous.api import Compare, KVStore, Watch, WatchBatch, WatchSink
from efdl.rendezvous.election import Election

log = logging.getLogger(__name__)

RETRY_S = 1.0  # how long to wait before trying etcd again after a failure


def stand(
    election: Election,
    key: str,
    lease: int,
    stop: threading.Event,
    lead: Callable[[Compare, threading.Event], None],
    leading: threading.Event,
) -> None:
    """Stand for ``election`` under ``key`` (bound to ``lease``) and ``lead(guard, stop)``
    while this candidate leads, until ``stop``: the fleet's allocator and its Kubernetes
    controller alike. ``lead`` returns when it no longer leads; then it stands again if its
    key is still there. etcd failing is waited out (every :data:`RETRY_S`), standing again on
    the same lease; ``leading`` is cleared whenever it does not lead."""
    try:
        while not stop.is_set():
            try:
                _stand_once(election, key, lease, stop, lead, leading)
            except StoreError as exc:
                leading.clear()
                log.warning("%s: etcd failed (%s); standing again in %.0f s.", key, exc, RETRY_S)
                stop.wait(RETRY_S)
    finally:
        leading.clear()


def _stand_once(
    election: Election,
    key: str,
    lease: int,
    stop: threading.Event,
    lead: Callable[[Compare, threading.Event], None],
    leading: threading.Event,
) -> None:
    campaign = election.campaign(key, b"{}", lease)
    me = campaign.candidate
    if me is None:
        if campaign.holder is not None:
            log.warning(
                "%s is held under another lease (%x): an earlier run of this candidate whose "
                "lease has not expired yet, or another candidate started with the same id. "
                "Standing once it goes.",
                key, campaign.holder.lease,
            )  # fmt: skip
            election.wait_gone(campaign.holder, stop)
        return
    while not stop.is_set():
        leading.clear()
        if not election.wait(me, stop):
            return
        lead(me.guard, stop)
        if not election.stands(me):  # no longer leading: still standing?
            return


PRUNE_EVERY_S = 3600.0  # how often the leader deletes events older than FleetPolicy.history_s


class Allocator:
    """One candidate for the fleet's allocator; :meth:`run` until ``stop`` is set.

    Args:
        store: the fleet's etcd.
        keys: the fleet.
        candidate_id: this candidate's id (a host id), unique in the fleet.
        lease: the candidate's lease id (its daemon's): the election key goes with it.
        policy: the allocator's settings.
        period_s: decide at least this often while leading.
        gap_s: decide at most this often (changes that come within it wait for its end).
        clock: wall-clock seconds (the records' times); an argument for tests.
        on_decision: called after each decision written (tests, metrics).
    """

    def __init__(
        self,
        store: KVStore,
        keys: FleetKeys,
        candidate_id: str,
        lease: int,
        policy: FleetPolicy | None = None,
        period_s: float = 5.0,
        gap_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        on_decision: Callable[[Allocation], None] | None = None,
    ) -> None:
        self._store = store
        self._keys = keys
        self._key = keys.leader + candidate_id
        self._election = Election(store, keys.leader, f"Fleet {keys.fleet}")
        self._lease = lease
        self._policy = policy or FleetPolicy()
        self._period_s = period_s
        self._gap_s = gap_s
        self._clock = clock
        self._on_decision = on_decision
        self._inbox: queue.Queue[WatchBatch | StoreError] = queue.Queue()
        self.leading = threading.Event()
        self._missing: dict[str, float] = {}  # host id -> when this leader saw its record gone
        self._pruned = float("-inf")  # when this leader last deleted old events

    def run(self, stop: threading.Event) -> None:
        """Stand for election, and allocate while leading, until ``stop`` (:func:`stand`)."""
        stand(self._election, self._key, self._lease, stop, self._lead, self.leading)

    def _sink(self) -> WatchSink:
        return self._inbox.put

    def _lead(self, leading: Compare, stop: threading.Event) -> None:
        log.info("Fleet %s: %s leads the allocator.", self._keys.fleet, self._key)
        self.leading.set()
        watches: list[Watch] = []
        try:
            start = self._store.get_prefix(self._keys.hosts).revision + 1
            for prefix in (self._keys.hosts, self._keys.holds, self._keys.jobs):
                watches.append(
                    self._store.watch(prefix, prefix=True, start_revision=start, sink=self._sink())
                )
            while not stop.is_set():
                decided = time.monotonic()
                if not self.decide(leading):
                    return  # no longer leading
                try:
                    item = self._inbox.get(timeout=self._period_s)
                except queue.Empty:
                    continue
                if stop.wait(max(0.0, decided + self._gap_s - time.monotonic())):
                    return
                while True:  # one decision for what came together
                    if isinstance(item, StoreError):
                        raise item
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
        finally:
            for w in watches:
                w.cancel()
            self.leading.clear()

    def _lingering(self, view: FleetView, now: float) -> set[str]:
        """The hosts that jobs hold GPUs on whose record went less than the grace ago (as
        this leader saw it go; a new leader starts the grace again)."""
        present = {h.host_id for h in view.hosts}
        held = {h for j in view.jobs for h, _ in j.status.gpus} - present
        self._missing = {h: self._missing.get(h, now) for h in held}
        return {h for h, since in self._missing.items() if now - since < self._policy.host_grace_s}

    def _prune(self) -> None:
        """Delete the events older than the policy's history, hourly (on the clock)."""
        now = self._clock()
        if now - self._pruned < PRUNE_EVERY_S:
            return
        self._pruned = now
        gone = prune_events(self._store, self._keys, now - self._policy.history_s)
        if gone:
            log.info(
                "Fleet %s: deleted %d events older than %.1f days.",
                self._keys.fleet, gone, self._policy.history_s / 86400,
            )  # fmt: skip

    def decide(self, leading: Compare) -> bool:
        """One decision (read the fleet, allocate, write while ``leading`` holds); False if
        this candidate no longer leads. The leader's loop calls it; so does the fleet
        benchmark, on a simulated clock."""
        self._prune()
        for _ in range(5):
            view = read_fleet(self._store, self._keys)
            now = self._clock()
            decision = allocate(
                view.hosts,
                view.jobs,
                now,
                self._policy,
                self._lingering(view, now),
                view.held(now),
            )
            for reason in decision.reasons:
                log.info("Fleet %s: job %s: %s", self._keys.fleet, reason.job_id, reason.text)
            if not decision.statuses:
                return True
            if write_decision(self._store, self._keys, view, decision, leading, now):
                if self._on_decision is not None:
                    self._on_decision(decision)
                return True
            mine = self._store.get(leading.key)
            if mine is None or mine.create_revision != leading.revision:
                return False
        return True
