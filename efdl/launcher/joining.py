"""How the agent joins its job: when to join (after its warm processes, for a job that
trains by restarts), and its registration while etcd does not answer yet."""

from __future__ import annotations

import logging
import queue
import signal
import time
from collections.abc import Callable

from efdl.errors import EfdlError, StoreError
from efdl.launcher.ending import AgentExit
from efdl.launcher.inbox import SignalReceived
from efdl.launcher.warm import WarmPool
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.probe import Reply, ask
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import JobKeys, NodeRecord, RoundStatus

log = logging.getLogger(__name__)

WARM_WAIT_S = 60.0  # the longest a node joining a running job waits for its warm processes
SAY_EVERY_S = 10.0  # how often a node that cannot join yet says so


def await_warm(
    store: KVStore, job_id: str, warm: WarmPool, slots: int, tag: Callable[[], str]
) -> None:
    """Joining a job that trains by restarts: let this node's fork server (efdl.launcher.warm)
    finish importing torch first, so that the round that admits it does not stop all
    the others while they do (at most :data:`WARM_WAIT_S`). A job that trains in place (its
    rank 0 node says so) is joined at once: its workers train on until this node's have
    entered their training functions (efdl.worker.ready). A new job's nodes join at once too:
    their imports overlap the rendezvous."""
    if not warm.size:
        return
    keys = JobKeys(job_id)
    try:
        current = parse_round(store.get(keys.round), keys)
        # Its rank 0 alive (a job whose nodes all left, preempted, still has its last
        # active round; the nodes resuming it start together).
        raw = store.get(keys.node(current.head)) if current is not None else None
    except StoreError:
        return  # joining says what is wrong with etcd
    if current is None or current.status is not RoundStatus.ACTIVE or raw is None:
        return
    if _trains_in_place(raw.value, keys.node(current.head)):
        log.info(
            "%s: the job trains in place (generation %d): joining at once; its workers "
            "train on while this node's start.",
            tag(),
            current.generation,
        )
        return
    log.info(
        "%s: the job trains (generation %d); joining once this node's fork server has "
        "imported torch for its %d worker(s) (at most %.0f s).",
        tag(),
        current.generation,
        slots,
        WARM_WAIT_S,
    )
    if not warm.wait_loaded(WARM_WAIT_S):
        log.warning(
            "%s: the fork server is not ready after %.0f s; joining anyway.",
            tag(),
            WARM_WAIT_S,
        )


def register(
    rdzv: Participant,
    join_timeout_s: float,
    events: queue.Queue[object],
    left: Callable[[int, str], AgentExit],
    tag: Callable[[], str],
    keep: Callable[[int], bool] = lambda signum: False,
) -> None:
    """Register this node; while etcd does not answer, try again (saying so every ten
    seconds) for up to ``join_timeout_s``, and leave at once on a signal on ``events``
    (ending with ``left``'s exit), but for those ``keep`` says to keep (the drain signal):
    they, and every other event taken meanwhile, are put back for the agent's loop.

    Raises:
        AgentExit: the join timed out, or a signal came first.
    """
    deadline = time.monotonic() + join_timeout_s
    said_at = 0.0
    kept: list[object] = []
    while True:
        try:
            rdzv.join()
            for event in kept:
                events.put(event)
            return
        except StoreError as exc:
            now = time.monotonic()
            if now >= deadline:
                raise AgentExit(
                    1,
                    f"Could not join job {rdzv.keys.job_id} within the join timeout "
                    f"({join_timeout_s:g} s): {exc}",
                ) from None
            if now - said_at >= SAY_EVERY_S:
                said_at = now
                log.warning(
                    "%s: cannot join yet (%s); trying again for up to %.0f s more.",
                    tag(),
                    exc,
                    deadline - now,
                )
        try:
            event = events.get(timeout=1.0)
        except queue.Empty:
            continue
        if isinstance(event, SignalReceived) and not keep(event.signum):
            name = signal.Signals(event.signum).name
            raise left(event.signum, f"Left on {name} before joining the job")
        kept.append(event)


def _trains_in_place(raw: bytes, key: str) -> bool:
    """Whether the node of record ``raw`` (at ``key``) says that its workers rebuild in
    place, asked at its probe port (efdl.rendezvous.probe); False when it cannot say."""
    try:
        record = NodeRecord.from_json(raw, key)
    except EfdlError:
        return False
    if not record.probe_port:
        return False
    reply, said = ask(record.host, record.probe_port)
    return reply is Reply.ANSWERED and said is not None and said.get("in_place") is True
