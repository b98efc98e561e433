"""Rendezvous at scale: N simulated agents (threads, no torch) against one real local etcd.

For N agents it measures, from etcd's own metrics and the agents' clocks:
- join:  from the last agent's join to every agent seeing the round with all N;
- leave: from a member's graceful leave to every other agent seeing the next round;
- crash: from a member's crash (no revoke) to every other agent seeing the next round, and
  the part of it after etcd expired the lease (the rest is the lease TTL);
- etcd requests per round (unary RPCs, keep-alives excluded) and watch messages sent.

Usage: python -m benchmarks.rendezvous_scale [--sizes 2,16,64,256] [--settle 0.5] [--ttl 5]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import re
import statistics
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psutil

from benchmarks.report import verdict
from efdl.rendezvous.api import EtcdSettings
from efdl.rendezvous.decide import JobView, NodeView, Policy, decide
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.records import JobKeys, NodeRecord, Round, RoundStatus

# Agents per shared connection: each holds 3 streams (its keep-alive and two watches), and
# etcd 3.5 serves at most 100 or so concurrent streams per connection (the rest wait).
SHARE = 24


def node_name(i: int) -> str:
    """A realistic node id: a cloud host name and efdl's random suffix, padded to 64
    characters (the longest ids users have; short ids hid a round-size limit once)."""
    return f"ip-10-0-{i // 256}-{i % 256}.us-west-2.compute.internal-{i:06x}".ljust(64, "0")


_METRIC = re.compile(r"^(grpc_server_handled_total|grpc_server_msg_sent_total)\{(.*)\} (\S+)$")


def etcd_metrics(server: EmbeddedEtcd) -> Counter[str]:
    """Unary RPCs handled and watch messages sent, by method, from etcd's /metrics."""
    url = f"http://127.0.0.1:{server.client_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        method = labels.get("grpc_method", "?")
        if m.group(1) == "grpc_server_handled_total" and labels.get("grpc_type") == "unary":
            counts[f"rpc:{method}"] += int(float(m.group(3)))
        elif m.group(1) == "grpc_server_msg_sent_total" and method == "Watch":
            counts["watch_msgs"] += int(float(m.group(3)))
        elif m.group(1) == "grpc_server_msg_sent_total" and method == "LeaseKeepAlive":
            counts["keepalives"] += int(float(m.group(3)))
    return counts


def requests_of(delta: Counter[str]) -> int:
    return sum(v for k, v in delta.items() if k.startswith("rpc:"))


@dataclass
class Phase:
    name: str
    seconds: float
    rounds: int
    requests: int
    watch_msgs: int
    after_expiry_s: float | None = None
    round_bytes: int = 0  # the round record, which every agent watches
    member_bytes: int = 0  # one member's record, which its agent reads once per round
    idle_agent_ms: float = 0.0  # CPU ms per second per agent while nothing happens: agents
    idle_etcd_ms: float = 0.0  # ... and etcd
    threads: float = 0.0  # threads per agent


@dataclass(frozen=True)
class GroupSpec:
    """What a worker process's agents are: their job, policy and lease TTL, whether they share
    connections (by SHARE; else one each, as on a real fleet), and how many join at once."""

    endpoint: str
    job: str
    policy: Policy
    ttl_s: int
    shared: bool
    wave: int


class _Group:
    """Some of the fleet's agents, living in one worker process."""

    def __init__(self, spec: GroupSpec, seen: Any) -> None:
        self.spec, self.seen = spec, seen
        self.agents: dict[str, Participant] = {}
        self.stores: list[EtcdStore] = []
        self.lock = threading.Lock()
        self.pool: list[EtcdStore] = []

    def connect(self) -> EtcdStore:
        store = EtcdStore(
            EtcdSettings.from_list(self.spec.endpoint, request_timeout_s=10, connect_timeout_s=30)
        )
        self.stores.append(store)
        return store

    def add(self, i: int) -> None:
        if self.spec.shared:
            with self.lock:
                if not self.pool or len(self.agents) >= SHARE * len(self.pool):
                    self.pool.append(self.connect())
                store = self.pool[-1]
        else:
            store = self.connect()
        node_id = node_name(i)

        def on_round(r: Round) -> None:
            if r.status is RoundStatus.ACTIVE:
                self.seen.put((r.world_size, r.generation, node_id, time.monotonic()))

        agent = Participant(
            store,
            self.spec.job,
            NodeRecord(node_id, "127.0.0.1", 30000 + i, 1),
            self.spec.policy,
            lease_ttl_s=self.spec.ttl_s,
            on_round=on_round,
        )
        agent.join()
        with self.lock:
            self.agents[node_id] = agent

    def serve(self, conn: Any) -> None:
        while True:
            cmd, arg = conn.recv()
            if cmd == "add":
                # In waves, as agents of a fleet come up: a process that started thousands of
                # joins in the same instant would starve the lease refreshes of the first.
                for k in range(0, len(arg), self.spec.wave):
                    threads = [
                        threading.Thread(target=self.add, args=(i,))
                        for i in arg[k : k + self.spec.wave]
                    ]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                conn.send(time.monotonic())
            elif cmd in ("leave", "abandon"):
                t0 = time.monotonic()
                getattr(self.agents.pop(arg), cmd)()
                conn.send(t0)
            elif cmd == "close":
                for a in self.agents.values():
                    a.abandon()
                for s in self.stores:
                    s.close()
                conn.send(None)
                return


