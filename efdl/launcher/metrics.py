"""The agent's Prometheus metrics (``--metrics-port``; off by default), served on ``--host``.

One registry per agent (not prometheus_client's global one), so that tests can run several
agents in one process. Names follow Prometheus' conventions: ``efdl_`` prefix, base units
(seconds, bytes), ``_total`` for counters; labels are few and bounded (``cause``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from efdl.rendezvous.records import Event, EventKind, Round

log = logging.getLogger(__name__)

# Rescale causes, from the round's reason (efdl.rendezvous.decide words them).
CAUSES = ("join", "leave", "hold", "lost", "restart", "wait", "other")
STOOD_STILL_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
ETCD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def cause_of(status: str, reason: str) -> str:
    """The cause of a round, from its status and reason (one of :data:`CAUSES`)."""
    if status == "waiting":
        return "wait"
    text = reason.lower()
    for cause, words in (
        ("hold", (" held out (",)),  # first: a hold's reason may say anything
        ("lost", ("lost workers",)),
        ("restart", ("restarted",)),
        ("leave", (" left",)),
        ("join", ("joined", "spare")),
    ):
        if any(w in text for w in words):
            return cause
    return "other"


class Metrics:
    """The instruments, and the HTTP server once :meth:`serve` is called."""

    def __init__(self, job_id: str, node_id: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        info = Gauge("efdl_agent_info", "This agent (value 1).", ["efdl_job", "node"], registry=r)
        info.labels(job_id, node_id).set(1)
        self.generation = Gauge("efdl_generation", "The newest round seen.", registry=r)
        self.world_size = Gauge("efdl_world_size", "Workers in the newest round.", registry=r)
        self.members = Gauge("efdl_members", "Nodes in the newest active round.", registry=r)
        self.spares = Gauge("efdl_spares", "Nodes waiting as spares.", registry=r)
        self.rescales = Counter("efdl_rescales", "Rounds seen, by cause.", ["cause"], registry=r)
        for cause in CAUSES:
            self.rescales.labels(cause)
        self.stood_still = Histogram(
            "efdl_stood_still_seconds",
            "How long training stood still per rescale (in-place rank 0's measure).",
            buckets=STOOD_STILL_BUCKETS,
            registry=r,
        )
        self.worker_restarts = Counter(
            "efdl_worker_restarts", "Workers this node restarted or replaced.", registry=r
        )
        self.worker_failures = Counter(
            "efdl_worker_failures", "Worker processes of this node that failed.", registry=r
        )
        self.lease_healthy = Gauge(
            "efdl_lease_healthy", "1 while this node's lease holds, 0 once lost.", registry=r
        )
        self.etcd_request = Histogram(
            "efdl_etcd_request_seconds",
            "etcd requests of this agent, failover included.",
            buckets=ETCD_BUCKETS,
            registry=r,
        )
        self.last_step = Gauge(
            "efdl_last_committed_step", "The newest step local rank 0 committed.", registry=r
        )
        self.steps_per_second = Gauge(
            "efdl_steps_per_second", "Committed steps per second (local rank 0).", registry=r
        )
        self.last_persisted = Gauge(
            "efdl_last_persisted_step", "The newest step persisted to the cache.", registry=r
        )
        self.persist_throughput = Gauge(
            "efdl_persist_bytes_per_second", "The last snapshot's size over its time.", registry=r
        )
        self.persisted_bytes = Counter(
            "efdl_persisted_bytes", "Bytes of snapshots written to the cache.", registry=r
        )
        self.pace_ratio = Gauge(
            "efdl_node_pace_ratio",
            "This node's own work per step over the other nodes' (medians over the straggler "
            "window; 1: as fast as the rest).",
            registry=r,
        )
        self.held = Gauge(
            "efdl_held",
            "1 while this node is held out of its job (drained or quarantined), else 0.",
            registry=r,
        )
        self.health_faults = Counter(
            "efdl_health_faults",
            "Health checks of this node that found a fault, by check.",
            ["check"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._progress: tuple[int, float] | None = None  # the last (step, time) reported
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free one) in a daemon thread; the port."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def round(self, r: Round) -> None:
        """A round this node saw."""
        self.generation.set(r.generation)
        self.world_size.set(r.world_size)
        self.members.set(r.nodes)
        self.spares.set(r.spares)
        self.rescales.labels(cause_of(r.status.value, r.reason)).inc()

    def count(self, event: Event) -> None:
        """An event of this node's history, in the counters it moves."""
        if event.kind is EventKind.CRASH:
            self.worker_failures.inc()
        elif event.kind is EventKind.RESTART:
            self.worker_restarts.inc()
        elif event.kind is EventKind.RESCALE and event.seconds >= 0:
            self.stood_still.observe(event.seconds)

    def persisted(self, step: int, size: int, seconds: float) -> None:
        """Rank 0 wrote a snapshot of ``step``, ``size`` bytes in ``seconds``."""
        self.last_persisted.set(step)
        self.persisted_bytes.inc(size)
        if seconds > 0:
            self.persist_throughput.set(size / seconds)

    def progress(self, step: int, at: float | None = None) -> None:
        """Local rank 0 committed ``step``; the rate is over the time since the last report."""
        now = time.monotonic() if at is None else at
        with self._lock:
            last = self._progress
            self._progress = (step, now)
        self.last_step.set(step)
        if last is not None and step > last[0] and now > last[1]:
            self.steps_per_second.set((step - last[0]) / (now - last[1]))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
