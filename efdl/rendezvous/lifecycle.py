"""A job's life in etcd outside its rounds: its start (a new run of an ended job), its end
(a final round and its event, in one transaction), ``efdl stop``."""

from __future__ import annotations

import functools
import logging
import time

from efdl.errors import (
    RendezvousClosedError,
    RendezvousError,
)
from efdl.rendezvous.api import (
    Compare,
    Delete,
    KVStore,
    Put,
)
from efdl.rendezvous.reading import BLIP_S, parse_round, retried
from efdl.rendezvous.records import (
    Event,
    JobKeys,
    Round,
    RoundStatus,
)

log = logging.getLogger(__name__)


def end_job(
    store: KVStore,
    job_id: str,
    status: RoundStatus = RoundStatus.CLOSED,
    reason: str = "stopped by efdl stop",
    generation: int | None = None,
    by: str = "efdl stop",
) -> Round | None:
    """Write a final round (compare-and-swap), so every agent of the job ends, and its event
    in the job's history in the same transaction (one event per end, whoever wrote it).

    Args:
        status: CLOSED (stop the workers now) or FINISHED (let them finish).
        generation: only if the current round is this generation (else None is returned:
            something newer happened and the caller should look again).
        by: who ends it (a node id, or the command), as the event names it.
    """
    keys = JobKeys(job_id)
    for _ in range(20):
        kv = retried("read the round", lambda: store.get(keys.round))
        current = parse_round(kv, keys)
        if current is not None and current.status.final:
            return current
        if generation is not None and (current is None or current.generation != generation):
            return None
        now = time.time()
        final = Round(
            generation=(current.generation if current else 0) + 1,
            status=status,
            reason=reason,
            created=now,
            since=now,
        )
        event = Event.of_round(now, by, final)
        ok = retried(
            "write the job's end",
            functools.partial(
                store.txn,
                [Compare.mod_revision_is(keys.round, kv.mod_revision if kv else 0)],
                [Put(keys.round, final.to_json()), Put(event.key(keys), event.to_json())],
            ),
        )
        if ok.succeeded:
            return final
    raise RendezvousError(f"Could not end job {job_id!r}: its round kept changing.")


def start_job(
    store: KVStore, job_id: str, new_run: bool, timeout_s: float = BLIP_S
) -> Round | None:
    """Before a node joins: if the job has ended (finished, stopped or failed), start a new
    run of it when ``new_run``, else refuse. A new run replaces the final round
    (compare-and-swap) with a waiting round of the next generation, so its nodes join as at
    a first start; the remote cache is the job's, so a resumed job goes on from its newest
    snapshot. Returns the round that ended the last run, if one was reopened.

    Waits up to ``timeout_s`` for etcd to answer.

    Raises:
        RendezvousClosedError: the job has ended and ``new_run`` is off.
    """
    keys = JobKeys(job_id)
    while True:
        kv = retried("read the round", lambda: store.get(keys.round), timeout_s)
        current = parse_round(kv, keys)
        if kv is None or current is None or not current.status.final:
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(current.created))
        if not new_run:
            raise RendezvousClosedError(
                f"Job {job_id!r} {current.status.value} at {when} ({current.reason}); efdl-run "
                "does not start an ended job again by itself. Start a new run of it with "
                "--new-run (it keeps its remote cache: a resumed job goes on from its newest "
                "snapshot), or give another --job-id."
            )
        now = time.time()
        fresh = Round(
            generation=current.generation + 1,
            status=RoundStatus.WAITING,
            reason=f"a new run (the last one {current.status.value} at {when})",
            created=now,
            since=now,
        )
        ok = retried(
            "start a new run",
            functools.partial(
                store.txn,
                [Compare.mod_revision_is(keys.round, kv.mod_revision)],
                # The last run's progress goes: a new run without a snapshot starts from 0.
                [Put(keys.round, fresh.to_json()), Delete(keys.progress)],
            ),
        )
        if ok.succeeded:
            log.info("Job %s: a new run starts (generation %d).", job_id, fresh.generation)
            return current


def close_job(
    store: KVStore, job_id: str, reason: str = "stopped by efdl stop", by: str = "efdl stop"
) -> Round:
    """Write a CLOSED round: every agent of the job stops its workers and exits cleanly."""
    result = end_job(store, job_id, RoundStatus.CLOSED, reason, by=by)
    assert result is not None
    return result
