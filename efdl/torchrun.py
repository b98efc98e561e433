"""efdl's etcd v3 rendezvous as a backend of stock torchrun (``--rdzv-backend efdl``).

torch's own etcd backends speak etcd's v2 API, which etcd 3.6 removed. With efdl installed,
torchrun finds this handler through the ``torchrun.handlers`` entry point::

    torchrun --nnodes 1:4 --nproc-per-node 2 --rdzv-backend efdl \\
        --rdzv-endpoint etcd-1:2379 --rdzv-id job train.py

It is a second face of the same rendezvous core (:class:`efdl.rendezvous.participant.Participant`):
one etcd record per torchrun agent (a "node" with one slot), rounds decided by the oldest
node, a fresh c10d store per round served by the round's rank-0 node. torchrun restarts its
workers on every new round, as it does with its own backends.

``--rdzv-conf`` keys: ``timeout`` / ``join_timeout`` (seconds the job may wait below
``--nnodes`` MIN; torchrun sets 900 by default), ``last_call_timeout`` (seconds to batch
joins into one round, default 1), ``lease_ttl`` (seconds until a dead node is noticed,
default 5), ``etcd_timeout`` (seconds per etcd request), ``etcd_ca`` / ``etcd_cert`` /
``etcd_key`` (TLS files), ``etcd_user`` and ``etcd_password_file`` (the password may also
come from ``EFDL_ETCD_PASSWORD``), ``job_token_file`` (the token of an etcd a node of an
efdl-run job serves; or ``EFDL_JOB_TOKEN``), ``node_id``. Other keys are ignored with a log
line. The password and the token are taken out of the environment torchrun's workers get.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from typing import Any, NoReturn

from torch.distributed import (  # type: ignore[attr-defined]
    DistStoreError,
    PrefixStore,
    Store,
    TCPStore,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from efdl import __version__
from efdl.config import EtcdClientConfig
from efdl.errors import ConfigError, EfdlError, LeaseLostError, StoreError
from efdl.launcher.node import default_host
from efdl.launcher.tcpstore import TCPStoreServer
from efdl.options import load
from efdl.protocol.env import SECRET_VARIABLES
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lifecycle import close_job
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.probe import ProbeListener
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import JobKeys, NodeRecord, Round, RoundStatus, check_id

log = logging.getLogger(__name__)

BACKEND = "efdl"
# How often a node waiting for the others to check in on a round looks for a newer round (a
# dead member's store never answers, so the wait is in slices; c10d logs each slice that ends
# without them).
ARRIVAL_SLICE_S = 1.0
_ETCD_KEYS = {
    "etcd_ca": "etcd_ca",
    "etcd_cert": "etcd_cert",
    "etcd_key": "etcd_key",
    "etcd_user": "etcd_user",
    "etcd_password_file": "etcd_password_file",
    "etcd_timeout": "etcd_timeout_s",
    "job_token_file": "job_token_file",
}
_OWN_KEYS = {"timeout", "join_timeout", "last_call_timeout", "lease_ttl", "node_id"}


def _number(params: RendezvousParameters, keys: tuple[str, ...], default: float) -> float:
    for key in keys:
        value = params.config.get(key)
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--rdzv-conf {key}={value!r}: expected a number.") from None
        if number <= 0:
            raise ConfigError(f"--rdzv-conf {key}={value!r}: expected a positive number.")
        return number
    return default


class EfdlRendezvousHandler(RendezvousHandler):
    """torchrun's ``RendezvousHandler`` on efdl's rendezvous.

    Args:
        store: the etcd store (closed by :meth:`shutdown`).
        run_id: the job id (``--rdzv-id``).
        node: this torchrun agent's record (one slot: torchrun counts nodes).
        policy: min/max nodes, settle window, join timeout.
        lease_ttl_s: a dead node is noticed after this long.
    """

    def __init__(
        self,
        store: KVStore,
        run_id: str,
        node: NodeRecord,
        policy: Policy,
        lease_ttl_s: int = 5,
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._node = node
        self._policy = policy
        self._ttl = lease_ttl_s
        self._server = TCPStoreServer(node.host)
        self._participant: Participant | None = None
        self._returned: Round | None = None  # the round torchrun's workers run in
        self._leaving = False
        # Listens while torchrun's agent lives: its refusal is evidence of death, and a leader
        # that sees this node's record go (a lost lease) asks here whether it comes back.
        try:
            self._probe: ProbeListener | None = ProbeListener(node.host, self._describe)
            self._node = replace(node, probe_port=self._probe.port)
        except OSError as exc:
            log.warning("Cannot listen on %s for liveness probes (%s).", node.host, exc)
            self._probe = None

    def _holds(self) -> str:
        """The round torchrun's workers run in now ("" while torchrun is between rounds, or
        leaving): see NodeRecord.holds."""
        r = self._returned
        return "" if r is None or self._leaving else r.round_id

    def _describe(self) -> dict[str, object]:
        return {"pid": os.getpid(), "holds": self._holds()}

    # ---------------------------------------------------------------- torchrun's interface

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """Workers use the round's store (MASTER_ADDR/PORT) as clients: it is fresh per round
        and lives as long as the round's rank-0 agent."""
        return True

    def get_run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join (the first time) or ask for a new round (after a restart), then wait until a
        round has this node as a member; its rank, world size (in nodes) and store."""
        try:
            return self._next()
        except LeaseLostError as exc:
            raise RendezvousStateError(f"This node left the job: {exc}") from None
        except StoreError as exc:
            raise RendezvousConnectionError(str(exc)) from None

    def is_closed(self) -> bool:
        current = self._read_round()
        return current is not None and current.status.final

    def set_closed(self) -> None:
        close_job(
            self._store,
            self._run_id,
            f"closed by torchrun on node {self._node.node_id}",
            by=self._node.node_id,
        )

    def num_nodes_waiting(self) -> int:
        """Nodes that a newer round admitted (or that a membership change replaced): torchrun
        restarts its workers to take them in. Spares beyond ``--nnodes`` MAX do not count: no
        round can take them."""
        if self._participant is None or self._returned is None:
            return 0
        latest = self._participant.current_round
        if latest is None or latest.generation <= self._returned.generation:
            return 0
        if latest.status is not RoundStatus.ACTIVE:
            return 1
        return max(1, latest.nodes - self._returned.nodes)

    def shutdown(self) -> bool:
        """Leave the job (revoke the lease: the others' next round comes at once)."""
        self._leaving = True
        try:
            if self._participant is not None:
                self._participant.leave()
                self._participant = None
            return True
        except EfdlError as exc:
            log.warning("Leaving the efdl rendezvous failed: %s", exc)
            return False
        finally:
            self._server.close()
            if self._probe is not None:
                self._probe.close()
            self._store.close()

    # ---------------------------------------------------------------- internals

    def _read_round(self) -> Round | None:
        keys = JobKeys(self._run_id)
        return parse_round(self._store.get(keys.round), keys)

    def _next(self) -> RendezvousInfo:
        current = self._read_round()
        if current is not None and current.status.final:
            if self._participant is None:  # it ended before this node came
                raise RendezvousClosedError(f"Job {self._run_id} has ended: {current.reason}.")
            self._ended(current)
        if self._participant is None:
            self._participant = Participant(
                self._store,
                self._run_id,
                self._node,
                self._policy,
                lease_ttl_s=self._ttl,
                serve_tcpstore=self._server.serve,
                holds=self._holds,
            )
            self._participant.join()
        elif self._returned is not None:
            latest = self._participant.current_round
            if latest is None or latest.generation <= self._returned.generation:
                self._participant.request_restart()  # torchrun restarted: everyone rebuilds
        after = self._returned.generation if self._returned else 0
        deadline = time.monotonic() + self._policy.join_timeout_s
        while True:
            r = self._participant.next_round(after, timeout_s=max(0.0, deadline - time.monotonic()))
            if r is None:
                raise RendezvousTimeoutError(
                    f"No round of job {self._run_id} took node {self._node.node_id} within "
                    f"{self._policy.join_timeout_s:g} s (--rdzv-conf timeout)."
                )
            if r.status is RoundStatus.FAILED:  # below MIN for longer than the join timeout
                raise RendezvousTimeoutError(f"Job {self._run_id} failed: {r.reason}.")
            if r.status.final:
                self._ended(r)
            member = r.member
            if r.status is RoundStatus.ACTIVE and member is not None:
                info = self._all_arrived(r, deadline)
                if info is not None:
                    return info
            after = r.generation  # waiting below MIN, a spare, or superseded: the next one

    def _ended(self, r: Round) -> NoReturn:
        """The job this node trains in ended (``efdl stop``, or another node's workers
        finished): torchrun has stopped its workers; it exits 0, as efdl-run does. torchrun
        takes any exception for a failure (exit 1, a traceback), but SystemExit(0) for done."""
        if r.status is RoundStatus.FAILED:
            raise RendezvousTimeoutError(f"Job {self._run_id} failed: {r.reason}.")
        log.warning(
            "Job %s ended (%s): node %s leaves.", self._run_id, r.reason, self._node.node_id
        )
        raise SystemExit(0)

    def _all_arrived(self, r: Round, deadline: float) -> RendezvousInfo | None:
        """Check in on round ``r``'s store and wait until every member has: torchrun's rank
        assignment waits on all of them, and a member that died before the round was decided
        would make it fail instead of wait. None if a newer round came first (a dead member's
        lease expired, or a node joined), or ``r``'s store went away with it."""
        assert self._participant is not None and r.member is not None
        try:
            client = self._connect(r, deadline)
            if client is None:
                return None
            store = PrefixStore(f"efdl/{r.generation}/", client)
            store.set(f"arrived/{r.member.group_rank}", "1")
            keys = [f"arrived/{rank}" for rank in range(r.nodes)]
            while not self._arrived(store, keys, ARRIVAL_SLICE_S):
                newer = self._participant.current_round
                if newer is not None and newer.generation > r.generation:
                    return None
                if time.monotonic() > deadline:
                    return None
        except RuntimeError as exc:  # dist errors: the store closed with its round
            log.info(
                "Round %d of job %s ended before it started: %s",
                r.generation,
                self._run_id,
                str(exc).splitlines()[0][:200],
            )
            return None
        return self._info(r, store)

    @staticmethod
    def _arrived(store: PrefixStore, keys: list[str], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every key; False when the time is up first."""
        if store.check(keys):
            return True
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
            return False
        return True

    def _connect(self, r: Round, deadline: float) -> TCPStore | None:
        """A client of round ``r``'s store; None if a newer round came first (a superseded
        round's store is closed, and a client would retry a refused connection for its
        whole timeout)."""
        assert self._participant is not None
        while True:
            try:
                client = TCPStore(
                    r.store_host, r.store_port, None, False, datetime.timedelta(seconds=2)
                )
                # torchrun's rank assignment waits on this store for the other nodes.
                client.set_timeout(
                    datetime.timedelta(seconds=max(60.0, self._policy.join_timeout_s))
                )
                return client
            except RuntimeError:
                newer = self._participant.current_round
                if newer is not None and newer.generation > r.generation:
                    return None
                if time.monotonic() > deadline:
                    raise

    def _info(self, r: Round, store: Store) -> RendezvousInfo:
        self._returned = r
        assert r.member is not None
        rank = r.member.group_rank
        log.info(
            "efdl rendezvous: job %s round %d: node %s is rank %d of %d (%s).",
            self._run_id,
            r.generation,
            self._node.node_id,
            rank,
            r.nodes,
            r.reason,
        )
        return RendezvousInfo(store, rank, r.nodes, RendezvousStoreInfo(r.store_host, r.store_port))


def create_handler(params: RendezvousParameters) -> EfdlRendezvousHandler:
    """torchrun's factory: ``RendezvousParameters`` (endpoint, run id, nnodes, --rdzv-conf) to
    a handler. Bad values are ``ConfigError``s that name them."""
    unknown = set(params.config) - _OWN_KEYS - set(_ETCD_KEYS)
    for key in sorted(unknown):
        log.info("Ignoring --rdzv-conf %s: it has no meaning for efdl's rendezvous.", key)
    flags: dict[str, Any] = {"etcd": params.endpoint or None}
    for key, field in _ETCD_KEYS.items():
        if params.config.get(key) is not None:
            flags[field] = params.config[key]
    cfg = load(EtcdClientConfig, flags, env=dict(os.environ))
    settings = cfg.etcd_settings()
    _hide_secrets(os.environ)
    run_id = check_id(params.run_id, "run id (--rdzv-id)")
    host = params.local_addr or default_host(settings.endpoints)
    node_id = str(params.config.get("node_id") or f"{host}-{os.getpid()}")
    node = NodeRecord(node_id, host, 0, slots=1, version=__version__, start_time=time.time())
    policy = Policy(
        min_workers=params.min_nodes,
        max_workers=params.max_nodes,
        settle_s=_number(params, ("last_call_timeout",), 1.0),
        join_timeout_s=_number(params, ("join_timeout", "timeout"), 600.0),
    )
    ttl = int(_number(params, ("lease_ttl",), 5))
    if ttl < 2:
        raise ConfigError(f"--rdzv-conf lease_ttl={ttl}: expected at least 2 seconds.")
    return EfdlRendezvousHandler(EtcdStore(settings), run_id, node, policy, ttl)


def _hide_secrets(env: MutableMapping[str, str]) -> None:
    """Take efdl's secrets (the etcd password, the job token) out of torchrun's environment
    once the handler has read them: torchrun starts its workers with a copy of it, and a
    training script has no business with etcd (efdl-run leaves them out of its workers' too)."""
    for name in sorted(SECRET_VARIABLES & env.keys()):
        del env[name]
        log.info("Removed %s from the environment torchrun gives its workers.", name)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it to get the factory."""
    return create_handler
