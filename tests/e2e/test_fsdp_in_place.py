"""FSDP2 training under real efdl-run agents: a sharded model laid out anew in place on a
join and a graceful leave, no worker restarted, the whole model and optimizer state exactly
the committed one across every rescale (exact digests over the ranks' rows)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.worker.cache import SnapshotStorage
from tests.e2e.harness import (
    Job,
    check_consistent,
    in_place_job,
    latest_gen,
    lines_changed_for_efdl,
    pids_of,
    steps_at_world,
)

pytestmark = pytest.mark.timeout(300)
SCRIPT = "fsdp_steps.py"
ROOT = Path(__file__).parents[2]


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "fsdp")
    yield j
    j.stop()


def opt_chain(rows: list[dict[str, object]]) -> None:
    """Every rank of a step reports the same optimizer state, and every update starts from
    the optimizer state some rank held after the step before (a rescale or a resume neither
    loses nor changes any of it)."""
    seen: dict[tuple[object, object], set[object]] = {}
    after: dict[object, set[object]] = {}
    for r in rows:
        seen.setdefault((r["gen"], r["step"]), set()).add(r["opt"])
        after.setdefault(r["step"], set()).add(r["opt"])
    bad = sorted(str(k) for k, v in seen.items() if len(v) > 1)
    assert not bad, f"ranks disagree on the optimizer state at (generation, step) {bad[:5]}"
    for r in rows:
        step = int(r["step"])  # type: ignore[call-overload]
        if step > 1 and step - 1 in after:
            assert r["opt_before"] in after[step - 1], (
                f"step {step} (pid {r['pid']}, generation {r['gen']}) started from an "
                f"optimizer state no rank held after step {step - 1}"
            )


def test_a_sharded_model_grows_and_shrinks_in_place_then_a_dead_node_comes_back_from_peers(
    job: Job,
) -> None:
    """A join and a graceful leave lay the rows out anew, no worker restarted; with peer
    copies on all along (--peer-copies 1, no remote cache), a node then SIGKILLed comes back
    from its partner's memory: the survivor is not restarted and trains on from a step no
    older than the one before the kill (check_consistent: no worker goes back further)."""
    job.common += ["--peer-copies", "1"]
    job.start("a", script=SCRIPT)
    job.start("b", script=SCRIPT)
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    a_pid, b_pid = pids_of(rows, "a"), pids_of(rows, "b")

    job.start("c", script=SCRIPT)  # a join: the rows spread over three
    rows = job.wait_for("three workers", steps_at_world(3, g2))
    g3 = latest_gen(rows)
    assert pids_of(rows, "a") == a_pid and pids_of(rows, "b") == b_pid

    job.agents["b"].signal(signal.SIGTERM)  # a graceful leave: b's rows go to a and c first
    assert job.agents["b"].wait(60) == 0
    rows = job.wait_for("back to two", steps_at_world(2, g3))
    assert pids_of(rows, "a") == a_pid
    assert {r["world"] for r in rows} >= {2, 3}
    g2b = latest_gen(rows)
    c_workers = job.agents["c"].worker_pids()

    for pid in [*c_workers, job.agents["c"].pid]:  # node c dies, its agent and worker at once
        os.kill(pid, signal.SIGKILL)
    job.agents["c"].wait()
    rows = job.wait_for("one left", steps_at_world(1, g2b))
    assert pids_of(rows, "a") == a_pid
    assert "in the peer copies" in job.agents["a"].output()
    check_consistent(rows)
    opt_chain(rows)


def test_a_worker_and_a_node_killed_come_back_from_the_cache(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """A SIGKILL takes rows nobody else holds: every rank resumes the cache's newest
    snapshot, laid out for the world it now has (3 again after the worker is replaced, 2 after
    the node is gone); the survivors are never restarted."""
    job = in_place_job(tmp_path, etcd_server.endpoint.target, "fsdp-crash")
    job.common += ["--cache-url", str(tmp_path / "cache"), "--cache-every-steps", "1"]
    job.common += ["--cache-every", "0"]
    try:
        for name in "abc":
            job.start(name, script=SCRIPT)
        rows = job.wait_for("three workers", steps_at_world(3))
        g3 = latest_gen(rows)
        a_pid = pids_of(rows, "a")

        (worker,) = job.agents["c"].worker_pids()
        os.kill(worker, signal.SIGKILL)  # a worker dies; its agent starts another
        rows = job.wait_for("three again", steps_at_world(3, g3))
        g3b = latest_gen(rows)
        assert len(pids_of(rows, "c")) == 2 and pids_of(rows, "a") == a_pid

        job.agents["b"].signal(signal.SIGKILL)  # a whole node dies
        job.agents["b"].wait()
        rows = job.wait_for("two left", steps_at_world(2, g3b))
        assert pids_of(rows, "a") == a_pid
        assert job.agents["a"].output().count("resuming from step") >= 2
        check_consistent(rows)
        opt_chain(rows)
    finally:
        job.stop()


def test_a_preempted_job_resumes_from_the_cache_at_another_world_size(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Every node of a 2-worker job is told to leave (a preemption): the ranks persist the
    step they pause at, each its own rows. Three new nodes resume it from the cache: the
    first step at world size 3 is the next one, and it starts from exactly the parameters
    and optimizer state of the step persisted."""
    cache = tmp_path / "cache"
    job = in_place_job(tmp_path, etcd_server.endpoint.target, "fsdp-resume")
    job.common += ["--cache-url", str(cache), "--cache-every-steps", "100000"]
    job.common += ["--cache-every", "0"]
    try:
        job.start("a", script=SCRIPT)
        job.start("b", script=SCRIPT)
        job.wait_for("two workers", steps_at_world(2))
        for name in "ab":
            job.agents[name].signal(signal.SIGTERM)
        # Preempted, both: the last to leave exits 143 (unfinished, nobody carries it on).
        codes = sorted(job.agents[name].wait(60) for name in "ab")
        assert codes in ([0, 143], [143, 143]), codes
        last = max(int(r["step"]) for r in job.events())  # type: ignore[call-overload]
        found = SnapshotStorage(str(cache)).newest()
        assert found is not None and found[0].step == last and found[0].world_size == 2

        for name in "cde":
            job.start(name, script=SCRIPT)
        rows = job.wait_for("three workers", steps_at_world(3))
        resumed = [r for r in rows if r["world"] == 3]
        assert min(int(r["step"]) for r in resumed) == last + 1  # type: ignore[call-overload]
        check_consistent(rows)  # the first update starts from step `last`'s parameters
        opt_chain(rows)  # and from its optimizer state
    finally:
        job.stop()


def test_the_gpt_example_differs_from_its_torchrun_version_by_the_efdl_change() -> None:
    """The efdl change to an FSDP2 script: init, fully_shard, the sampler, the state, the
    decorated function (its model from the state), commit. The torchrun script's own
    skip-ahead on resume (4 lines) goes: the ElasticSampler resumes by itself."""

    changed = lines_changed_for_efdl(ROOT / "examples" / "gpt")
    assert 0 < changed <= 20, changed
