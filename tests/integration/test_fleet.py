"""The fleet's records and its elected allocator against a real etcd (the registry's contract
also against the in-memory store): submit, cancel, a decision's compare-and-swap, a decision
larger than one etcd transaction, and the allocator's leader killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from efdl.cli import main
from efdl.errors import ConfigError
from efdl.fleet.allocate import Allocation, allocate
from efdl.fleet.holdings import holdings
from efdl.fleet.leader import Allocator
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import FleetGpu, FleetKeys, Host, JobSpec, JobStatus, Phase
from efdl.fleet.registry import (
    cancel,
    prune_events,
    read_events,
    read_fleet,
    status_writes,
    submit,
    write_decision,
)
from efdl.rendezvous.api import Compare, KVStore
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.holds import HoldKind, hold
from efdl.rendezvous.records import JobKeys, NodeRecord
from tests.wait import wait_until


@pytest.fixture()
def keys() -> FleetKeys:
    return FleetKeys(f"t{uuid.uuid4().hex[:10]}")


def spec(job_id: str, lo: int = 1, hi: int = 4, priority: int = 0) -> JobSpec:
    return JobSpec(
        job_id, ("train.py",), "/srv/code", lo, hi, priority, "file:///ckpt", submitted=1.0
    )


def add_host(store: KVStore, keys: FleetKeys, name: str, gpus: int = 8, lease: int = 0) -> Host:
    h = Host(name, f"{name}.internal", tuple(FleetGpu(i, f"GPU-{name}-{i}") for i in range(gpus)))
    store.put(keys.host(name), h.to_json(), lease=lease)
    return h


def leading(store: KVStore, keys: FleetKeys) -> Compare:
    """An election key of this test's own, standing."""
    store.put(keys.leader + "me", b"{}")
    kv = store.get(keys.leader + "me")
    assert kv is not None
    return Compare.create_revision_is(kv.key, kv.create_revision)


def test_submit_refuses_an_active_id_and_one_that_efdl_run_uses(
    store: KVStore, keys: FleetKeys
) -> None:
    jid = f"bert-{uuid.uuid4().hex[:6]}"
    status = submit(store, keys, spec(jid))
    assert status.phase is Phase.QUEUED
    view = read_fleet(store, keys)
    assert [(j.spec.job_id, j.status.phase) for j in view.jobs] == [(jid, Phase.QUEUED)]
    with pytest.raises(
        ConfigError, match=f"Job '{jid}' is already in fleet '{keys.fleet}' \\(queued\\)"
    ):
        submit(store, keys, spec(jid))
    assert cancel(store, keys, jid, "by test").phase is Phase.CANCELLED
    assert cancel(store, keys, jid).reason == "by test"  # twice: nothing more changes
    assert submit(store, keys, spec(jid, 2, 2)).phase is Phase.QUEUED  # an ended id is reused
    assert read_fleet(store, keys).jobs[0].spec.min_workers == 2
    by_hand = f"hand-{uuid.uuid4().hex[:6]}"
    node = NodeRecord("n1", "10.0.0.1", 29400, 1)
    store.put(JobKeys(by_hand).node("n1"), node.to_json())
    with pytest.raises(ConfigError, match="in use by a job started with efdl-run"):
        submit(store, keys, spec(by_hand))
    with pytest.raises(ConfigError, match="has no job 'nope'"):
        cancel(store, keys, "nope")


def test_a_bad_record_is_skipped_and_named(store: KVStore, keys: FleetKeys) -> None:
    submit(store, keys, spec("ok"))
    store.put(keys.spec("broken"), b'{"job_id": "broken"}')
    store.put(keys.host("h"), b"not json")
    view = read_fleet(store, keys)
    assert [j.spec.job_id for j in view.jobs] == ["ok"]
    assert any("jobs/broken/spec has no field" in p for p in view.problems)
    assert any(f"{keys.host('h')} is not valid JSON" in p for p in view.problems)


