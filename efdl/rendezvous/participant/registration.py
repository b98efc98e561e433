"""A node's record in its job: ``nodes/<id>``, bound to the agent's lease, is both what the
node offers (efdl.rendezvous.records.NodeRecord) and its candidacy in the job's election
(efdl.rendezvous.election): the oldest record leads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from efdl.errors import DuplicateNodeError, StoreConnectionError
from efdl.rendezvous.api import Get, KVStore, Put
from efdl.rendezvous.election import Candidate, Election
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.probe import Reply, ask
from efdl.rendezvous.reading import parse_round, retried
from efdl.rendezvous.records import JobKeys, Member, NodeRecord, RecordError, RoundStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Registration:
    """A node's record as written: the lease it is bound to and its place in the election."""

    session: LeaseSession
    candidate: Candidate
    node: NodeRecord


def check_not_held(store: KVStore, keys: JobKeys, node_id: str, wait_s: float) -> None:
    """Refuse ``node_id`` if a live agent holds it: a member of the current round whose
    record went (its lease was lost: cut off from etcd, or etcd revoked it) while its agent
    still runs the round's workers, and registers again by itself. Taken by a second agent
    meanwhile, the id would make two nodes one. Two small reads, and one question to that
    agent's probe port (an agent that does not answer may be alive: it is fenced,
    efdl.worker.fence, and its generation waited out).

    Raises:
        DuplicateNodeError: the id is held.
        StoreError: etcd failed for ``wait_s``.
    """
    read = retried(
        "read the round and this node's place",
        lambda: store.txn([], [Get(keys.round), Get(keys.member(node_id))]),
        timeout_s=wait_s,
    )
    current = parse_round(read.gets[0][0] if read.gets[0] else None, keys)
    if current is None or current.status is not RoundStatus.ACTIVE or not read.gets[1]:
        return
    kv = read.gets[1][0]
    try:
        member = Member.from_json(kv.value, kv.key)
    except RecordError:
        return
    if member.round_id != current.round_id or not member.probe_port:
        return
    reply, said = ask(member.host, member.probe_port)
    if reply is not Reply.ANSWERED or said is None:
        return
    if said.get("node_id") == node_id and said.get("holds") == current.round_id:
        raise DuplicateNodeError(
            f"Node id {node_id!r} is held by a live agent of job {keys.job_id!r} "
            f"at {member.host} (probe port {member.probe_port}, pid {said.get('pid')}), "
            f"which runs round {current.generation} while it registers again after losing "
            "its lease; give this node another --node-id."
        )


def register(
    store: KVStore,
    keys: JobKeys,
    election: Election,
    node: NodeRecord,
    lease_ttl_s: int,
    *,
    again: bool,
    on_expired: Callable[[str], None],
    on_silent: Callable[[], None] | None,
    on_contact: Callable[[float], None] | None,
) -> Registration:
    """Write ``node``'s record, bound to a new lease (its session calls ``on_expired``,
    ``on_silent`` and ``on_contact``, see LeaseSession); ``again``: after a lost lease, where
    an earlier attempt may have been applied.

    Raises:
        DuplicateNodeError: a live node with the same id is in the job.
        StoreError: etcd failed (the caller may try again), or this node's record from an
            earlier attempt still stands.
    """
    # Contact counts only once this lease's record is written (efdl.worker.fence): a lease
    # granted while the record cannot be written (its id held, etcd refusing) proves
    # nothing a leader can see, and must not move the workers' fence on.
    registered = threading.Event()

    def contact(at: float) -> None:
        if registered.is_set() and on_contact is not None:
            on_contact(at)

    session = LeaseSession(
        store, lease_ttl_s, on_expired=on_expired, on_silent=on_silent, on_contact=contact
    )
    key = keys.node(node.node_id)
    try:
        campaign = election.campaign(key, node.to_json(), session.lease_id)
    except BaseException:
        session.close()
        raise
    if campaign.candidate is None:
        session.close()
        existing = campaign.holder
        other = ""
        if existing is not None:
            try:
                theirs = NodeRecord.from_json(existing.value, key)
            except RecordError:
                theirs = None
            same = theirs is not None and theirs.start_time == node.start_time
            if again and same and theirs is not None and theirs.host == node.host:
                # Ours, from an attempt whose answer was lost: nobody renews its lease, so
                # it goes within a TTL (a StoreError: the caller tries again).
                raise StoreConnectionError(
                    f"The node record {key} of an earlier attempt to register is still "
                    f"there (lease {existing.lease:x}); it goes within {lease_ttl_s} s."
                )
            other = f" (host {theirs.host})" if theirs is not None else ""
        raise DuplicateNodeError(
            f"A live node with id {node.node_id!r} is already in job {keys.job_id!r}"
            f"{other}; give this node another --node-id."
        )
    registered.set()
    log.info(
        "Job %s: node %s %s (lease %x).",
        keys.job_id,
        node.node_id,
        f"registered again, still running round {node.holds}" if node.holds else "joined",
        session.lease_id,
    )
    return Registration(session, campaign.candidate, node)


def write_record(store: KVStore, keys: JobKeys, node: NodeRecord, at: Registration) -> bool:
    """Write ``node`` as this node's record of registration ``at``, while it stands; False if
    it is gone with its lease (registering again writes it).

    Raises:
        StoreError: etcd failed (try again).
    """
    return store.txn(
        [at.candidate.guard], [Put(keys.node(node.node_id), node.to_json(), at.session.lease_id)]
    ).succeeded
