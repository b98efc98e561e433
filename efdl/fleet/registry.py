"""The fleet's records in etcd (efdl.fleet.records): what ``efdl submit``, ``efdl jobs`` and
``efdl cancel`` do, what the allocator reads, and how it writes a decision.

A decision is written with compare-and-swap: only while its writer leads (its election key
still stands), and only if no job's status changed since it was read (a cancel, a daemon
marking a job finished); otherwise nothing is written and the allocator decides again from
a fresh read. etcd caps a transaction at 128 operations, so a large decision goes in
several: every status that gives GPUs up is written before any that takes GPUs, so a
transaction that fails leaves GPUs idle until the next decision, never two jobs on one GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from efdl.errors import ConfigError
from efdl.fleet.allocate import Allocation, Job
from efdl.fleet.records import FleetEvent, FleetKeys, Host, JobSpec, JobStatus, Phase
from efdl.rendezvous.api import Compare, Delete, KVStore, Put
from efdl.rendezvous.holds import Hold, parse_holds
from efdl.rendezvous.records import JobKeys, RecordError

log = logging.getLogger(__name__)

_TXN_OPS = 128  # etcd's default --max-txn-ops


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet as read at one revision.

    Attributes:
        hosts: the live hosts.
        jobs: every job with a valid spec (its status QUEUED if it has none yet).
        status_revisions: each job's status key's mod revision (0: none), the tokens a
            decision's compare-and-swap uses.
        revision: the etcd revision the jobs were read at.
        problems: the records that did not parse (skipped; each names its key and field).
        holds: the hosts held out of the fleet (drained, quarantined), ended ones included
            (``Hold.active`` tells), by host id.
    """

    hosts: tuple[Host, ...]
    jobs: tuple[Job, ...]
    status_revisions: dict[str, int]
    revision: int
    problems: tuple[str, ...] = ()
    holds: dict[str, Hold] = field(default_factory=dict)

    def held(self, wall: float) -> dict[str, str]:
        """The hosts held out at wall-clock ``wall``, each with its hold's description."""
        return {h: hold.describe(wall) for h, hold in self.holds.items() if hold.active(wall)}


def read_fleet(store: KVStore, keys: FleetKeys) -> FleetView:
    """Every host, hold and job of the fleet (three reads: the events and the election stay
    out)."""
    jobs_snap = store.get_prefix(keys.jobs)
    holds = parse_holds(store.get_prefix(keys.holds).kvs, keys)
    kvs = (*store.get_prefix(keys.hosts).kvs, *jobs_snap.kvs)
    hosts: list[Host] = []
    specs: dict[str, JobSpec] = {}
    statuses: dict[str, tuple[JobStatus, int]] = {}
    problems: list[str] = []
    for kv in kvs:
        try:
            if kv.key.startswith(keys.hosts):
                hosts.append(Host.from_json(kv.value, kv.key))
            elif kv.key.startswith(keys.jobs) and kv.key.endswith("/spec"):
                specs[FleetKeys.job_of(kv.key)] = JobSpec.from_json(kv.value, kv.key)
            elif kv.key.startswith(keys.jobs) and kv.key.endswith("/status"):
                status = JobStatus.from_json(kv.value, kv.key)
                statuses[FleetKeys.job_of(kv.key)] = (status, kv.mod_revision)
        except RecordError as exc:
            problems.append(str(exc))
            log.error("Fleet %s: skipping a bad record: %s", keys.fleet, exc)
    jobs = tuple(Job(s, statuses.get(j, (JobStatus(), 0))[0]) for j, s in sorted(specs.items()))
    revisions = {j: statuses.get(j, (JobStatus(), 0))[1] for j in specs}
    return FleetView(tuple(hosts), jobs, revisions, jobs_snap.revision, tuple(problems), holds)


def status_writes(
    keys: FleetKeys, job_id: str, status: JobStatus, now: float | None = None
) -> list[Put]:
    """A job's new status and its fleet event (every status change is one: the history that
    ``efdl jobs --history`` and ``efdl timeline --fleet`` read)."""
    event = FleetEvent(status.changed if now is None else now, job_id, status)
    return [Put(keys.status(job_id), status.to_json()), Put(event.key(keys), event.to_json())]


def read_events(
    store: KVStore, keys: FleetKeys, since: float | None = None
) -> tuple[list[FleetEvent], list[str]]:
    """The fleet's events in time order (since ``since``: only those are read), and the
    records that did not parse (skipped; each names its key and field)."""
    start = keys.events if since is None else keys.events_at(since)
    events: list[FleetEvent] = []
    problems: list[str] = []
    for kv in store.get_range(start, keys.events_end).kvs:
        try:
            events.append(FleetEvent.from_json(kv.value, kv.key))
        except RecordError as exc:
            problems.append(str(exc))
    events.sort(key=lambda e: (e.time, e.job_id))
    return events, problems


