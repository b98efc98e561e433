"""The fault matrix: each fault injected into a real running job, and the outcome checked.

Every test: real efdl-run agents, real etcd, gloo on CPU, the efdl-aware script (commit every
step). After each fault: identical parameters on all ranks at every step, no committed step
lost, one generation training at a time, the event visible in `efdl status` or the agents'
logs, and (in the fixture) no process of the test left behind. The docstrings are the rows of
docs/reliability.md; the recovery times are recorded for it (see conftest.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import JobKeys, Progress
from tests.e2e.harness import (
    ELASTIC_ARGS,
    Job,
    check_consistent,
    last_step_of,
    latest_gen,
    pids_of,
    regrown,
    steps_at_world,
    wait_gone,
)
from tests.e2e.test_cache import (
    _complete,
    check_resumed,
    make_job,
    restart_and_resume,
    run_and_kill,
)
from tests.faults.conftest import Recorder
from tests.faults.netns import Net, NetnsEtcd
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)
Rows = list[dict[str, object]]
COMMON = ELASTIC_ARGS
# A silent peer's eviction: lease TTL (3 s) + the round + the breaker's grace (2 s) + slack;
# under the workers' 15 s collective timeout, which bounded it before the breaker.
EVICTED_WITHIN = 3 + 2 * 2 + 4


def every_pid(job: Job) -> list[int]:
    """Every process the test started or its agents started (as far as seen)."""
    pids = [a.pid for a in job.agents.values()]
    for a in job.agents.values():
        pids += a.worker_pids()
    pids += [int(r["pid"]) for r in job.events()]  # type: ignore[call-overload]
    return sorted(set(pids))


def stop_and_check_no_orphans(job: Job, seen: list[int]) -> None:
    """Stop the job by PID, then: nothing it started may still run (SIGKILL the rest by PID
    so one failure does not leak processes into the next test)."""
    seen = sorted(set(seen) | set(every_pid(job)))
    job.stop()
    left = wait_gone(seen, 15)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left after the job stopped: {left}"


class Jobs:
    """The jobs of one test; stopped, and checked for processes left, when it ends."""

    def __init__(self, etcd: str, tmp: Path) -> None:
        self.etcd, self.tmp = etcd, tmp
        self.jobs: list[tuple[Job, list[int]]] = []

    def new(self, etcd: str | None = None, name: str = "job", ttl: int = 3) -> Job:
        out = self.tmp / name
        out.mkdir()
        common = [*COMMON, "--lease-ttl", str(ttl)]
        j = Job(
            out, etcd or self.etcd, f"fault-{uuid.uuid4().hex[:8]}", common, {"STEP_SECONDS": "0.1"}
        )
        self.jobs.append((j, []))
        return j

    def watch(self, job: Job, pids: list[int]) -> None:
        """Also check these processes are gone at the end (e.g. stopped ones)."""
        next(seen for j, seen in self.jobs if j is job).extend(pids)

    def stop(self) -> None:
        errors = []
        stopping, self.jobs = self.jobs, []
        for j, seen in stopping:
            try:
                stop_and_check_no_orphans(j, seen)
            except AssertionError as exc:
                errors.append(str(exc))
        assert not errors, errors


@pytest.fixture()
def jobs(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Jobs]:
    js = Jobs(etcd_server.endpoint.target, tmp_path)
    yield js
    js.stop()


@pytest.fixture()
def job(jobs: Jobs) -> Job:
    return jobs.new()


def outputs(job: Job) -> list[str]:
    """The end of each agent's log, for a failed assertion."""
    return [f"{n}: {a.output()[-3000:]}" for n, a in job.agents.items()]


def status(job: Job, wrap: tuple[str, ...] = ()) -> str:
    """`efdl status` of the job: its output."""
    return status_run(job, wrap).stdout


