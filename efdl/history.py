"""A job's history, read: its events in etcd under ``events/`` (written by
efdl.rendezvous.event_log), as ``efdl events``, ``status`` and ``timeline`` show them.

Every round (by the leader), join, leave, crash, eviction, lost lease, hang, restart, persist,
resume and rescale (by the agent where it happened) is one small record under
``/efdl/<job>/events/<time in ns>-<node>``: keys sort by time, and two agents never write
the same key. They are not bound to a lease: the history outlives the nodes (and a new run
of the job). A writer keeps the newest :data:`LIMIT` events: after every :data:`TRIM_EVERY`
of its own writes it deletes the oldest beyond that (any agent may; deleting twice is
harmless). Writes go through a queue to a daemon thread, so nothing on an agent's path to the
next step waits for etcd; an event that cannot be written is dropped with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from efdl.rendezvous.api import KVStore
from efdl.rendezvous.records import Event, EventKind, JobKeys, RecordError, RoundStatus

log = logging.getLogger(__name__)


def parse_events(kvs: Iterable[tuple[str, bytes]], keys: JobKeys) -> list[Event]:
    """The events among ``(key, value)`` pairs, oldest first; a bad one is logged, skipped."""
    events = []
    for key, value in kvs:
        try:
            events.append(Event.from_json(value, key))
        except RecordError as exc:
            log.error("Job %s: ignoring a bad event: %s", keys.job_id, exc)
    return sorted(events, key=lambda e: e.time)


def read_events(store: KVStore, job_id: str, since: float = 0.0) -> tuple[list[Event], int]:
    """The job's events at or after ``since`` (wall-clock seconds), oldest first, and the
    revision they were read at (to watch from the next one)."""
    keys = JobKeys(job_id)
    snap = store.get_prefix(keys.events)
    events = parse_events(((kv.key, kv.value) for kv in snap.kvs), keys)
    return [e for e in events if e.time >= since], snap.revision


def follow_events(store: KVStore, job_id: str, revision: int) -> Iterator[Event]:
    """The job's events written after ``revision``, as they come (until interrupted)."""
    keys = JobKeys(job_id)
    with store.watch(keys.events, prefix=True, start_revision=revision + 1) as watch:
        while True:
            batch = watch.get(timeout_s=1.0)
            if batch is None:
                continue
            puts = [(ev.kv.key, ev.kv.value) for ev in batch.events if ev.kv.value]
            yield from parse_events(puts, keys)


def _first_active(events: list[Event]) -> float | None:
    return next((e.time for e in events if e.round_status is RoundStatus.ACTIVE), None)


def still_intervals(events: list[Event], now: float) -> list[tuple[float, float, str]]:
    """When training stood still, as (start, end, why): the rescales' pauses that in-place
    workers measured (ending at the rescale event; in restart mode the node of rank 0 measures
    them from its workers' optimizer steps, efdl.launcher.stepwatch), and the time in waiting
    rounds (below --min) until the next round."""
    first = _first_active(events)
    if first is None:
        return []
    spans = [
        (e.time - e.seconds, e.time, "rescale")
        for e in events
        if e.kind is EventKind.RESCALE and e.seconds > 0
    ]
    waiting_since: float | None = None
    for e in events:
        if e.round_status is None or e.time < first:
            continue
        if e.round_status is RoundStatus.WAITING:
            waiting_since = e.time if waiting_since is None else waiting_since
        elif waiting_since is not None:
            spans.append((waiting_since, e.time, "waiting"))
            waiting_since = None
    if waiting_since is not None:
        spans.append((waiting_since, now, "waiting"))
    return sorted(spans)


def stood_still(events: list[Event], now: float) -> tuple[float, float]:
    """(trained, stood still) seconds since the first active round: see
    :func:`still_intervals`; the rest of the time counts as trained."""
    first = _first_active(events)
    if first is None:
        return 0.0, 0.0
    total = max(0.0, now - first)
    still = min(total, sum(end - start for start, end, _ in still_intervals(events, now)))
    return total - still, still


def format_event(e: Event) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
    extra = []
    if e.world_size:
        extra.append(f"world {e.world_size}")
    if e.step >= 0:
        extra.append(f"step {e.step}")
    if e.seconds >= 0:
        extra.append(f"{e.seconds:.2f} s")
    tail = f" ({', '.join(extra)})" if extra else ""
    ms = int(e.time * 1000) % 1000
    return f"{when}.{ms:03d}  gen {e.generation:<4} {e.kind.value:<8} {e.node}: {e.text}{tail}"
