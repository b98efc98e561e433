"""A job's history: its events in etcd under ``events/``, bounded, written off the hot path.

Every round (by the leader), join, leave, crash, eviction, fencing, restart, persist, resume
and rescale (by the agent where it happened) is one small record under
``/efdl/<job>/events/<time in ns>-<node>``: keys sort by time, and two agents never write
the same key. They are not bound to a lease: the history outlives the nodes (and a new run
of the job). A writer keeps the newest :data:`LIMIT` events: after every :data:`TRIM_EVERY`
of its own writes it deletes the oldest beyond that (any agent may; deleting twice is
harmless). Writes go through a queue to a daemon thread, so nothing on an agent's path to the
next step waits for etcd; an event that cannot be written is dropped with a warning.
"""

from __future__ import annotations

import enum
import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from efdl.errors import StoreError
from efdl.rendezvous.api import Delete, KVStore
from efdl.rendezvous.model import JobKeys, RecordError

log = logging.getLogger(__name__)

LIMIT = 2000  # events kept per job (about 200 bytes each)
TRIM_EVERY = 64  # a writer trims after this many of its own writes
_TXN_OPS = 128  # etcd's default --max-txn-ops


class Kind(enum.StrEnum):
    ROUND = "round"  # the leader wrote a round (any status)
    JOIN = "join"
    LEAVE = "leave"
    CRASH = "crash"  # a worker failed
    RESTART = "restart"  # workers restarted, or a lost in-place worker replaced
    EVICT = "evict"  # a dead node's lease ended on evidence (efdl.rendezvous.probe)
    FENCED = "fenced"  # this node's lease was lost: workers killed, joining again
    PERSIST = "persist"  # rank 0 wrote a snapshot to the remote cache
    RESUME = "resume"  # the job resumed from the remote cache
    RESCALE = "rescale"  # training went on at a new size; ``seconds``: how long it stood still


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to the job.

    Attributes:
        time: wall-clock seconds.
        kind: what.
        node: the node it happened on (for a round: the leader).
        generation: the round generation it happened in (or made).
        text: one line for people.
        world_size: the world size it left or made, where that means something (0: none).
        step: the training step it concerns (-1: none).
        seconds: a duration it measured (rescale: stood still; persist: writing), or -1.
    """

    time: float
    kind: Kind
    node: str
    generation: int
    text: str
    world_size: int = 0
    step: int = -1
    seconds: float = -1.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes, key: str) -> Event:
        where = f"The event at {key}"
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise RecordError(f"{where} is not JSON: {exc}.") from None
        if not isinstance(data, dict):
            raise RecordError(f"{where} must be a JSON object.")
        try:
            kind = Kind(str(data.get("kind")))
        except ValueError:
            raise RecordError(
                f"{where} has kind {data.get('kind')!r}; expected one of "
                f"{', '.join(k.value for k in Kind)}."
            ) from None
        fields: dict[str, type | tuple[type, ...]] = {
            "time": (int, float),
            "node": str,
            "generation": int,
            "text": str,
            "world_size": int,
            "step": int,
            "seconds": (int, float),
        }
        for name, want in fields.items():
            value = data.get(name)
            if not isinstance(value, want) or isinstance(value, bool):
                raise RecordError(f"{where} field {name!r} is {value!r}; expected {want}.")
        return Event(
            float(data["time"]),
            kind,
            data["node"][:128],
            data["generation"],
            data["text"][:1000],
            data["world_size"],
            data["step"],
            float(data["seconds"]),
        )

    def key(self, keys: JobKeys) -> str:
        return f"{keys.events}{int(self.time * 1e9):019d}-{self.node}"


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
    return next(
        (e.time for e in events if e.kind is Kind.ROUND and e.text.startswith("active")), None
    )


def still_intervals(events: list[Event], now: float) -> list[tuple[float, float, str]]:
    """When training stood still, as (start, end, why): the rescales' pauses that in-place
    workers measured (ending at the rescale event), and the time in waiting rounds (below
    --min) until the next round. (Restart mode measures no pauses.)"""
    first = _first_active(events)
    if first is None:
        return []
    spans = [
        (e.time - e.seconds, e.time, "rescale")
        for e in events
        if e.kind is Kind.RESCALE and e.seconds > 0
    ]
    waiting_since: float | None = None
    for e in events:
        if e.kind is not Kind.ROUND or e.time < first:
            continue
        if e.text.startswith("waiting"):
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


class EventLog:
    """Writes one agent's events to etcd from a daemon thread; :meth:`record` never blocks."""

    def __init__(self, store: KVStore, job_id: str, node_id: str) -> None:
        self._store = store
        self._keys = JobKeys(job_id)
        self._node = node_id
        self._queue: queue.Queue[Event | None] = queue.Queue(maxsize=10_000)
        self._written = 0
        self._thread = threading.Thread(target=self._run, name="efdl-events", daemon=True)
        self._thread.start()

    def record(
        self,
        kind: Kind,
        generation: int,
        text: str,
        world_size: int = 0,
        step: int = -1,
        seconds: float = -1.0,
        node: str = "",
    ) -> None:
        """Record an event of this node (or of ``node``: an eviction names the evicted)."""
        event = Event(
            time.time(), kind, node or self._node, generation, text, world_size, step, seconds
        )
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            log.warning("Dropping the event %s: too many not written yet.", kind.value)

    def _run(self) -> None:
        while (event := self._queue.get()) is not None:
            try:
                self._store.put(event.key(self._keys), event.to_json())
                self._written += 1
                if self._written % TRIM_EVERY == 0:
                    trim(self._store, self._keys)
            except StoreError as exc:
                log.warning("Could not record the event %s (%s).", event.kind.value, exc)

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued, for up to ``timeout_s``."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def trim(store: KVStore, keys: JobKeys, limit: int = LIMIT) -> int:
    """Delete the job's oldest events beyond ``limit``; how many were deleted."""
    snap = store.get_prefix(keys.events)
    doomed = sorted(kv.key for kv in snap.kvs)[: max(0, len(snap.kvs) - limit)]
    for i in range(0, len(doomed), _TXN_OPS):
        store.txn([], [Delete(k) for k in doomed[i : i + _TXN_OPS]])
    return len(doomed)