def put_event(store: KVStore, keys: FleetKeys, t: float, job_id: str, st: JobStatus) -> None:
    store.txn([], status_writes(keys, job_id, st, now=t)[1:])  # the event alone


def test_old_events_go_but_each_unfinished_jobs_place_then(store: KVStore, keys: FleetKeys) -> None:
    host = "ip-10-2-0-1.ec2.internal"
    running = JobStatus(Phase.RUNNING, ((host, (0, 1)),), 0.0, "placed")
    for i in range(130):  # more than one etcd transaction's worth
        put_event(store, keys, 100 + i / 1000, "done", running)
    put_event(store, keys, 200, "done", JobStatus(Phase.FINISHED, (), 0.0, "its workers ended"))
    put_event(store, keys, 150, "long", JobStatus(Phase.RUNNING, ((host, (2,)),), 0.0, "placed"))
    put_event(store, keys, 160, "long", JobStatus(Phase.RUNNING, ((host, (2, 3)),), 0.0, "grew"))
    put_event(store, keys, 150, "recent", JobStatus(Phase.QUEUED, (), 0.0, "waits"))
    put_event(store, keys, 900, "recent", JobStatus(Phase.RUNNING, ((host, (4,)),), 0.0, "placed"))
    store.put(keys.events_at(120) + "-bad", b"not json")
    assert prune_events(store, keys, before=500) == 131 + 1 + 1
    events, problems = read_events(store, keys)
    assert [(e.time, e.job_id) for e in events] == [(150, "recent"), (160, "long"), (900, "recent")]
    assert problems == []
    assert {(h.job_id, h.index, h.start) for h in holdings(events, 1000)} == {
        ("long", 2, 160), ("long", 3, 160), ("recent", 4, 900)
    }  # fmt: skip
    assert prune_events(store, keys, before=500) == 0
    assert [e.time for e in read_events(store, keys, since=155)[0]] == [160, 900]


def test_the_leader_deletes_events_older_than_its_history_hourly(
    store: KVStore, keys: FleetKeys
) -> None:
    day = 86400.0
    clock = [10 * day]
    alloc = Allocator(store, keys, "me", 0, FleetPolicy(history_s=2 * day), clock=lambda: clock[0])
    done = JobStatus(Phase.CANCELLED, (), 0.0, "cancelled")
    put_event(store, keys, 7 * day, "old", done)
    put_event(store, keys, 9 * day, "young", done)
    assert alloc.decide(leading(store, keys))
    assert [e.job_id for e in read_events(store, keys)[0]] == ["young"]
    clock[0] += 1800  # within the hour: not again
    put_event(store, keys, 7 * day, "old", done)
    assert alloc.decide(leading(store, keys))
    assert [e.job_id for e in read_events(store, keys)[0]] == ["old", "young"]
    clock[0] += 1800
    assert alloc.decide(leading(store, keys))
    assert [e.job_id for e in read_events(store, keys)[0]] == ["young"]


def test_a_decision_is_written_only_while_nothing_changed_since_it_was_read(
    store: KVStore, keys: FleetKeys
) -> None:
    add_host(store, keys, "ip-10-0-0-1.ec2.internal")
    submit(store, keys, spec("a"))
    lead = leading(store, keys)
    view = read_fleet(store, keys)
    decision = allocate(view.hosts, view.jobs, 100.0)
    cancel(store, keys, "a")  # a user acts between the read and the write
    assert not write_decision(store, keys, view, decision, lead, 100.0)
    assert read_fleet(store, keys).jobs[0].status.phase is Phase.CANCELLED
    submit(store, keys, spec("b"))
    view = read_fleet(store, keys)
    decision = allocate(view.hosts, view.jobs, 100.0)
    store.delete(lead.key)  # no longer leading
    assert not write_decision(store, keys, view, decision, lead, 100.0)
    lead = leading(store, keys)
    assert write_decision(store, keys, view, decision, lead, 100.0)
    b = {j.spec.job_id: j.status for j in read_fleet(store, keys).jobs}["b"]
    assert b.phase is Phase.RUNNING and b.size == 4
    events, problems = read_events(store, keys)  # every status change (the decision's
    # clock here is 100 s after the epoch, the others' now: it comes first)
    assert [(e.job_id, e.status.phase) for e in events] == [
        ("b", Phase.RUNNING), ("a", Phase.QUEUED), ("a", Phase.CANCELLED), ("b", Phase.QUEUED)
    ] and not problems  # fmt: skip
    assert read_events(store, keys, since=events[-1].time)[0] == events[-1:]


