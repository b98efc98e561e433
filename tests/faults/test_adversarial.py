"""Faults a Jepsen-minded tester injects (issue 54): a generation cut off from etcd whole, an
etcd that forgets under a running job, and hangs that a worker's own threads cannot see.

Real efdl-run agents on 127.0.0.1, a real etcd, gloo on CPU, the efdl-aware test script
(commit every step). The docstrings are rows of docs/reliability.md.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.model import JobKeys, Progress
from efdl.state.cache import SnapshotStorage
from tests.e2e.harness import Job, check_consistent, last_step_of, latest_gen, steps_at_world
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
        wait_until("the progress record again", lambda: store.get(keys.progress) is not None, 60)
        kv = store.get(keys.progress)
        assert kv is not None and Progress.from_json(kv.value, keys.progress).step >= committed
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
