"""Hosts held out of a fleet (efdl.rendezvous.holds under ``/efdl-fleet/<fleet>/holds/``):
drained by an operator (``efdl drain --fleet``), or quarantined by the host's own daemon when
a job quarantined one of its agents there (a health check that failed, a crash loop, a
straggler: efdl.launcher.holding). The allocator gives a held host's GPUs to no job.

A job's quarantine holds one agent out of one job; the GPU it found bad would otherwise stay
assigned to that job, idle, or go to the next job to crash on it. The host's daemon carries
the quarantine up to the fleet, for as long as the job's lasts, so that no job is placed on
the host until it ends or an operator releases it (``efdl release --fleet``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Iterable, Mapping

from efdl.errors import StoreError
from efdl.fleet.records import FleetKeys
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.holds import Hold, HoldKind, hold, parse_holds
from efdl.rendezvous.records import JobKeys

log = logging.getLogger(__name__)


def agent_prefix(host_id: str) -> str:
    """How the node ids of a host's agents begin (efdl.fleet.spawn names them
    ``<host>-g<first GPU>-<4 hex>``): the host id, or where it is longer than 80 characters
    (a node id has 128 at most), its first 71 and 8 hex of its hash, so that two hosts whose
    ids begin alike never share their agents' names."""
    if len(host_id) > 80:
        host_id = f"{host_id[:71]}-{hashlib.blake2b(host_id.encode(), digest_size=4).hexdigest()}"
    return f"{host_id}-g"


def _agent_of(node: str, host_id: str) -> bool:
    """Whether ``node`` names an agent of ``host_id`` (not merely one of a host whose name
    begins the same way: ``a-g0``'s agents begin with ``a-g`` too)."""
    prefix = agent_prefix(host_id)
    return node.startswith(prefix) and _AGENT_TAIL.fullmatch(node[len(prefix) :]) is not None


_AGENT_TAIL = re.compile(r"[0-9]+-[0-9a-f]{4}")


def carried_quarantine(
    host_id: str,
    job_holds: Mapping[str, Mapping[str, Hold]],
    current: Hold | None,
    wall: float,
) -> Hold | None:
    """The fleet hold that ``host_id`` should get from its jobs' holds (job id -> node id ->
    hold), None if none: the quarantine in force on one of its agents that ends last, as a
    quarantine of the host until then, unless the host is held already (a drain, or a
    quarantine that ends as late)."""
    found = [
        (h.until, job, h)
        for job, holds in sorted(job_holds.items())
        for node, h in sorted(holds.items())
        if _agent_of(node, host_id)
        and h.kind is HoldKind.QUARANTINE
        and h.active(wall)
        and h.until is not None
    ]
    if not found:
        return None
    until, job, h = max(found, key=lambda f: f[0])
    held = current is not None and current.active(wall)
    if held and current is not None and (current.until is None or current.until >= until):
        return None
    return Hold(
        host_id,
        HoldKind.QUARANTINE,
        f"job {job} quarantined its node {h.node}: {h.reason}",
        wall,
        until,
    )


def carry_quarantines(
    store: KVStore,
    keys: FleetKeys,
    host_id: str,
    jobs: Iterable[str],
    fleet_holds: Mapping[str, Hold],
) -> Hold | None:
    """Read the holds of ``jobs`` (those with agents on this host) and hold the host out of
    the fleet if one of its agents is quarantined (:func:`carried_quarantine`). Returns the
    hold written, None if none. Best effort: an etcd failure is logged, and the next pass
    tries again."""
    wall = time.time()
    try:
        job_holds = {
            job: parse_holds(store.get_prefix(JobKeys(job).holds).kvs, JobKeys(job))
            for job in sorted(set(jobs))
        }
        h = carried_quarantine(host_id, job_holds, fleet_holds.get(host_id), wall)
        if h is None:
            return None
        written = hold(store, keys, host_id, h.kind, h.reason, h.until - wall if h.until else None)
    except StoreError as exc:
        log.warning("Host %s: cannot read or write holds (%s); trying again later.", host_id, exc)
        return None
    log.warning("Host %s: held out of fleet %s: %s.", host_id, keys.fleet, written.describe(wall))
    return written