def test_a_decision_larger_than_one_etcd_transaction_gives_gpus_up_first(
    etcd_server: EmbeddedEtcd, keys: FleetKeys
) -> None:
    """200 jobs change at once (etcd allows 128 operations per transaction)."""
    with EtcdStore(etcd_server.settings()) as store:
        for i in range(25):
            add_host(store, keys, f"gpu-{i:03d}.us-central1-a.c.proj.internal")
        for i in range(200):
            store.put(keys.spec(f"job-{i:03d}"), spec(f"job-{i:03d}", 1, 1).to_json())
        lead = leading(store, keys)
        view = read_fleet(store, keys)
        decision = allocate(view.hosts, view.jobs, 100.0)
        assert len(decision.statuses) == 200
        assert write_decision(store, keys, view, decision, lead, 100.0)
        placed = read_fleet(store, keys)
        assert sum(j.status.size for j in placed.jobs) == 200
        assert len(store.get_prefix(keys.events).kvs) == 200


class Candidates:
    """Allocator candidates as threads, each with its own etcd client and lease."""

    def __init__(self, server: EmbeddedEtcd, keys: FleetKeys) -> None:
        self.server, self.keys = server, keys
        self.stores: list[EtcdStore] = []
        self.stops: dict[str, threading.Event] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.allocators: dict[str, Allocator] = {}
        self.leases: dict[str, tuple[EtcdStore, int]] = {}
        self.decisions: list[Allocation] = []
        self.decided: list[float] = []  # when each decision was written (monotonic)

    def start(self, name: str) -> None:
        store = EtcdStore(self.server.settings(request_timeout_s=3))
        self.stores.append(store)
        lease = store.grant_lease(30)
        self.leases[name] = (store, lease)
        alloc = Allocator(
            store,
            self.keys,
            name,
            lease,
            FleetPolicy(resize_interval_s=0.0),
            period_s=0.5,
            on_decision=self._written,
        )
        stop = threading.Event()
        thread = threading.Thread(target=alloc.run, args=(stop,), daemon=True, name=name)
        self.allocators[name], self.stops[name], self.threads[name] = alloc, stop, thread
        thread.start()

    def _written(self, decision: Allocation) -> None:
        self.decisions.append(decision)
        self.decided.append(time.monotonic())

    def kill(self, name: str) -> None:
        """As if its daemon died: it stops acting, and its lease ends."""
        self.stops[name].set()
        self.threads[name].join(timeout=30)
        store, lease = self.leases[name]
        store.revoke_lease(lease)

    def close(self) -> None:
        for name, stop in self.stops.items():
            stop.set()
            self.threads[name].join(timeout=30)
            assert not self.threads[name].is_alive(), f"allocator {name} did not stop"
        for store in self.stores:
            store.close()


@pytest.fixture()
def candidates(etcd_server: EmbeddedEtcd, keys: FleetKeys) -> Iterator[Candidates]:
    c = Candidates(etcd_server, keys)
    try:
        yield c
    finally:
        c.close()


def statuses(store: KVStore, keys: FleetKeys) -> dict[str, JobStatus]:
    return {j.spec.job_id: j.status for j in read_fleet(store, keys).jobs}


