"""Reading a job's records from etcd: its round, its node records, the round's members (a
record that does not parse is logged and skipped, never acted on); and :func:`retried`, for a
one-off etcd call that must outlast a blip."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from efdl.errors import (
    CompactedError,
    LeaseLostError,
    StoreAuthError,
    StoreError,
)
from efdl.rendezvous.api import (
    KeyValue,
    KVStore,
)
from efdl.rendezvous.decide import NodeView
from efdl.rendezvous.records import (
    JobKeys,
    Member,
    NodeRecord,
    RecordError,
    Round,
    RoundStatus,
)

log = logging.getLogger(__name__)

# How long a one-off etcd call (a restart request, the job's end, a store publication) keeps
# trying through an etcd blip before the agent gives up on it. Each attempt already fails over
# between members within the request timeout; this spans a restart of etcd itself.
BLIP_S = 30.0

T = TypeVar("T")


def retried(what: str, fn: Callable[[], T], timeout_s: float = BLIP_S, pause_s: float = 0.5) -> T:
    """``fn()``, tried again (``pause_s`` apart) on a StoreError until ``timeout_s`` has passed,
    then the last error is raised. ``fn`` must be safe to repeat: a retried write may have
    been applied. Says what it waits for at the first failure and every ten seconds."""
    started = time.monotonic()
    deadline = started + timeout_s
    said_at = 0.0
    while True:
        try:
            return fn()
        except (LeaseLostError, CompactedError, StoreAuthError):  # not a blip
            raise
        except StoreError as exc:
            now = time.monotonic()
            if now >= deadline:
                raise
            if now - said_at >= 10.0:
                said_at = now
                log.warning(
                    "Could not %s (%s); trying again for up to %.0f s more.",
                    what,
                    exc,
                    deadline - now,
                )
            time.sleep(pause_s)


def parse_nodes(kvs: tuple[KeyValue, ...], keys: JobKeys) -> dict[str, NodeView]:
    """Node views from ``nodes/`` keys; a record that does not parse is logged and skipped."""
    nodes: dict[str, NodeView] = {}
    for kv in kvs:
        try:
            nodes[keys.node_id_of(kv.key)] = NodeView(
                NodeRecord.from_json(kv.value, kv.key), kv.create_revision, kv.lease
            )
        except RecordError as exc:
            log.error("Job %s: ignoring a bad node record: %s", keys.job_id, exc)
    return nodes


def read_members(store: KVStore, keys: JobKeys, r: Round | None) -> tuple[Member, ...]:
    """The members of round ``r`` as they were when the leader had written them all (its
    ``members_revision``; compacted: as they are now, which still carry its id unless a newer
    round is being written)."""
    if r is None or r.status is not RoundStatus.ACTIVE:
        return ()
    try:
        snap = store.get_prefix(keys.members, revision=r.members_revision)
    except CompactedError:
        snap = store.get_prefix(keys.members)
    return parse_members(snap.kvs, r, keys)


def parse_members(kvs: tuple[KeyValue, ...], r: Round | None, keys: JobKeys) -> tuple[Member, ...]:
    """The members of round ``r`` (in rank order) among ``members/`` keys: the records that
    carry its round id; others are left over from other rounds."""
    if r is None or r.status is not RoundStatus.ACTIVE:
        return ()
    members = []
    for kv in kvs:
        try:
            m = Member.from_json(kv.value, kv.key)
        except RecordError as exc:
            log.error("Job %s: ignoring a bad member record: %s", keys.job_id, exc)
            continue
        if m.round_id == r.round_id:
            members.append(m)
    if len(members) != r.nodes:
        log.error(
            "Job %s: round %d has %d nodes but %d member records.",
            keys.job_id,
            r.generation,
            r.nodes,
            len(members),
        )
    return tuple(sorted(members, key=lambda m: m.first_rank))


def parse_round(kv: KeyValue | None, keys: JobKeys) -> Round | None:
    if kv is None or not kv.value:
        return None
    try:
        return Round.from_json(kv.value, kv.key)
    except RecordError as exc:
        log.error("Job %s: ignoring a bad round record: %s", keys.job_id, exc)
        return None
