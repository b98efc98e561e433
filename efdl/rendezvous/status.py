"""What ``efdl status`` shows: a job as its etcd keys describe it."""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from efdl.rendezvous.api import KVStore
from efdl.rendezvous.decide import NodeView
from efdl.rendezvous.holds import Hold, parse_holds
from efdl.rendezvous.probe import Reply, ask_all
from efdl.rendezvous.reading import parse_nodes, parse_round, read_members
from efdl.rendezvous.records import CacheRecord, JobKeys, Member, RecordError, Round

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Liveness:
    """What a node's agent answered to a probe (efdl.rendezvous.probe) just now."""

    reply: Reply
    said: dict[str, Any] | None = None  # what the agent says of itself (step, workers, ...)

    def describe(self, now: float) -> str:
        if self.reply is Reply.REFUSED:
            return "agent gone (its probe port refuses; the lease ends soon)"
        if self.reply is Reply.SILENT:
            return "no answer to a probe (hung, partitioned, or not reachable from here)"
        said = self.said or {}
        parts = []
        step, at = said.get("step"), said.get("step_time")
        if isinstance(step, int) and isinstance(at, int | float) and at > 0:
            parts.append(f"step {step} ({max(0.0, now - at):.0f} s ago)")
        workers = said.get("workers")
        if isinstance(workers, int):
            mode = " (in place)" if said.get("in_place") else ""
            parts.append(f"workers running: {workers}{mode}")
        return ", ".join(parts) or "alive"


@dataclass(frozen=True, slots=True)
class StatusReport:
    job_id: str
    round: Round | None
    nodes: dict[str, NodeView]
    leader: str | None
    cache: CacheRecord | None = None
    members: tuple[Member, ...] = ()  # of the round, in rank order
    live: dict[str, Liveness] = field(default_factory=dict)  # by node, where asked
    known: bool = True  # whether etcd holds a round or a node of the job (see unknown_job)
    holds: dict[str, Hold] = field(default_factory=dict)  # in force, by node

    @property
    def spares(self) -> list[str]:
        """Live nodes that are not in the current round (waiting beyond --max, or new), and
        not held out."""
        members = {m.node_id for m in self.members}
        return sorted(
            (n for n in self.nodes if n not in members and n not in self.holds),
            key=lambda n: self.nodes[n].joined_revision,
        )


def read_status(store: KVStore, job_id: str, probe: bool = True) -> StatusReport:
    """The job's keys in one range request, the round's members as they were when the
    round was written, and (``probe``) what each node's agent answers now."""
    keys = JobKeys(job_id)
    snap = store.get_prefix(keys.prefix)
    nodes = parse_nodes(tuple(kv for kv in snap.kvs if kv.key.startswith(keys.nodes)), keys)
    round_kv = next((kv for kv in snap.kvs if kv.key == keys.round), None)
    leader = min(nodes, key=lambda n: nodes[n].joined_revision) if nodes else None
    cache = None
    cache_kv = next((kv for kv in snap.kvs if kv.key == keys.cache), None)
    if cache_kv is not None:
        try:
            cache = CacheRecord.from_json(cache_kv.value, keys.cache)
        except RecordError as exc:
            log.error("Ignoring a bad cache record: %s", exc)
    r = parse_round(round_kv, keys)
    wall = time.time()
    holds = {
        n: h
        for n, h in parse_holds(
            tuple(kv for kv in snap.kvs if kv.key.startswith(keys.holds)), keys
        ).items()
        if h.active(wall)
    }
    live = {}
    if probe:
        targets = ((n, v.record.host, v.record.probe_port) for n, v in nodes.items())
        live = {n: Liveness(reply, said) for n, (reply, said) in ask_all(targets).items()}
    members = read_members(store, keys, r)
    known = round_kv is not None or any(kv.key.startswith(keys.nodes) for kv in snap.kvs)
    return StatusReport(job_id, r, nodes, leader, cache, members, live, known, holds)


def unknown_job(store: KVStore, job_id: str) -> str | None:
    """A sentence if etcd holds neither a round nor a node of job ``job_id`` (a mistyped
    --job-id), else None."""
    keys = JobKeys(job_id)
    if store.get(keys.round) is not None or store.get_prefix(keys.nodes).kvs:
        return None
    return no_such_job(store, job_id)


def no_such_job(store: KVStore, job_id: str) -> str:
    return (
        f"No job {job_id!r} on {store.description}: etcd holds nothing under "
        f"{JobKeys(job_id).prefix} (is the --job-id right? a job appears once a node of it "
        "runs efdl-run)."
    )


def _when(ts: float) -> str:
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def format_status(st: StatusReport) -> str:
    r = st.round
    lines = [f"job {st.job_id}"]
    if r is None:
        lines.append("  no round yet" + (" (nodes are joining)" if st.nodes else " (no nodes)"))
    else:
        lines.append(
            f"  generation {r.generation}, {r.status.value}, world size {r.world_size}, "
            f"leader {st.leader or '-'}"
        )
        if r.status.final:
            lines.append(
                f"  ended {_when(r.created)}: {r.reason or '-'} (efdl-run --new-run starts a "
                "new run of the job)"
            )
        else:
            lines.append(f"  last rescale {_when(r.created)}: {r.reason or '-'}")
        if r.store_port:
            lines.append(f"  c10d store {r.store_host}:{r.store_port}")
    if st.members:
        lines.append("  members:")
    now = time.time()
    for m in st.members:
        view = st.nodes.get(m.node_id)
        gpus = ", ".join(f"{g.index}:{g.model}" for g in view.record.gpus) if view else ""
        live = st.live.get(m.node_id)
        state = "gone (its lease expired)" if view is None else live.describe(now) if live else ""
        lines.append(
            f"    {m.node_id:<24} {m.host:<16} ranks {m.first_rank}-{m.first_rank + m.workers - 1}"
            f"  gpus [{gpus or 'cpu'}]" + (f"  {state}" if state else "")
        )
    if st.cache is not None:
        c = st.cache
        lines.append(
            f"  cache: step {c.step} (epoch {c.epoch}, world size {c.world_size}) persisted "
            f"{_when(c.time)} in {c.url}"
        )
    spares = st.spares
    if spares:
        lines.append(
            "  spares: " + ", ".join(f"{n} ({st.nodes[n].record.slots} slots)" for n in spares)
        )
    if st.holds:
        lines.append("  held out (efdl release NODE lets one back):")
        for n, h in sorted(st.holds.items()):
            agent = "" if n in st.nodes else " [no agent runs]"
            lines.append(f"    {n:<24} {h.describe(now)}{agent}")
    return "\n".join(lines)


def status_json(st: StatusReport) -> str:
    return json.dumps(
        {
            "job_id": st.job_id,
            "round": json.loads(st.round.to_json()) if st.round else None,
            "members": [asdict(m) for m in st.members],
            "leader": st.leader,
            "nodes": {n: asdict(v.record) for n, v in st.nodes.items()},
            "live": {n: {"probe": v.reply.value, **(v.said or {})} for n, v in st.live.items()},
            "spares": st.spares,
            "cache": asdict(st.cache) if st.cache else None,
            "holds": {n: {**asdict(h), "kind": h.kind.value} for n, h in st.holds.items()},
        },
        indent=2,
        sort_keys=True,
    )