def test_one_candidate_leads_and_a_successor_takes_over_when_it_dies(
    etcd_server: EmbeddedEtcd, keys: FleetKeys, candidates: Candidates
) -> None:
    with EtcdStore(etcd_server.settings()) as store:
        add_host(store, keys, "ip-10-1-0-1.ec2.internal", 4)
        add_host(store, keys, "ip-10-1-0-2.ec2.internal", 4)
        candidates.start("ip-10-1-0-1.ec2.internal")
        wait_until(
            "the first candidate to lead",
            lambda: candidates.allocators["ip-10-1-0-1.ec2.internal"].leading.is_set(),
            30,
        )
        candidates.start("ip-10-1-0-2.ec2.internal")
        submit(store, keys, spec("low", 2, 8, 0))
        wait_until("job low on all 8 GPUs", lambda: statuses(store, keys)["low"].size == 8, 30)
        assert not candidates.allocators["ip-10-1-0-2.ec2.internal"].leading.is_set()
        candidates.kill("ip-10-1-0-1.ec2.internal")
        wait_until(
            "the successor to lead",
            lambda: candidates.allocators["ip-10-1-0-2.ec2.internal"].leading.is_set(),
            30,
        )
        submit(store, keys, spec("high", 4, 4, 5))
        wait_until(
            "job high placed", lambda: statuses(store, keys)["high"].phase is Phase.RUNNING, 30
        )
        st = statuses(store, keys)
        assert st["high"].size == 4 and st["low"].size == 4
        assert "shrunk by 4 GPUs for high (priority 5)" in st["low"].reason


def test_a_burst_of_changes_makes_few_decisions_at_most_one_per_gap(
    etcd_server: EmbeddedEtcd, keys: FleetKeys, candidates: Candidates
) -> None:
    """Sixty jobs submitted at once (as a fleet's start, or inference moving on many hosts,
    changes many records): the leader decides at most once per gap (1 s), each decision
    taking in everything that came meanwhile, and every job gets its place."""
    with EtcdStore(etcd_server.settings()) as store:
        for i in range(8):
            add_host(store, keys, f"ip-10-2-0-{i}.ec2.internal", 8)
        candidates.start("ip-10-2-0-0.ec2.internal")
        wait_until(
            "the candidate to lead",
            lambda: candidates.allocators["ip-10-2-0-0.ec2.internal"].leading.is_set(),
            30,
        )
        before = len(candidates.decided)
        t0 = time.monotonic()
        for i in range(60):
            submit(store, keys, spec(f"burst-{i:02d}", 1, 1))
        wait_until(
            "every job placed",
            lambda: sum(st.phase is Phase.RUNNING for st in statuses(store, keys).values()) == 60,
            60,
        )
        made = candidates.decided[before:]
        # one decision per gap at most (and one more for the one under way at the start)
        assert len(made) <= (made[-1] - t0) / 1.0 + 2, (len(made), made[-1] - t0)
        assert len(made) < 20, len(made)


