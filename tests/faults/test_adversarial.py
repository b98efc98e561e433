"""Faults a Jepsen-minded tester injects (issue 54): a generation cut off from etcd whole, an
etcd that forgets under a running job, and hangs that a worker's own threads cannot see.

Real efdl-run agents on 127.0.0.1, a real etcd, gloo on CPU, the efdl-aware test script
(commit every step). The docstrings are rows of docs/reliability.md.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import JobKeys, Progress
from efdl.worker.cache import SnapshotStorage
from tests.e2e.harness import (
    Job,
    check_consistent,
    last_step_of,
    latest_gen,
    regrown,
    steps_at_world,
)
from tests.etcd_memory import backup, restore, wipe
from tests.faults.conftest import Recorder
from tests.faults.test_faults import Jobs, jobs, stop_and_check_no_orphans
from tests.proxy import Proxy
from tests.wait import wait_until

__all__ = ["jobs"]  # the fixture, shared with test_faults
pytestmark = pytest.mark.timeout(300)
Rows = list[dict[str, object]]
FENCE_S = 8  # the agents' --fence-timeout here (lease TTL 3 s)


def trained_apart(rows: Rows) -> None:
    """No two generations trained at the same time (every step of a generation is logged
    before the first step of the next)."""
    spans: dict[int, tuple[float, float]] = {}
    for r in rows:
        g, t = int(r["gen"]), float(r["t"])  # type: ignore[call-overload, arg-type]
        lo, hi = spans.get(g, (t, t))
        spans[g] = (min(lo, t), max(hi, t))
    for (g1, (_, end)), (g2, (begin, _)) in itertools.pairwise(sorted(spans.items())):
        assert end <= begin, f"generations {g1} and {g2} trained at the same time"


@pytest.fixture()
def proxied(etcd_server: EmbeddedEtcd) -> Iterator[Proxy]:
    with Proxy(("127.0.0.1", etcd_server.client_port)) as proxy:
        yield proxy


def cache_job(out: Path, etcd: str, url: str, *extra: str) -> Job:
    out.mkdir()
    return Job(
        out,
        etcd,
        f"fence-{uuid.uuid4().hex[:8]}",
        [
            *("--lease-ttl", "3", "--settle", "0.5", "--grace-period", "10"),
            *("--min", "1", "--max", "1", "--nproc-per-node", "1"),
            *("--fence-timeout", str(FENCE_S)),
            *("--cache-url", url, "--cache-every-steps", "5", "--cache-every", "0"),
            *extra,
        ],
        {"STEP_SECONDS": "0.1"},
    )


def test_a_generation_cut_off_from_etcd_whole(
    etcd_server: EmbeddedEtcd, proxied: Proxy, tmp_path: Path, record: Recorder, attempt: int
) -> None:
    """The only member of the active generation (node a) is cut off from etcd, the hard way
    (its link to etcd stalls: nothing refused, nothing answered), while a hot spare (b) is
    not, and a's probe port still answers the spare that leads (it says it runs the round):
    a's worker stops committing at its fence timeout (8 s), state in memory, and the spare's
    generation resumes from the cache only after that and a margin: no two generations train
    at once, and no snapshot a wrote after its fence exists. Healed, a's agent hears that its
    lease expired and registers again; its worker, replaced, leaves (recovery: from the cut to
    the spare's first step)."""
    url = str(tmp_path / "cache")
    job = cache_job(tmp_path / "job", etcd_server.endpoint.target, url)
    try:
        job.start("a", "--etcd", proxied.address, script="elastic_steps.py")
        job.wait_for("a trains", steps_at_world(1))
        job.start("b", script="elastic_steps.py")
        wait_until("b to wait as a spare", lambda: "is a spare" in job.agents["b"].output(), 90)
        rows = job.wait_for("a snapshot", lambda rs: len(SnapshotStorage(url).manifests()) > 0)
        g = latest_gen(rows)
        t0 = time.time()
        proxied.stall()
        rows = job.wait_for(
            "b to train in a new generation",
            lambda rs: any(r["node"] == "b" and int(r["gen"]) > g for r in rs),  # type: ignore[call-overload]
            120,
        )
        a_rows = [r for r in rows if r["node"] == "a" and int(r["gen"]) == g]  # type: ignore[call-overload]
        a_last = max(float(r["t"]) for r in a_rows)  # type: ignore[arg-type]
        b_first = min(float(r["t"]) for r in rows if r["node"] == "b")  # type: ignore[arg-type]
        record.recovered(b_first - t0)
        assert a_last < b_first, "the cut-off generation trained beside its successor"
        assert a_last - t0 < FENCE_S + 3, (a_last - t0, job.agents["a"].output()[-3000:])
        assert "fence timeout" in job.agents["a"].output()
        resumed = min(int(r["step"]) for r in rows if r["node"] == "b")  # type: ignore[call-overload]
        a_steps = max(int(r["step"]) for r in a_rows)  # type: ignore[call-overload]
        assert resumed <= a_steps + 1  # from a's snapshot, never from beyond what a trained
        proxied.heal()
        a_pids = {r["pid"] for r in a_rows}
        wait_until(
            "a's replaced worker to leave",
            lambda: not any(p in a.worker_pids() for a in job.agents.values() for p in a_pids),
            120,
        )
        rows = job.wait_for(
            "b training on", lambda rs: len([r for r in rs if r["node"] == "b"]) >= 10
        )
        late = [r for r in rows if r["node"] == "a" and float(r["t"]) > b_first]  # type: ignore[arg-type]
        assert not late, f"a trained after its generation was replaced: {late[:3]}"
        trained_apart(rows)
        check_consistent(rows)
    finally:
        stop_and_check_no_orphans(job, [])


def test_etcd_emptied_under_a_running_job(
    jobs: Jobs, own_etcd: EmbeddedEtcd, record: Recorder, attempt: int
) -> None:
    """etcd loses its data directory while a job of two nodes trains (stopped, emptied,
    started again on the same endpoint): training goes on through it; every agent finds that
    etcd forgot (its revision went back), its watches re-list, its node registers again
    claiming the round, and nobody exits or restarts a worker; the job's progress record is
    published again from the agents' memory; a third node that joins afterwards is admitted
    (a round written on the new etcd reaches every follower) (recovery: the longest time
    between two steps from the fault until the third node trains)."""
    job = jobs.new(own_etcd.endpoint.target, ttl=3)
    for name in "ab":
        job.start(name, script="elastic_steps.py")
    rows = job.wait_for("2 workers", steps_at_world(2))
    g = latest_gen(rows)
    committed = max(last_step_of(rows, g).values())
    pids = {a: set(job.agents[a].worker_pids()) for a in "ab"}
    t0 = time.time()
    wipe(own_etcd)
    keys = JobKeys(job.job_id)
    with EtcdStore(own_etcd.settings()) as store:

        def progress() -> int:
            kv = store.get(keys.progress)
            return -1 if kv is None else Progress.from_json(kv.value, keys.progress).step

        # Every rank committed the step before the newest one logged (the record's step).
        wait_until("the progress record again", lambda: progress() >= committed - 1, 60)
    job.start("c", script="elastic_steps.py")
    rows = job.wait_for("3 workers after the wipe", steps_at_world(3, g), 120)
    stamps = sorted(float(r["t"]) for r in rows if r["rank"] == 0 and float(r["t"]) > t0)  # type: ignore[arg-type]
    record.recovered(max(b - a for a, b in itertools.pairwise([t0, *stamps])))
    for a in "ab":
        out = job.agents[a].output()
        assert job.agents[a].proc.poll() is None, out[-3000:]
        assert "has forgotten what it held" in out, out[-3000:]
        assert pids[a] <= set(job.agents[a].worker_pids()), "a worker was restarted"
    trained_apart(rows)
    check_consistent(rows)


def test_etcd_restored_from_an_older_backup_under_a_running_job(
    jobs: Jobs, own_etcd: EmbeddedEtcd, tmp_path: Path, record: Recorder, attempt: int
) -> None:
    """etcd is restored from a backup taken before the job's last rescale, while the job
    trains (the backup's round is older, its revision below what the agents saw): training
    goes on; the agents find it (the revision went back), adopt the round key as the backup
    holds it (the leader's compare-and-swap succeeds, no storm of retries), and a node that
    joins afterwards is admitted (recovery: from the restore to the joined node's first
    step)."""
    job = jobs.new(own_etcd.endpoint.target, ttl=3)
    job.start("a", script="elastic_steps.py")
    job.wait_for("1 worker", steps_at_world(1))
    backup(own_etcd, tmp_path / "backup.db")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("2 workers", steps_at_world(2))
    g = latest_gen(rows)
    t0 = time.time()
    restore(own_etcd, tmp_path / "backup.db")
    job.start("c", script="elastic_steps.py")
    rows = job.wait_for("3 workers after the restore", steps_at_world(3, g), 120)
    first = min(float(r["t"]) for r in rows if r["world"] == 3)  # type: ignore[arg-type]
    record.recovered(first - t0)
    for a in "ab":
        out = job.agents[a].output()
        assert job.agents[a].proc.poll() is None, out[-3000:]
        assert "has forgotten what it held" in out, out[-3000:]
        assert out.count("the round changed under us") < 20, out[-3000:]
    trained_apart(rows)
    check_consistent(rows)


def _pair(jobs: Jobs, *extra: str, **env: str) -> tuple[Job, Rows, str, str]:
    """Two nodes training (one worker each): the job, its rows, and which node has rank 1 and
    which rank 0."""
    job = jobs.new()
    job.common = [*job.common, *extra]
    job.env.update(env)
    for name in "ab":
        job.start(name, script="elastic_steps.py")
    rows = job.wait_for("2 workers", steps_at_world(2))
    g = latest_gen(rows)
    one = str(next(r["node"] for r in rows if r["gen"] == g and r["rank"] == 1))
    return job, rows, one, "a" if one == "b" else "b"


def _replaced_not_the_healthy(
    job: Job, rows: Rows, stuck: str, healthy: str, t0: float, record: Recorder
) -> None:
    """The stuck worker's agent killed it, the job trained on without it, the healthy rank
    was never replaced, and the replacement joined."""
    g = latest_gen([r for r in rows if float(r["t"]) <= t0])  # type: ignore[arg-type]
    healthy_pids = {r["pid"] for r in rows if r["node"] == healthy}
    rows = job.wait_for("training without it", steps_at_world(1, g), 90)
    alone = min(float(r["t"]) for r in rows if int(r["gen"]) > g and r["world"] == 1)  # type: ignore[arg-type, call-overload]
    assert alone - t0 < 5 + 10, f"it took {alone - t0:.1f} s to go on without the stuck worker"
    record.recovered(alone - t0)
    rows = job.wait_for("its replacement", regrown(2), 120)
    assert {r["pid"] for r in rows if r["node"] == healthy} == healthy_pids, "healthy replaced"
    out = job.agents[stuck].output()
    assert "made no step" in out and "frozen for" in out, out[-3000:]
    trained_apart(rows)
    check_consistent(rows)


def test_a_worker_frozen_in_c_with_the_gil_held(jobs: Jobs, record: Recorder, attempt: int) -> None:
    """Rank 1's main thread enters a C call that holds the GIL after step 20 (libc's sleep
    through ctypes.PyDLL): none of its threads runs (no beat, no channel), its process and
    agent alive; its peer waits on it in the next step's collective. Its agent, which judges
    from outside (the worker's last beat, the peer's mark), kills it after the hang timeout
    (--hang-timeout 5; the peer's collective timeout is 15 s): the job trains on without it,
    the healthy rank is never the one replaced, and the replacement joins."""
    job, _, frozen, healthy = _pair(jobs, "--hang-timeout", "5", FREEZE_AT="1:20")
    marker = job.out / "frozen.pid"
    job.wait_for("rank 1 frozen", lambda _: marker.exists(), 60)
    t0 = marker.stat().st_mtime
    _replaced_not_the_healthy(job, job.events(), frozen, healthy, t0, record)


def test_a_worker_stopped_alone(jobs: Jobs, record: Recorder, attempt: int) -> None:
    """Rank 1's worker SIGSTOPped after step 20, its agent alive (a process stuck in a
    driver): it is killed by its agent after the hang timeout (--hang-timeout 5), never its
    healthy peer; the job trains on without it, and its replacement joins."""
    job, rows, stopped, healthy = _pair(jobs, "--hang-timeout", "5")
    rows = job.wait_for(
        "rank 1's step 20", lambda rs: any(r["rank"] == 1 and r["step"] == 20 for r in rs), 60
    )
    pid = int(next(r["pid"] for r in rows if r["rank"] == 1 and r["step"] == 20))  # type: ignore[call-overload]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    jobs.watch(job, [pid])
    _replaced_not_the_healthy(job, job.events(), stopped, healthy, t0, record)


def test_a_rank_0_checkpoint_save_at_the_defaults(
    jobs: Jobs, record: Recorder, attempt: int
) -> None:
    """Rank 0 saves a checkpoint for 35 s after step 20 (rank 0 only, as most scripts do:
    torch.save, mostly in C with the GIL held) while rank 1 waits for it in the next step's
    collective, at efdl's defaults (collective timeout 600 s, torch's; hang timeout 540 s):
    nobody is killed, nothing is rebuilt, and training goes on after the save (recovery: the
    time rank 1 stood still)."""
    job, rows, _, _ = _pair(jobs, COLLECTIVE_TIMEOUT="default", SAVE_AT="0:20:35")
    g = latest_gen(rows)
    pids = {r["pid"] for r in rows}
    saves = job.out / "saves.jsonl"
    rows = job.wait_for(
        "steps after the save",
        lambda rs: saves.exists() and any(int(r["step"]) >= 25 for r in rs),  # type: ignore[call-overload]
        120,
    )
    saved = json.loads(saves.read_text().splitlines()[0])
    assert saved["seconds"] >= 35, saved
    one = sorted(float(r["t"]) for r in rows if r["rank"] == 1)  # type: ignore[arg-type]
    stood = max(b - a for a, b in itertools.pairwise(one))
    assert stood >= 30, f"rank 1 did not wait for the save ({stood:.1f} s)"
    record.recovered(stood)
    assert latest_gen(rows) == g, "the job was rebuilt"
    assert {r["pid"] for r in rows} == pids, "a worker was replaced"
    outputs = "".join(a.output() for a in job.agents.values())
    assert "made no step" not in outputs, outputs[-3000:]
    check_consistent(rows)


@pytest.mark.parametrize("script", ["elastic_steps.py", "steps.py"])
def test_a_job_cut_off_from_etcd_past_its_fence_stops_and_goes_on(
    etcd_server: EmbeddedEtcd,
    proxied: Proxy,
    tmp_path: Path,
    record: Recorder,
    attempt: int,
    script: str,
) -> None:
    """A one-node job cut off from etcd (its link stalls) longer than its fence timeout (8 s),
    with nobody to replace it: its worker stops at the fence (efdl-aware: its commit waits,
    state in memory; a plain script: SIGSTOP), and when the link heals the agent registers
    again claiming the round, finds the round still the job's, and the same worker goes on
    in the same generation: nothing restarted, nothing lost (recovery: from the heal to the
    next step)."""
    out = tmp_path / "job"
    out.mkdir()
    job = Job(
        out,
        etcd_server.endpoint.target,
        f"fence-{uuid.uuid4().hex[:8]}",
        [
            *("--lease-ttl", "3", "--settle", "0.5", "--grace-period", "10"),
            *("--min", "1", "--max", "1", "--nproc-per-node", "1"),
            *("--fence-timeout", str(FENCE_S), "--etcd", proxied.address),
        ],
        {"STEP_SECONDS": "0.1"},
    )
    try:
        job.start("a", script=script)
        rows = job.wait_for("training", lambda rs: len(rs) >= 10)
        g, pids = latest_gen(rows), {r["pid"] for r in rows}
        t_cut = time.time()
        proxied.stall()
        fenced_by = t_cut + FENCE_S + 2  # the fence, a step, and slack
        job.wait_for("the fence", lambda _: time.time() > fenced_by + 4, 60)
        t_heal = time.time()
        proxied.heal()
        rows = job.wait_for("steps after the heal", lambda rs: stepped_after(rs, t_heal), 90)
        during = [r for r in rows if fenced_by < float(r["t"]) < t_heal]  # type: ignore[arg-type]
        assert not during, f"trained past its fence while cut off: {during[:3]}"
        after = min(float(r["t"]) for r in rows if float(r["t"]) > t_heal)  # type: ignore[arg-type]
        record.recovered(after - t_heal)
        assert {r["pid"] for r in rows} == pids, "a worker was restarted"
        assert latest_gen(rows) == g
        if script == "elastic_steps.py":
            check_consistent(rows)
    finally:
        stop_and_check_no_orphans(job, [])


def stepped_after(rows: Rows, t: float) -> bool:
    return any(float(r["t"]) > t for r in rows)  # type: ignore[arg-type]


def test_etcd_emptied_under_a_job_with_hot_spares(
    jobs: Jobs, own_etcd: EmbeddedEtcd, record: Recorder, attempt: int
) -> None:
    """etcd loses its data while one node trains (--max 1) and two hot spares wait: whoever
    registers first after the wipe may lead, and finds none of the round's member records;
    it waits for the round's members to register again claiming it, and takes the one that
    does for the member it was: the training worker keeps its state and goes on, no spare
    takes its place (recovery: the longest time between two steps from the wipe on)."""
    job = jobs.new(own_etcd.endpoint.target, ttl=3)
    job.common = [*job.common, "--max", "1"]
    job.start("a", script="elastic_steps.py")
    job.wait_for("a trains", steps_at_world(1))
    for spare in ("s0", "s1"):
        job.start(spare, script="elastic_steps.py")
        wait_until(f"{spare} a spare", lambda s=spare: "is a spare" in job.agents[s].output(), 90)
    rows = job.wait_for("40 steps", lambda rs: len(rs) >= 40)
    pids = {r["pid"] for r in rows}
    t0 = time.time()
    wipe(own_etcd)
    rows = job.wait_for(
        "30 more steps after the wipe",
        lambda rs: len([r for r in rs if float(r["t"]) > t0]) >= 30,  # type: ignore[arg-type]
        120,
    )
    assert {r["pid"] for r in rows} == pids, "the training worker was replaced"
    assert {r["node"] for r in rows} == {"a"}, "a spare took the trained state's place"
    stamps = sorted(float(r["t"]) for r in rows if float(r["t"]) > t0)  # type: ignore[arg-type]
    record.recovered(max(b - a for a, b in itertools.pairwise([t0, *stamps])))
    trained_apart(rows)
    check_consistent(rows)
