"""How the agent ends: its exit, the code of a node that left on a signal, and the job's
end that a node's workers make (finished, or failed with their state lost).

A job's end is one final round, written with its event in one transaction
(efdl.rendezvous.lifecycle.end_job); every other agent ends on that round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from efdl.errors import EfdlError, StoreError
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.lifecycle import end_job
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import JobKeys, RoundStatus

log = logging.getLogger(__name__)


class AgentExit(EfdlError):
    """The agent ends with ``code``; the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def leave_code(signum: int, ended: bool, others: int) -> int:
    """The exit code of a node that left its job on signal ``signum``: 0 when the job has
    ended (finished, stopped or failed: its own code is said by the nodes that saw it) or
    ``others`` nodes carry it on; else 128 + ``signum`` (unfinished work nobody carries on)."""
    return 0 if ended or others > 0 else 128 + signum


def left(
    store: KVStore, job_id: str, node_id: str, signum: int, what: str, finished: bool
) -> AgentExit:
    """How node ``node_id``'s leave on ``signum`` ends (``what``: the sentence that says so;
    ``finished``: the job had finished before): 0 when the job goes on without it (or has
    ended), else 128 + the signal's number, as a shell reports a process that a signal
    stopped: a scheduler (SLURM, a Kubernetes Job) takes it for unfinished work to run
    again, not for a finished job. Read after this node's record went (its lease was
    revoked), so of nodes leaving together at least the last one says so."""
    keys = JobKeys(job_id)
    try:
        r = parse_round(store.get(keys.round), keys)
        others = [kv for kv in store.get_prefix(keys.nodes).kvs if kv.key != keys.node(node_id)]
    except StoreError as exc:
        code = leave_code(signum, False, 0)
        return AgentExit(
            code, f"{what}; etcd did not say whether the job goes on ({exc}): exit {code}."
        )
    ended = finished or (r is not None and r.status.final)
    code = leave_code(signum, ended, len(others))
    if code == 0:
        return AgentExit(
            0, f"{what}; the job goes on without it." if others and not ended else f"{what}."
        )
    return AgentExit(
        code,
        f"{what}; no other node carries the job on and it has not finished: exit {code}, "
        "for a scheduler to run it again.",
    )


def finish_job(store: KVStore, job_id: str, node_id: str) -> AgentExit:
    """Node ``node_id``'s workers finished: so did the job (one final round, for every
    node). Returns the agent's exit, 0 whether or not etcd took the job's end."""
    try:
        end_job(
            store,
            job_id,
            RoundStatus.FINISHED,
            f"the workers of node {node_id} finished",
            by=node_id,
        )
    except StoreError as exc:
        return AgentExit(
            0,
            "This node's workers finished; the job's end could not be written to "
            f"etcd ({exc}): the other nodes end when their own workers finish.",
        )
    return AgentExit(0, "This node's workers finished; the job is done.")


def fail_job(
    store: KVStore, job_id: str, node_id: str, message: str, tag: Callable[[], str]
) -> AgentExit:
    """The job cannot go on from where it was (``message``): end it, so that every agent
    exits non-zero with the reason, rather than let restarts start it over from step 0.
    Returns this agent's exit (code 1); etcd's refusal is logged."""
    try:
        end_job(store, job_id, RoundStatus.FAILED, message.rstrip("."), by=node_id)
    except StoreError as exc:
        log.error("%s: could not end the job in etcd: %s", tag(), exc)
    return AgentExit(1, message)