def efdl(server: EmbeddedEtcd, keys: FleetKeys, *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``efdl`` command, as a process."""
    return subprocess.run(
        [sys.executable, "-m", "efdl", *args],
        env={**os.environ, "EFDL_ETCD": str(server.endpoint), "EFDL_FLEET": keys.fleet},
        capture_output=True,
        text=True,
        timeout=120,
    )


def efdl_here(server: EmbeddedEtcd, keys: FleetKeys, *args: str) -> tuple[int, str]:
    """The same command run in this process (click's runner): its exit code and output."""
    env = {"EFDL_ETCD": str(server.endpoint), "EFDL_FLEET": keys.fleet}
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def test_the_commands_submit_list_and_cancel_and_refuse_bad_input(
    etcd_server: EmbeddedEtcd, keys: FleetKeys, tmp_path: Path
) -> None:
    with EtcdStore(etcd_server.settings()) as store:
        add_host(store, keys, "ip-10-2-0-1.ec2.internal", 8)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "t.py").write_text("")
    run = efdl(
        etcd_server, keys, "submit", "--job-id", "gpt-small", "--min", "2", "--max", "8",
        "--priority", "3", "--cache-url", f"file://{tmp_path}", "--workdir", str(tmp_path),
        "--env", "NCCL_DEBUG=WARN", "--", "train.py", "--lr", "0.1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "job gpt-small: queued in fleet" in run.stdout
    with EtcdStore(etcd_server.settings()) as store:
        job = read_fleet(store, keys).jobs[0]
    assert job.spec.argv == ("train.py", "--lr", "0.1") and job.spec.workdir == str(tmp_path)
    assert job.spec.env == (("NCCL_DEBUG", "WARN"),)
    listed = efdl(etcd_server, keys, "jobs")
    assert listed.returncode == 0, listed.stderr
    assert "gpt-small" in listed.stdout and "queued" in listed.stdout
    assert "1 hosts, 8 GPUs: 0 training, 0 held by other processes, 8 free" in listed.stdout
    code, out = efdl_here(etcd_server, keys, "jobs", "--json")
    as_json = json.loads(out)
    assert as_json["jobs"][0]["spec"]["job_id"] == "gpt-small"
    sub = ["submit", "--job-id", "x", "--min", "1"]
    for args, message in [
        (["submit", "--job-id", "x", "--min", "4", "--max", "2"], "--min 4 and --max 2 are not"),
        ([*sub, "--env", "RANK=1"], "'RANK' cannot be set"),
        ([*sub, "--env", "NOEQUALS"], "--env 'NOEQUALS' is not NAME=VALUE"),
        ([*sub, "--workdir", "/nonexistent/dir"], "is not a directory here"),
        (["submit", "--job-id", "gpt-small", "--min", "1"], "is already in fleet"),
        (["submit", "--job-id", "a/b", "--min", "1"], "job id 'a/b' is not allowed"),
    ]:
        where = [] if "--workdir" in args else ["--workdir", str(tmp_path)]
        code, out = efdl_here(etcd_server, keys, *args, *where, "--", "t.py")
        assert code == 2 and message in out, (args, out)
    code, out = efdl_here(etcd_server, keys, *sub, "--workdir", str(tmp_path), "--", "nosuch.py")
    assert code == 2 and f"The training script 'nosuch.py' is not in {tmp_path}" in out, out
    for args, message in [
        (["cancel", "nope"], "has no job 'nope'"),
        (["allocator", "--resize-interval", "-1"], "--resize-interval -1.0 is not a number of"),
        (["node", "--resume-after", "-5"], "--resume-after -5.0 is not a number of seconds"),
        (["allocator", "--preempt-after", "-1"], "--preempt-after -1.0 is not a number of"),
        (["kube-controller", "--protect", "nan"], "--protect nan is not a number of seconds"),
        (["node", "--history-days", "0"], "--history-days 0.0 is not a number of days > 0"),
        (["node", "--job-uids", "1-70000"], "--job-uids 1-70000 holds uid 65534"),
        *(
            [(["node"], "every job would run as root and could read this daemon's etcd")]
            if os.geteuid() == 0
            else [(["node", "--job-uids", "70000-70999"], "needs efdl node to run as root")]
        ),
    ]:
        code, out = efdl_here(etcd_server, keys, *args)
        assert code == 2 and message in out, (args, out)
    code, out = efdl_here(etcd_server, keys, "cancel", "--job-id", "gpt-small")
    assert code == 0 and "job gpt-small: cancelled" in out, out
    code, out = efdl_here(etcd_server, keys, "jobs", "--history", "--job-id", "gpt-small")
    assert code == 0 and "queued" in out and "cancelled by efdl cancel" in out, out
    for args, message in [
        (["jobs", "--job-id", "gpt-small"], "--job-id and --since go with --history"),
        (["jobs", "--history", "--since", "yesterday"], "--since 'yesterday' is neither"),
        (["timeline", "--fleet", keys.fleet, "--job-id", "x", "--out", "f.png"], "give one"),
        (["timeline", "--fleet", keys.fleet, "--out", "f.png"], "no job held a GPU"),
    ]:
        code, out = efdl_here(etcd_server, keys, *args)
        assert code == 2 and message in out, (args, out)


def test_efdl_timeline_draws_which_job_held_which_gpu(
    keys: FleetKeys, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    with EtcdStore(etcd_server.settings()) as store:
        add_host(store, keys, "ip-10-3-0-1.ec2.internal", 4)
        submit(store, keys, spec("low", 1, 4, 0))
        view = read_fleet(store, keys)
        decision = allocate(view.hosts, view.jobs, 100.0)
        assert write_decision(store, keys, view, decision, leading(store, keys), 100.0)
    png = tmp_path / "f.png"
    code, out = efdl_here(etcd_server, keys, "timeline", "--fleet", keys.fleet, "--out", str(png))
    assert code == 0 and "4 stretches on GPUs drawn" in out, out
    assert png.read_bytes().startswith(b"\x89PNG")


def test_allocator_processes_a_killed_leader_is_replaced(
    etcd_server: EmbeddedEtcd, keys: FleetKeys
) -> None:
    """Two ``efdl allocator`` processes; the leader is SIGKILLed (by PID): the other leads
    once its lease expires, and places a job submitted meanwhile."""
    env = {**os.environ, "EFDL_ETCD": str(etcd_server.endpoint), "EFDL_FLEET": keys.fleet}
    argv = [sys.executable, "-m", "efdl", "allocator", "--lease-ttl", "2", "--resize-interval", "0"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with EtcdStore(etcd_server.settings()) as store:
            add_host(store, keys, "ip-10-3-0-1.ec2.internal", 4)
            for name in ("alloc-a", "alloc-b"):
                procs[name] = subprocess.Popen([*argv, "--id", name], env=env)
                wait_until(
                    f"{name} to stand",
                    lambda n=name: store.get(keys.leader + n) is not None,  # type: ignore[misc]
                    60,
                )
            submit(store, keys, spec("first", 1, 2))
            wait_until("job first placed", lambda: statuses(store, keys)["first"].size == 2, 60)
            procs["alloc-a"].send_signal(signal.SIGKILL)  # the first to stand leads
            procs["alloc-a"].wait(timeout=30)
            cancel(store, keys, "first")
            submit(store, keys, spec("second", 4, 4))
            wait_until(
                "job second placed by the successor",
                lambda: statuses(store, keys)["second"].phase is Phase.RUNNING,
                60,
            )
            assert procs["alloc-b"].poll() is None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def test_the_allocator_waits_out_an_etcd_crash_and_allocates_again(
    own_etcd: EmbeddedEtcd, keys: FleetKeys
) -> None:
    c = Candidates(own_etcd, keys)
    try:
        with EtcdStore(own_etcd.settings(request_timeout_s=2)) as store:
            add_host(store, keys, "ip-10-4-0-1.ec2.internal", 2)
            c.start("only")
            alloc = c.allocators["only"]
            wait_until("the candidate to lead", alloc.leading.is_set, 30)
            own_etcd.kill()
            wait_until("the allocator to see etcd fail", lambda: not alloc.leading.is_set(), 60)
            own_etcd.start()
            submit(store, keys, spec("after", 2, 2))
            wait_until(
                "job after placed by the same allocator",
                lambda: statuses(store, keys)["after"].phase is Phase.RUNNING,
                60,
            )
            assert c.threads["only"].is_alive()
    finally:
        c.close()


def test_a_drained_host_s_gpus_leave_every_job_and_come_back_when_released(
    etcd_server: EmbeddedEtcd, keys: FleetKeys, candidates: Candidates
) -> None:
    """efdl drain --fleet: the leader sees the hold at once (it watches holds/), takes the
    host's GPUs from the job on it (in place, the reason names the drain), places nothing
    there; efdl nodes --fleet lists it; efdl release --fleet lets it back. A quarantine that
    a host's daemon carried up from a job (efdl.fleet.host_holds) is read the same way."""
    a, b = "ip-10-3-0-1.ec2.internal", "ip-10-3-0-2.ec2.internal"
    with EtcdStore(etcd_server.settings()) as store:
        add_host(store, keys, a, 4)
        add_host(store, keys, b, 4)
        candidates.start(a)
        submit(store, keys, spec("wide", 2, 8, 0))
        wait_until("job wide on all 8 GPUs", lambda: statuses(store, keys)["wide"].size == 8, 30)
        code, out = efdl_here(etcd_server, keys, "drain", "--fleet", keys.fleet, b, "--reason",
                              "kernel upgrade")  # fmt: skip
        assert code == 0 and f"host {b} is drained (kernel upgrade)" in out, out
        wait_until("job wide off host b", lambda: statuses(store, keys)["wide"].size == 4, 30)
        st = statuses(store, keys)["wide"]
        assert st.phase is Phase.RUNNING and dict(st.gpus) == {a: (0, 1, 2, 3)}
        assert f"host {b} is held out (drain: kernel upgrade" in st.reason, st.reason
        code, out = efdl_here(etcd_server, keys, "nodes", "--fleet", keys.fleet, "--json")
        rows = {r["host"]: r for r in json.loads(out)}
        assert code == 0 and rows[b]["state"] == "held" and rows[a]["state"] == "serving"
        assert rows[b]["hold"]["kind"] == "drain" and rows[b]["hold"]["until"] is None
        for args, message in [
            (["drain", "--fleet", keys.fleet, "--job-id", "wide", b], "give one"),
            (["release", "--fleet", keys.fleet, a], f"Host {a} is not held in fleet"),
            (["drain", "--fleet", keys.fleet, "a/b"], "host id 'a/b' is not allowed"),
        ]:
            code, out = efdl_here(etcd_server, keys, *args)
            assert code == 2 and message in out, (args, out)
        code, out = efdl_here(etcd_server, keys, "release", "--fleet", keys.fleet, b)
        assert code == 0 and f"host {b} is released (it was held: drain: kernel upgrade" in out
        wait_until("job wide back on 8 GPUs", lambda: statuses(store, keys)["wide"].size == 8, 30)
        add_host(store, keys, "ip-10-3-0-3.ec2.internal", 4)
        hold(store, keys, "ip-10-3-0-3.ec2.internal", HoldKind.QUARANTINE, "ECC", 3600)
        submit(store, keys, spec("next", 1, 4, 0))
        wait_until(
            "job next placed", lambda: statuses(store, keys)["next"].phase is Phase.RUNNING, 30
        )
        assert "ip-10-3-0-3.ec2.internal" not in dict(statuses(store, keys)["next"].gpus)


def test_a_daemon_carries_a_job_s_quarantine_of_its_agent_up_to_its_host(
    store: KVStore, keys: FleetKeys
) -> None:
    """A health check or a crash loop quarantined one of this host's agents in its job: the
    daemon's next pass holds the host out of the fleet until that quarantine ends (once)."""
    from efdl.fleet.host_holds import agent_prefix, carry_quarantines
    from efdl.rendezvous.holds import read_holds

    host = "ip-10-4-0-1.ec2.internal"
    node = f"{agent_prefix(host)}3-9f0c"
    hold(store, JobKeys("gpt"), node, HoldKind.QUARANTINE, "GPU 3: Xid 79 (fell off the bus)", 900)
    assert carry_quarantines(store, keys, host, ["bert"], {}) is None  # not bert's node
    written = carry_quarantines(store, keys, host, ["gpt", "bert"], {})
    assert written is not None
    held = read_holds(store, keys)[host]
    assert held == written and held.kind is HoldKind.QUARANTINE and held.until is not None
    assert held.reason == f"job gpt quarantined its node {node}: GPU 3: Xid 79 (fell off the bus)"
    assert carry_quarantines(store, keys, host, ["gpt"], read_holds(store, keys)) is None