def status_run(job: Job, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*wrap, sys.executable, "-m", "efdl", "status", "--etcd", job.etcd, "--job-id", job.job_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def start(job: Job, *names: str) -> Rows:
    for name in names:
        job.start(name, script="elastic_steps.py")
    return job.wait_for(f"{len(names)} workers", steps_at_world(len(names)))


def recovered(job: Job, world: int, since_gen: int, t0: float, record: Recorder) -> Rows:
    """Wait for the job to train at ``world`` in a generation after ``since_gen``; record the
    time from ``t0`` to its first step."""
    rows = job.wait_for(f"training at world size {world}", steps_at_world(world, since_gen), 120)
    first = min(
        float(r["t"])  # type: ignore[arg-type]
        for r in rows
        if int(r["gen"]) > since_gen and r["world"] == world  # type: ignore[call-overload]
    )
    record.recovered(first - t0)
    return rows


def check_after(rows: Rows, since_gen: int, committed: int, since_t: float | None = None) -> None:
    """Identical parameters, no step back beyond the last commit, one generation at a time.
    The steps checked against ``committed``: those of generations after ``since_gen`` (or,
    with ``since_t``, every step logged after that time)."""
    check_consistent(rows)
    after = [
        int(r["step"])  # type: ignore[call-overload]
        for r in rows
        if int(r["gen"]) > since_gen or (since_t is not None and float(r["t"]) > since_t)  # type: ignore[call-overload, arg-type]
    ]
    assert min(after) >= committed - 1, (min(after), committed)
    spans: dict[int, tuple[float, float]] = {}
    for r in rows:
        g, t = int(r["gen"]), float(r["t"])  # type: ignore[call-overload, arg-type]
        lo, hi = spans.get(g, (t, t))
        spans[g] = (min(lo, t), max(hi, t))
    ordered = sorted(spans.items())
    for (g1, (_, end)), (g2, (begin, _)) in itertools.pairwise(ordered):
        assert end <= begin, f"generations {g1} and {g2} trained at the same time"


def rejoined(job: Job, node: str, world: int, since_gen: int) -> Rows:
    """Wait for ``node`` to train again at ``world`` after ``since_gen`` (its old worker,
    placed in place and synced, or a new one)."""
    return job.wait_for(
        f"{node} back as a new member",
        lambda rs: (
            steps_at_world(world, since_gen)(rs)
            and any(r["node"] == node and int(r["gen"]) > since_gen for r in rs)  # type: ignore[call-overload]
        ),
        120,
    )


def stepped_since(rows: Rows, t: float) -> bool:
    return any(float(r["t"]) > t for r in rows)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the faults


def test_worker_sigkill(job: Job, record: Recorder, attempt: int) -> None:
    """A worker SIGKILLed: its agent starts a new one; the other ranks roll back to the last
    commit and rebuild in place (not restarted); the world size is unchanged."""
    rows = start(job, "a", "b")
    g, committed = latest_gen(rows), max(last_step_of(rows, latest_gen(rows)).values())
    a_pids, victim = pids_of(rows, "a"), job.agents["b"].worker_pids()[0]
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    rows = recovered(job, 2, g, t0, record)
    check_after(rows, g, committed)
    assert pids_of(rows, "a") == a_pids  # the survivor was never restarted
    assert victim not in {r["pid"] for r in rows if int(r["gen"]) > g}  # type: ignore[call-overload]
    assert "world size 2" in status(job)
    assert f"pid {victim}" in job.agents["b"].output()  # the agent reported the crash


def test_agent_sigkill(job: Job, record: Recorder, attempt: int) -> None:
    """An agent SIGKILLed (its workers left alone): its workers die with it; the other node
    goes on at the smaller size once the dead agent's lease expires."""
    rows = start(job, "a", "b")
    g, committed = latest_gen(rows), max(last_step_of(rows, latest_gen(rows)).values())
    orphans = job.agents["b"].worker_pids()
    t0 = time.time()
    job.agents["b"].signal(signal.SIGKILL)
    job.agents["b"].wait()
    assert not wait_gone(orphans, 10), "a worker outlived its SIGKILLed agent"
    rows = recovered(job, 1, g, t0, record)
    check_after(rows, g, committed)
    assert "world size 1" in status(job)


def test_node_sigkill(job: Job, record: Recorder, attempt: int) -> None:
    """A whole node SIGKILLed (agent and workers at once): the survivors roll back to the last
    commit and go on in place at the smaller size."""
    rows = start(job, "a", "b")
    g, committed = latest_gen(rows), max(last_step_of(rows, latest_gen(rows)).values())
    a_pids = pids_of(rows, "a")
    t0 = time.time()
    for pid in [job.agents["b"].pid, *job.agents["b"].worker_pids()]:
        os.kill(pid, signal.SIGKILL)
    job.agents["b"].wait()
    rows = recovered(job, 1, g, t0, record)
    check_after(rows, g, committed)
    assert pids_of(rows, "a") == a_pids
    assert "world size 1" in status(job)


def test_rank0_node_sigkill(job: Job, record: Recorder, attempt: int) -> None:
    """The node holding rank 0 and serving the c10d store SIGKILLed: a survivor takes rank 0
    and serves the next store; nobody restarts."""
    rows = start(job, "a", "b", "c")
    g = latest_gen(rows)
    rank0 = str(next(r["node"] for r in rows if r["gen"] == g and r["rank"] == 0))
    survivors = [n for n in "abc" if n != rank0]
    before = {n: pids_of(rows, n) for n in survivors}
    committed = max(last_step_of(rows, g).values())
    t0 = time.time()
    job.agents[rank0].signal(signal.SIGKILL)
    job.agents[rank0].wait()
    rows = recovered(job, 2, g, t0, record)
    after = [r for r in rows if int(r["gen"]) > g]  # type: ignore[call-overload]
    assert {r["node"] for r in after} == set(survivors)
    assert any(r["rank"] == 0 for r in after)
    for n in survivors:
        assert pids_of(rows, n) == before[n]
    check_after(rows, g, committed)
    assert f"{rank0} left" in job.agents[survivors[0]].output()


def test_hung_node(jobs: Jobs, record: Recorder, attempt: int) -> None:
    """A hung node: its agent and workers SIGSTOPped (no socket closes). The others evict it
    when its lease expires (its agent, asked, does not answer) and go on: the survivors, stuck
    in a collective with it, cut the old group loose once the next generation is ready (lease
    TTL + a grace of a few steps, not the 15 s collective timeout); SIGCONTed, its workers find
    their generation gone (never trained alongside the next one), its agent hears from etcd
    that its lease expired, registers again and joins as a new member."""
    job = jobs.new()
    rows = start(job, "a", "b", "c")
    g = latest_gen(rows)
    committed = max(last_step_of(rows, g).values())
    frozen = [job.agents["c"].pid, *job.agents["c"].worker_pids()]
    old_worker = set(pids_of(rows, "c"))
    jobs.watch(job, frozen)
    t0 = time.time()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        rows = recovered(job, 2, g, t0, record)
        assert time.time() - t0 < EVICTED_WITHIN
        evicted = latest_gen(rows)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    rows = rejoined(job, "c", 3, evicted)
    assert "registering again" in job.agents["c"].output()
    # The frozen worker may log the step it was in when stopped, stamped after SIGCONT: that
    # step was trained before the freeze, not alongside the next generation.
    late = [
        r
        for r in rows
        if r["pid"] in old_worker and int(r["gen"]) == g and float(r["t"]) > t0  # type: ignore[call-overload, arg-type]
    ]
    assert all(int(r["step"]) <= committed + 1 for r in late), late  # type: ignore[call-overload]
    check_after([r for r in rows if r not in late], g, committed)


def test_etcd_restart_during_training(
    jobs: Jobs, own_etcd: EmbeddedEtcd, record: Recorder, attempt: int
) -> None:
    """etcd stopped for 2 s and started again (same data) while the job trains: training goes
    on through it, no split brain, and the job is intact in etcd afterwards (lease TTL 10 s;
    outages longer than the TTL: tests/faults/test_etcd_outage.py)."""
    job = jobs.new(own_etcd.endpoint.target, ttl=10)
    rows = start(job, "a", "b")
    g = latest_gen(rows)
    committed = max(last_step_of(rows, g).values())
    t0 = time.time()
    own_etcd.stop(remove_data=False)
    time.sleep(2)
    own_etcd.start()
    t1 = time.time()
    rows = job.wait_for("steps after the restart", lambda rs: stepped_since(rs, t1 + 2), 60)
    during = [r for r in rows if t0 < float(r["t"]) < t1 and r["rank"] == 0]  # type: ignore[arg-type]
    assert during, "training stopped while etcd was down"
    # Recovery here: the longest time training stood still from the stop to 2 s after.
    stamps = [float(r["t"]) for r in rows if r["rank"] == 0]  # type: ignore[arg-type]
    times = [t0, *sorted(t for t in stamps if t0 < t < t1 + 2)]
    record.recovered(max(b - a for a, b in itertools.pairwise(times)))
    check_after(rows, g, committed, since_t=t0)
    assert latest_gen(rows) == g  # no rescale was needed
    assert "world size 2" in status(job)


def test_etcd_restart_during_a_round(
    jobs: Jobs, own_etcd: EmbeddedEtcd, record: Recorder, attempt: int
) -> None:
    """etcd restarted while a third node is joining (a round in the making): the round
    completes once etcd is back, every rank ends in one generation of 3, no split brain."""
    job = jobs.new(own_etcd.endpoint.target, ttl=10)
    rows = start(job, "a", "b")
    g = latest_gen(rows)
    committed = max(last_step_of(rows, g).values())
    t0 = time.time()
    job.start("c", script="elastic_steps.py")
    wait_until(
        "c to join",
        lambda: "joined" in job.agents["c"].output(),
        30,
        context=job.agents["c"].output,
    )
    own_etcd.stop(remove_data=False)
    time.sleep(1)
    own_etcd.start()
    rows = recovered(job, 3, g, t0, record)
    check_after(rows, g, committed)
    assert "world size 3" in status(job)


def test_sigterm_while_etcd_is_gone(jobs: Jobs, own_etcd: EmbeddedEtcd) -> None:
    """etcd gone for good: the job trains on without it; a SIGTERM still ends the agent at
    once and cleanly (its workers leave at a step boundary), without waiting for etcd."""
    job = jobs.new(own_etcd.endpoint.target)
    start(job, "a")
    agent = job.agents["a"]
    own_etcd.stop(remove_data=False)
    wait_until(
        "the agent to say its lease may have expired",
        lambda: "may have expired there" in agent.output() or agent.proc.poll() is not None,
        120,
    )
    assert agent.proc.poll() is None, agent.output()[-3000:]
    t0 = time.time()
    job.wait_for("a step without etcd", lambda rs: stepped_since(rs, t0), 60)
    agent.signal(signal.SIGTERM)
    # Nobody can tell whether the job goes on: its work counts as unfinished (128 + 15).
    assert agent.wait(timeout_s=60) == 143, agent.output()[-3000:]
    assert "Left the job on SIGTERM; etcd did not say whether the job goes on" in agent.output()


def test_hung_worker_whose_agent_lives(jobs: Jobs, record: Recorder, attempt: int) -> None:
    """A worker's main thread sleeps forever after a step (its process and agent alive, its
    channel answering): it makes no step while its peer waits on it in the next step's
    collective; after the hang timeout (--hang-timeout 5; the peer's collective timeout is
    15 s) its agent kills it, the job trains on without it (the healthy rank is never the one
    replaced), and its replacement joins."""
    job = jobs.new()
    job.common = [*job.common, "--hang-timeout", "5"]
    job.env["HANG_AT"] = "1:20"
    rows = start(job, "a", "b")
    g = latest_gen(rows)
    hung_node = str(next(r["node"] for r in rows if r["gen"] == g and r["rank"] == 1))
    healthy = "a" if hung_node == "b" else "b"
    healthy_pids = pids_of(rows, healthy)
    rows = job.wait_for(
        "rank 1's step 20, where it hangs",
        lambda rs: any(r["rank"] == 1 and r["step"] == 20 for r in rs),
        60,
    )
    hung_pid = next(r["pid"] for r in rows if r["rank"] == 1 and r["step"] == 20)
    t0 = max(float(r["t"]) for r in rows if r["step"] == 20)  # type: ignore[arg-type]
    rows = job.wait_for("training without it", steps_at_world(1, g), 90)
    alone = min(float(r["t"]) for r in rows if int(r["gen"]) > g and r["world"] == 1)  # type: ignore[arg-type, call-overload]
    assert alone - t0 < 5 + 10, f"it took {alone - t0:.1f} s to go on without the hung worker"
    record.recovered(alone - t0)
    rows = job.wait_for("its replacement", regrown(2), 120)
    assert pids_of(rows, healthy) == healthy_pids, "the healthy rank was replaced"
    assert hung_pid not in {r["pid"] for r in rows if float(r["t"]) > t0 + 1}  # type: ignore[arg-type]
    assert "made no step" in job.agents[hung_node].output()
    check_after(rows, g, 20)
    history = subprocess.run(
        [sys.executable, "-m", "efdl", "events", "--etcd", job.etcd, "--job-id", job.job_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "hang" in history and "made no step" in history, history


def test_worker_stuck_at_its_first_batch_after_a_rescale(
    jobs: Jobs, record: Recorder, attempt: int
) -> None:
    """A survivor stuck before its first step of a new generation (its data loader waits on a
    read; process, agent and channel alive) while its new peer waits in that step's
    collective: after the hang timeout it is replaced, not the peer. (Spared until its first
    commit, it held the job: the peer failed at every generation, its node left at last, and
    the stuck rank stayed alone.)"""
    job = jobs.new()
    job.common = [*job.common, "--hang-timeout", "5"]
    job.env.update(FAIL_AT="1:20", HANG_AT_ENTRY="20")  # rank 1 crashes; back at two, the
    rows = start(job, "a", "b")  # survivor sticks at its first batch
    stuck = job.out / "hang-entry.pid"
    rows = job.wait_for("the survivor stuck at its first batch", lambda _: stuck.exists())
    stuck_gen, stuck_pid, t0 = latest_gen(rows), int(stuck.read_text()), stuck.stat().st_mtime
    rows = job.wait_for("training at two again without it", steps_at_world(2, stuck_gen), 120)
    record.recovered(min(float(r["t"]) for r in rows if int(r["gen"]) > stuck_gen) - t0)  # type: ignore[arg-type, call-overload]
    outputs = "".join(a.output() for a in job.agents.values())
    assert "made no step" in outputs and "since its state was synced" in outputs, outputs
    after = [r for r in rows if int(r["gen"]) > stuck_gen]  # type: ignore[call-overload]
    assert stuck_pid not in {r["pid"] for r in after}
    assert {r["node"] for r in after if r["world"] == 2} == {"a", "b"}  # nobody left
    check_consistent(rows)


@pytest.mark.parametrize("script", ["elastic_steps.py", "fsdp_steps.py"])
def test_every_worker_killed_without_a_cache(
    jobs: Jobs, etcd_server: EmbeddedEtcd, record: Recorder, attempt: int, script: str
) -> None:
    """Every worker SIGKILLed at once (their agents alive) with no remote cache, after steps
    were committed, for a DDP and an FSDP2 model: the replacements hold no state and nothing
    can bring it back, so the job fails with a StateLostError that names the step lost and
    the ways on; every agent exits non-zero and no worker trains from step 0."""
    job = jobs.new()
    for name in "ab":
        job.start(name, script=script)
    job.wait_for("2 workers", steps_at_world(2))
    keys = JobKeys(job.job_id)
    with EtcdStore(etcd_server.settings()) as store:
        wait_until("the job's progress in etcd", lambda: store.get(keys.progress), 30)
        published = Progress.from_json(store.get(keys.progress).value, keys.progress).step  # type: ignore[union-attr]
    victims = [pid for a in job.agents.values() for pid in a.worker_pids()]
    jobs.watch(job, victims)
    t0 = time.time()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    codes = {n: a.wait(120) for n, a in job.agents.items()}
    record.recovered(time.time() - t0)
    logs = "".join(a.output() for a in job.agents.values())
    assert all(code == 1 for code in codes.values()), (codes, logs[-4000:])
    lost = re.search(r"The job's state is lost: it had committed step (\d+)", logs)
    assert lost and int(lost.group(1)) >= published, logs[-4000:]
    assert "--cache-url" in logs and "--new-run" in logs
    fresh = [r for r in job.events() if float(r["t"]) > t0]  # type: ignore[arg-type]
    assert not fresh, f"a worker trained after every worker was lost: {fresh[:3]}"
    assert "failed" in status(job) and "state is lost" in status(job)


def test_hostile_records_in_etcd(
    jobs: Jobs, etcd_server: EmbeddedEtcd, record: Recorder, attempt: int
) -> None:
    """Garbage and hostile values written into the job's etcd prefix while it trains (a node
    record that is not JSON, copies of a real one with a shell command as its host or a
    billion slots, a round that is not a round, a member record that is not one, a cache record
    pointing at another path): the agents log each as an error naming the key and go on; a
    node still joins (the leader replaces the bad round), and `efdl status` still answers,
    naming the bad records it read."""
    job = jobs.new()
    rows = start(job, "a", "b")
    g = latest_gen(rows)
    committed = max(last_step_of(rows, g).values())
    keys = JobKeys(job.job_id)
    with EtcdStore(etcd_server.settings()) as store:
        lease = store.grant_lease(60)
        try:
            store.put(keys.node("zz-garbage"), b"{not json", lease=lease)
            real = json.loads(store.get(keys.node("a")).value)  # type: ignore[union-attr]
            for name, bad in (
                ("zz-host", {"host": "$(touch /tmp/x)"}),
                ("zz-slots", {"slots": 10**9}),
            ):
                hostile = {**real, "node_id": name, **bad}
                store.put(keys.node(name), json.dumps(hostile).encode(), lease=lease)
            store.put(keys.member("zz-garbage"), b"NaN?")
            store.put(keys.cache, b'{"step": "../../etc/passwd"}')
            store.put(keys.round, b"\x00\xff not a round")
            t0 = time.time()
            job.start("c", script="elastic_steps.py")
            rows = recovered(job, 3, g, t0, record)
        finally:
            store.revoke_lease(lease)
    check_after(rows, g, committed)
    logs = "".join(a.output() for a in job.agents.values())
    named = [keys.node(n) for n in ("zz-garbage", "zz-host", "zz-slots")]
    for key in [*named, keys.round]:
        assert key in logs, f"no error names {key}"
    assert "Traceback" not in logs
    shown = status_run(job)
    assert "world size 3" in shown.stdout
    assert keys.cache in shown.stderr and "Traceback" not in shown.stderr
    assert keys.member("zz-garbage") in shown.stderr


def test_two_jobs_one_churning(jobs: Jobs, record: Recorder, attempt: int) -> None:
    """Two jobs in one etcd; one churns (a node joins, a node is SIGKILLed, a node leaves):
    the other is untouched (same generation, same processes, steps without a gap)."""
    quiet = jobs.new(name="quiet")
    busy = jobs.new(name="busy")
    rows = start(quiet, "q1", "q2")
    g_quiet, q_pids = latest_gen(rows), {r["pid"] for r in rows}
    start(busy, "a", "b")
    t0 = time.time()
    busy.start("c", script="elastic_steps.py")
    busy_rows = busy.wait_for("busy at 3", steps_at_world(3, latest_gen(busy.events())), 120)
    for pid in [busy.agents["b"].pid, *busy.agents["b"].worker_pids()]:
        os.kill(pid, signal.SIGKILL)
    busy_rows = busy.wait_for("busy at 2", steps_at_world(2, latest_gen(busy_rows)), 120)
    busy.agents["c"].signal(signal.SIGTERM)
    assert busy.agents["c"].wait(30) == 0
    busy_rows = busy.wait_for("busy at 1", steps_at_world(1, latest_gen(busy_rows)), 120)
    record.recovered(time.time() - t0)
    check_consistent(busy_rows)
    rows = [r for r in quiet.events() if float(r["t"]) >= t0]  # type: ignore[arg-type]
    assert rows and {int(r["gen"]) for r in rows} == {g_quiet}  # type: ignore[call-overload]
    assert {r["pid"] for r in rows} <= q_pids
    steps = sorted({int(r["step"]) for r in rows})  # type: ignore[call-overload]
    assert steps == list(range(steps[0], steps[-1] + 1)), "the quiet job skipped steps"
    gaps = sorted(float(r["t"]) for r in rows if r["rank"] == 0)  # type: ignore[arg-type]
    assert max(b - a for a, b in itertools.pairwise(gaps)) < 2.0, "the quiet job stalled"
    assert f"generation {g_quiet}, active, world size 2" in status(quiet)


def test_every_agent_killed_then_restarted(
    etcd_server: EmbeddedEtcd, tmp_path: Path, record: Recorder, attempt: int
) -> None:
    """Every agent SIGKILLed, then new agents started: the job resumes from the remote cache
    at its newest complete snapshot, with identical parameters and optimizer state."""
    job = make_job(etcd_server, tmp_path, str(tmp_path / "cache"), {})
    try:
        store, rows, pids = run_and_kill(job, str(job.out / "cache"))
        newest = next(s for s in store.steps() if _complete(store, s))
        t0 = time.time()
        new = restart_and_resume(job, pids)
        record.recovered(min(float(e["t"]) for e in new) - t0)  # type: ignore[arg-type]
        check_resumed(new, rows, newest)
        assert "resuming from step" in job.agents["a2"].output() + job.agents["b2"].output()
        assert "cache: step" in status(job)
    finally:
        stop_and_check_no_orphans(job, [])


def test_network_partition(
    jobs: Jobs, net: Net, tmp_path: Path, record: Recorder, attempt: int
) -> None:
    """One node cut off from etcd and its peers (its link goes down in a network namespace of
    the test's own): the majority goes on without it (lease TTL + a grace of a few steps, as
    for a hung node); the cut-off node's workers cannot train alone (their generation's
    collectives need the others, who left it); after healing, etcd tells its agent that the
    lease expired, and it registers again and joins as a new member."""
    etcd = NetnsEtcd(net.main, net.main_addr).start()
    try:
        job = jobs.new(f"{net.main_addr}:{etcd.client_port}")
        main, cut = Net.exec(net.main), Net.exec(net.cut)
        for name in "ab":
            job.start(name, script="elastic_steps.py", host=net.main_addr, wrap=main)
        job.start("c", script="elastic_steps.py", host=net.cut_addr, wrap=cut)
        rows = job.wait_for("3 workers", steps_at_world(3))
        g = latest_gen(rows)
        committed = max(last_step_of(rows, g).values())
        old = set(pids_of(rows, "c"))
        t0 = time.time()
        net.partition()
        rows = recovered(job, 2, g, t0, record)
        assert time.time() - t0 < EVICTED_WITHIN
        evicted = latest_gen(rows)
        net.heal()
        rows = rejoined(job, "c", 3, evicted)
        assert "registering again" in job.agents["c"].output()
        alone = [
            r
            for r in rows
            if r["pid"] in old and int(r["gen"]) == g and float(r["t"]) > t0 + 1  # type: ignore[call-overload, arg-type]
        ]
        assert not alone, "the cut-off node trained on alone in its old generation"
        check_after(rows, g, committed)
        assert "world size 3" in status(job, main)
        jobs.stop()
    finally:
        etcd.stop()
