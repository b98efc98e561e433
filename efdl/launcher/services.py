"""What a node's agent serves to others while it lives: the liveness probe (a refused
connection tells the others it died: efdl.rendezvous.probe), the job's TCPStore when this
node hosts it (efdl.launcher.tcpstore) and, with ``--metrics-port``, Prometheus metrics
(efdl.launcher.metrics)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from efdl.config import LaunchConfig
from efdl.launcher.ending import AgentExit
from efdl.launcher.metrics import Metrics
from efdl.launcher.tcpstore import TCPStoreServer, preload
from efdl.launcher.warm import cores_to_spare
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.probe import ProbeListener
from efdl.rendezvous.records import NodeRecord

log = logging.getLogger(__name__)


class NodeServices:
    """Started by the agent before it joins, closed when it ends. ``node``: the agent's
    record with the probe's port in it (what it registers)."""

    def __init__(
        self,
        cfg: LaunchConfig,
        node: NodeRecord,
        store: KVStore,
        metrics: Metrics,
        describe: Callable[[], dict[str, object]],
    ) -> None:
        self.metrics = metrics
        try:
            self._probe: ProbeListener | None = ProbeListener(node.host, describe)
            node = replace(node, probe_port=self._probe.port)
        except OSError as exc:
            log.warning("Cannot listen on %s for liveness probes (%s).", node.host, exc)
            self._probe = None
        self.node = node
        if cfg.metrics_port is not None:
            try:
                port = metrics.serve(node.host, cfg.metrics_port)
            except OSError as exc:
                if self._probe is not None:
                    self._probe.close()
                raise AgentExit(
                    1, f"Cannot serve metrics on {node.host}:{cfg.metrics_port}: {exc}."
                ) from None
            log.info("Serving Prometheus metrics at http://%s:%d/metrics.", node.host, port)
            if isinstance(store, EtcdStore):
                store.on_request = metrics.etcd_request.observe
        try:
            self.tcpstore = TCPStoreServer(node.host, cfg.store_port)  # (a port in use: refused)
        except BaseException:
            metrics.close()
            if self._probe is not None:
                self._probe.close()
            raise
        if cfg.standalone or cores_to_spare(node.slots, bool(node.gpus), node.cpus):
            preload()  # (else imported when this node first serves a store: on a node short
            # of cores, every agent importing torch beside its workers costs more than it saves)

    def close(self) -> None:
        self.metrics.close()
        self.tcpstore.close()
        if self._probe is not None:
            self._probe.close()