def prune_events(store: KVStore, keys: FleetKeys, before: float) -> int:
    """Delete the fleet's events from before ``before``, but for each job's last one then
    when the job was not over (where it stood at ``before``: a job holding GPUs since still
    shows on them); records that do not parse go too. Returns how many went."""
    old = store.get_range(keys.events, keys.events_at(before)).kvs
    last: dict[str, tuple[str, bool]] = {}  # job -> its last old event's key, and whether over
    for kv in old:  # in key order: time order
        try:
            event = FleetEvent.from_json(kv.value, kv.key)
        except RecordError:
            continue
        last[event.job_id] = (kv.key, event.status.phase.final)
    keep = {key for key, over in last.values() if not over}
    doomed = [kv.key for kv in old if kv.key not in keep]
    for i in range(0, len(doomed), _TXN_OPS):
        store.txn([], [Delete(k) for k in doomed[i : i + _TXN_OPS]])
    return len(doomed)


def submit(store: KVStore, keys: FleetKeys, spec: JobSpec) -> JobStatus:
    """Put ``spec`` into the fleet, queued. A job id that the fleet already runs, or that a
    job started by hand uses (its agents are registered), is refused; a finished, failed or
    cancelled job of that id is replaced.

    Raises:
        ConfigError: the id is taken (the message says by what).
    """
    if store.get_prefix(JobKeys(spec.job_id).nodes).kvs:
        raise ConfigError(
            f"Job id {spec.job_id!r} is in use by a job started with efdl-run (its agents are "
            "registered in etcd); choose another id, or stop that job first (efdl stop)."
        )
    status = JobStatus(Phase.QUEUED, (), time.time(), "submitted")
    writes = [Put(keys.spec(spec.job_id), spec.to_json())]
    writes += status_writes(keys, spec.job_id, status)
    existing = store.get(keys.status(spec.job_id))
    if existing is not None:
        old = JobStatus.from_json(existing.value, existing.key)
        if not old.phase.final:
            raise ConfigError(
                f"Job {spec.job_id!r} is already in fleet {keys.fleet!r} ({old.phase.value}); "
                "cancel it first (efdl cancel), or choose another id."
            )
        compare = [Compare.mod_revision_is(keys.status(spec.job_id), existing.mod_revision)]
    else:
        compare = [Compare.absent(keys.spec(spec.job_id)), Compare.absent(keys.status(spec.job_id))]
    if not store.txn(compare, writes).succeeded:
        raise ConfigError(
            f"Job {spec.job_id!r} was submitted or changed by someone else at the same moment; "
            "see efdl jobs, and submit again if it is not there."
        )
    return status


def cancel(store: KVStore, keys: FleetKeys, job_id: str, reason: str = "cancelled") -> JobStatus:
    """Mark ``job_id`` cancelled: its hosts stop its agents (a graceful leave: the workers
    finish their step; with a cache, the state is persisted). Cancelling a job that has
    ended already changes nothing.

    Raises:
        ConfigError: the fleet has no such job.
    """
    for _ in range(10):
        kv = store.get(keys.status(job_id))
        if kv is None:
            raise ConfigError(f"Fleet {keys.fleet!r} has no job {job_id!r} (see efdl jobs).")
        old = JobStatus.from_json(kv.value, kv.key)
        if old.phase.final:
            return old
        new = JobStatus(Phase.CANCELLED, (), time.time(), reason)
        compare = [Compare.mod_revision_is(keys.status(job_id), kv.mod_revision)]
        if store.txn(compare, status_writes(keys, job_id, new)).succeeded:
            return new
    raise ConfigError(
        f"Job {job_id!r}'s status kept changing while it was being cancelled; try again."
    )


def write_decision(
    store: KVStore,
    keys: FleetKeys,
    view: FleetView,
    decision: Allocation,
    leading: Compare,
    now: float,
) -> bool:
    """Write ``decision`` (made from ``view``) while ``leading`` holds; False when it was not
    written because the leadership or a job's status changed (decide again). Each status goes
    with its fleet event; statuses that give GPUs up go first (this module's docstring)."""
    before = {j.spec.job_id: j.status for j in view.jobs}
    order = sorted(
        decision.statuses.items(),
        key=lambda item: (item[1].size > before[item[0]].size, item[0]),
    )
    per_txn = _TXN_OPS // 2 - 1
    for start in range(0, len(order), per_txn):
        chunk = order[start : start + per_txn]
        compare = [leading]
        compare += [
            Compare.mod_revision_is(keys.status(j), view.status_revisions[j]) for j, _ in chunk
        ]
        puts = [p for j, s in chunk for p in status_writes(keys, j, s, now)]
        if not store.txn(compare, puts).succeeded:
            log.info(
                "Fleet %s: a decision was not written (the leadership or a job's status "
                "changed since the read); deciding again.",
                keys.fleet,
            )
            return False
    return True