def _group_main(conn: Any, spec: GroupSpec, seen: Any) -> None:
    logging.basicConfig(level=logging.ERROR)
    _Group(spec, seen).serve(conn)


class Fleet:
    """N agents of one job spread over worker processes (CLOCK_MONOTONIC is system-wide, so
    their timestamps compare); records when each agent saw a round of each world size."""

    def __init__(
        self,
        server: EmbeddedEtcd,
        n: int,
        settle_s: float,
        ttl_s: int,
        procs: int,
        shared: bool = False,
        wave: int = 32,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.job = f"bench-{uuid.uuid4().hex[:6]}"
        self.n = n
        self.seen_q: Any = ctx.Queue()
        self.seen: dict[int, dict[str, float]] = {}
        self.generation = 0
        self.owner: dict[str, int] = {}
        self.conns = []
        self.procs = []
        policy = Policy(min_workers=1, max_workers=10 * n, settle_s=settle_s)
        spec = GroupSpec(str(server.endpoint), self.job, policy, ttl_s, shared, wave)
        for _ in range(min(procs, n)):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_group_main,
                args=(child, spec, self.seen_q),
                daemon=True,
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def add(self, indices: list[int]) -> float:
        """Join these agents (spread over the processes); when the last join returned."""
        parts = [indices[k :: len(self.conns)] for k in range(len(self.conns))]
        for conn, part in zip(self.conns, parts, strict=True):
            conn.send(("add", part))
            for i in part:
                self.owner[node_name(i)] = self.conns.index(conn)
        return max(conn.recv() for conn in self.conns)

    def act(self, cmd: str, node_id: str) -> float:
        conn = self.conns[self.owner.pop(node_id)]
        conn.send((cmd, node_id))
        return float(conn.recv())

    def wait_all(self, world: int, names: set[str], timeout_s: float = 300) -> float:
        """When the last of ``names`` saw a round of ``world`` workers (monotonic seconds)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = self.seen.get(world, {})
            if names <= seen.keys():
                return max(seen[n] for n in names)
            try:
                w, gen, node, t = self.seen_q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.setdefault(w, {})[node] = t
            self.generation = max(self.generation, gen)
        missing = sorted(names - self.seen.get(world, {}).keys())[:5]
        raise TimeoutError(
            f"not every agent saw world size {world} within {timeout_s} s; e.g. not {missing}"
        )

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("close", None))
            conn.recv()
        for p in self.procs:
            p.join(timeout=10)


def idle_cost(
    fleet: Fleet, server: EmbeddedEtcd, n: int, window_s: float = 5.0
) -> tuple[float, float, float]:
    """CPU milliseconds per second per agent while nothing happens (keep-alives, gRPC's
    own timers), in the agents' processes and in etcd; and threads per agent."""
    agents = [psutil.Process(p.pid) for p in fleet.procs if p.pid is not None]
    etcd = psutil.Process(server.pid) if server.pid is not None else None

    def used() -> tuple[float, float]:
        a = sum(sum(p.cpu_times()[:2]) for p in agents)
        return a, sum(etcd.cpu_times()[:2]) if etcd else 0.0

    a0, e0 = used()
    time.sleep(window_s)
    a1, e1 = used()
    threads = sum(p.num_threads() for p in agents) / n
    return (a1 - a0) / window_s / n * 1e3, (e1 - e0) / window_s / n * 1e3, threads


def records_at(n: int) -> tuple[int, int]:
    """The round's and one member's record sizes when ``n`` nodes of 8 GPUs with 64-character
    ids start (what the leader writes; no etcd needed)."""
    nodes = {
        node_name(i): NodeView(
            NodeRecord(node_name(i), f"10.0.{i // 256}.{i % 256}", 29500, 8), i + 1
        )
        for i in range(n)
    }
    d = decide(JobView(nodes, None, leader=node_name(0)), Policy(1, 8 * n, settle_s=0), 1.0)
    assert d.round is not None
    return len(d.round.to_json()), max(len(m.to_json()) for m in d.members)


def run_size(
    n: int, settle_s: float, ttl_s: int, procs: int, shared: bool, wave: int
) -> list[Phase]:
    phases: list[Phase] = []
    with EmbeddedEtcd() as server:
        fleet = Fleet(server, n, settle_s, ttl_s, procs, shared, wave)
        observer = EtcdStore(server.settings())
        try:
            before = etcd_metrics(server)
            t_last_join = fleet.add(list(range(n)))
            names = set(fleet.owner)
            done = fleet.wait_all(n, names)
            time.sleep(0.2)
            delta = etcd_metrics(server) - before
            agents_ms, etcd_ms, threads = idle_cost(fleet, server, n)
            phases.append(
                Phase(
                    "join",
                    done - t_last_join,
                    fleet.generation,
                    requests_of(delta),
                    delta["watch_msgs"],
                    idle_agent_ms=agents_ms,
                    idle_etcd_ms=etcd_ms,
                    threads=threads,
                )
            )

            # A graceful leave of the newest member (a non-leader).
            leaver = node_name(n - 1)
            names.discard(leaver)
            gen0, before = fleet.generation, etcd_metrics(server)
            t0 = fleet.act("leave", leaver)
            done = fleet.wait_all(n - 1, names)
            time.sleep(0.2)
            delta = etcd_metrics(server) - before
            phases.append(
                Phase(
                    "leave",
                    done - t0,
                    fleet.generation - gen0,
                    requests_of(delta),
                    delta["watch_msgs"],
                )
            )

            # Back to N, then a crash: the agent stops refreshing its lease, revokes nothing.
            fleet.seen.clear()
            fleet.add([n])
            names.add(node_name(n))
            fleet.wait_all(n, names)
            round_kv = observer.get(JobKeys(fleet.job).round)
            round_bytes = len(round_kv.value) if round_kv else 0
            member_kv = observer.get(JobKeys(fleet.job).member(node_name(0)))
            member_bytes = len(member_kv.value) if member_kv else 0
            victim = node_name(n)
            names.discard(victim)
            key = JobKeys(fleet.job).node(victim)
            watch = observer.watch(key, start_revision=observer.get_prefix(key).revision + 1)
            gen0, before = fleet.generation, etcd_metrics(server)
            t0 = fleet.act("abandon", victim)
            batch = watch.get(timeout_s=ttl_s * 3 + 10)
            t_expired = time.monotonic()
            assert batch is not None, "the crashed node's lease did not expire"
            done = fleet.wait_all(n - 1, names)
            time.sleep(0.2)
            delta = etcd_metrics(server) - before
            # The observer's watch setup came before `before`; its one event is subtracted.
            phases.append(
                Phase(
                    "crash",
                    done - t0,
                    fleet.generation - gen0,
                    requests_of(delta),
                    delta["watch_msgs"] - 1,
                    done - t_expired,
                    round_bytes,
                    member_bytes,
                )
            )
            watch.cancel()
        finally:
            observer.close()
            fleet.close()
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,16,64,256")
    parser.add_argument("--settle", type=float, default=0.5, help="settle window, seconds")
    parser.add_argument("--ttl", type=int, default=5, help="lease TTL, seconds")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size (median shown)")
    parser.add_argument("--procs", type=int, default=4, help="processes the agents run in")
    parser.add_argument(
        "--wave", type=int, default=32, help="agents a process starts joining at once"
    )
    parser.add_argument(
        "--shared-connections",
        action="store_true",
        help=f"agents share etcd connections, {SHARE} to one (each still with its own lease, "
        "watches and requests): how thousands of agents fit on a small machine",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"Rendezvous scale: settle window {args.settle:g} s, lease TTL {args.ttl} s, "
        f"median of {args.repeat} runs (min-max); one local etcd; simulated agents (the real "
        f"Participant, no torch) as threads in {args.procs} processes, each agent with its "
        + (
            f"own lease, watches and requests, sharing an etcd connection by {SHARE}"
            if args.shared_connections
            else "own etcd connection, lease and watches"
        )
        + ". `join`: from the last agent's join returning "
        "to every agent seeing the round with all of them (it includes the settle window that "
        "batches joins); `leave`: from a member's graceful leave; `crash`: from a member that "
        "stops refreshing its lease, and the column after it is the part after etcd expired "
        "the lease. Requests: etcd's own count of unary RPCs (from its /metrics; keep-alives "
        "excluded); watch msgs: watch messages etcd sent.\n"
    )
    print(
        "| agents | event | to every agent seeing the round (s) | after lease expiry (s) "
        "| rounds | etcd requests | per agent | watch msgs |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    worst: dict[str, float] = {}
    join_requests: dict[int, float] = {}
    round_bytes: dict[int, tuple[int, int]] = {}
    failed: dict[int, str] = {}
    idle: dict[int, tuple[float, float, float]] = {}
    for n in sizes:
        try:
            runs = [
                run_size(n, args.settle, args.ttl, args.procs, args.shared_connections, args.wave)
                for _ in range(args.repeat)
            ]
        except TimeoutError as exc:
            failed[n] = str(exc).split(";")[0]
            print(f"| {n} | join | did not converge: {failed[n]} | - | - | - | - | - |", flush=True)
            continue
        round_bytes[n] = (runs[0][2].round_bytes, runs[0][2].member_bytes)
        first = runs[0][0]
        idle[n] = (first.idle_agent_ms, first.idle_etcd_ms, first.threads)
        for i, name in enumerate(("join", "leave", "crash")):
            ps = [r[i] for r in runs]
            worst["join" if i == 0 else name] = statistics.median(p.seconds for p in ps)
            if i == 0:
                join_requests[n] = statistics.median(p.requests for p in ps) / n
            if i == 2:
                worst["after expiry"] = statistics.median(
                    p.after_expiry_s for p in ps if p.after_expiry_s is not None
                )
            secs = [p.seconds for p in ps]
            after = [p.after_expiry_s for p in ps if p.after_expiry_s is not None]
            reqs = statistics.median(p.requests for p in ps)
            after_text = (
                f"{statistics.median(after):.3f} ({min(after):.3f}-{max(after):.3f})"
                if after
                else "-"
            )
            print(
                f"| {n} | {name} | {statistics.median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f}) "
                f"| {after_text} | {statistics.median(p.rounds for p in ps):g} | {reqs:g} "
                f"| {reqs / n:.2f} | {statistics.median(p.watch_msgs for p in ps):g} |",
                flush=True,
            )
    largest = max(round_bytes, default=0)
    if not largest:
        print(f"\nNo size converged on this machine: {failed}.")
        return
    join = worst["join"] - args.settle
    print(
        f"\nGoal, at the largest size that converged ({largest} agents): a round reaches every "
        "agent "
        f"{join:.2f} s after the settle window on a join (goal < 2 s: {verdict(join < 2)}), "
        f"{worst['leave']:.2f} s after a leave (goal < 1 s: {verdict(worst['leave'] < 1)}), "
        f"and {worst['after expiry']:.2f} s after a crashed member's lease expired (goal < 1 s: "
        f"{verdict(worst['after expiry'] < 1)}). etcd requests per joining agent: "
        + ", ".join(f"{v:.2f} at {n}" for n, v in join_requests.items())
        + " agents. The round record, which every agent watches, and one member's record, "
        "which its agent reads once per round (64-character node ids): "
        + ", ".join(f"{r} and {m} bytes at {n}" for n, (r, m) in round_bytes.items())
        + " agents.\n"
    )
    r4k, m4k = records_at(4096)
    print(
        f"At 4096 nodes of 8 GPUs (what the leader writes, from the decision itself): the round "
        f"record is {r4k} bytes and a member's record at most {m4k} bytes, so a rescale moves "
        f"about {4096 * (r4k + 2 * m4k) / 1e6:.1f} MB through etcd in all (the members' records "
        "written once and read once, the round sent once to each agent), where a round that "
        f"listed its members would have been sent 4096 times.\n"
    )
    a_ms, e_ms, threads = idle[largest]
    cores = 4096 * (a_ms + e_ms) / 1e3
    print(
        f"What limits the simulation here: at {largest} agents, an agent that does nothing costs "
        f"{a_ms:.2f} ms of CPU per second in its process (lease keep-alives every TTL/3, gRPC's "
        f"timers on its streams) and {e_ms:.2f} ms in etcd, and runs {threads:.1f} threads; "
        f"4096 such agents would need {cores:.1f} of this machine's {os.cpu_count()} cores "
        f"before any round, and {threads * 4096:.0f} threads (the kernel's default pid_max is "
        "32768). On a real fleet each agent has a host of its own."
        + (
            " Sizes that did not converge: "
            + "; ".join(f"{n} agents ({why})" for n, why in failed.items())
            + "."
            if failed
            else ""
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
