"""A fleet of real ``efdl node`` daemons (stand-in NVML: tests/fakes/pynvml.py, its GPUs read
from a file the test changes) running real efdl-run agents and gloo workers, with a real
etcd: a job grows onto free GPUs, shrinks in place for a higher-priority job, gives a GPU
back to a foreign process and grows back when it ends, is suspended to its cache for a
higher-priority job and resumes from it, and trains on through its host daemon's SIGKILL and
restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.fleet.records import Phase
from efdl.fleet.registry import cancel, read_events
from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.e2e.fleet_harness import Fleet, newest, step_rows
from tests.e2e.harness import read_rows
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(420)


@pytest.fixture()
def fleet(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(etcd_server, tmp_path)
    try:
        yield f
    finally:
        f.close()


def trains_at(out: Path, world: int) -> bool:
    n = newest(out)
    return n["world"] == world and len(n["pids"]) == world  # type: ignore[arg-type]


def test_a_job_fills_free_gpus_then_shrinks_in_place_for_priority_and_for_a_foreign_process(
    fleet: Fleet,
) -> None:
    fleet.host("gpu-a.us-central1-a.c.proj.internal")
    fleet.host("gpu-b.us-central1-a.c.proj.internal")
    low = fleet.submit("low", 1, 4, 0)
    fleet.wait("job low on all 4 GPUs", lambda: trains_at(low, 4), 240)
    before = newest(low)
    high = fleet.submit("high", 2, 2, 5)
    fleet.wait("job high to train", lambda: trains_at(high, 2), 240)
    fleet.wait("job low on 2 GPUs", lambda: trains_at(low, 2), 240)
    after = newest(low)
    assert after["pids"] <= before["pids"]  # type: ignore[operator]  # survivors, in place
    assert (
        f"shrunk by 2 GPUs for {fleet.job_ids['high']} (priority 5)" in fleet.status("low").reason
    )
    # inference takes one of low's GPUs: low goes on, in place, on the other
    host, indices = fleet.status("low").gpus[0]
    fleet.foreign(host, indices[0])
    fleet.wait("job low on 1 GPU", lambda: trains_at(low, 1), 240)
    one = newest(low)
    assert one["pids"] <= after["pids"]  # type: ignore[operator]
    assert "taken by a process that is not efdl's" in fleet.status("low").reason
    assert fleet.status("high").phase is Phase.RUNNING
    # inference ends: low grows back onto the freed GPU, in place
    fleet.foreign(host, indices[0], pid=None)
    fleet.wait("job low on 2 GPUs again", lambda: trains_at(low, 2), 240)
    assert one["pids"] <= newest(low)["pids"]  # type: ignore[operator]
    assert "grew by 1 GPU" in fleet.status("low").reason


def test_a_drained_host_s_agents_leave_in_place_and_it_is_used_again_once_released(
    fleet: Fleet,
) -> None:
    """efdl drain --fleet HOST: the job on it goes on in place on its other host (the same
    workers there, none lost), the drained host's agents leave; efdl release --fleet lets the
    job grow back onto it."""
    a, b = "gpu-e.us-central1-a.c.proj.internal", "gpu-f.us-central1-a.c.proj.internal"
    fleet.host(a)
    fleet.host(b)
    job = fleet.submit("wide", 1, 4, 0)
    fleet.wait("job wide on all 4 GPUs", lambda: trains_at(job, 4), 240)
    before = newest(job)
    env = {**os.environ, "EFDL_ETCD": str(fleet.server.endpoint)}
    drain = [sys.executable, "-m", "efdl", "drain", "--fleet", fleet.keys.fleet, b]
    out = subprocess.run([*drain, "--reason", "kernel upgrade"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and f"host {b} is drained" in out.stdout, out
    fleet.wait("job wide on 2 GPUs", lambda: trains_at(job, 2), 240)
    assert newest(job)["pids"] <= before["pids"]  # type: ignore[operator]  # in place
    assert f"host {b} is held out (drain: kernel upgrade" in fleet.status("wide").reason
    assert dict(fleet.status("wide").gpus).keys() == {a}
    fleet.wait("host b's agents gone", lambda: not fleet.agents(b), 120)
    release = [sys.executable, "-m", "efdl", "release", "--fleet", fleet.keys.fleet, b]
    out = subprocess.run(release, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"host {b} is released" in out.stdout, out
    fleet.wait("job wide on 4 GPUs again", lambda: trains_at(job, 4), 240)


def test_a_job_suspended_for_a_higher_priority_one_resumes_from_its_cache(
    fleet: Fleet,
) -> None:
    """low cannot shrink below its min for high: it persists, stops, and resumes from its
    cache when high ends, at the step it had committed, on all the GPUs again."""
    fleet.host("gpu-d.us-central1-a.c.proj.internal")
    low = fleet.submit("low", 2, 2, 0, cache=True)
    fleet.wait("job low on 2 GPUs", lambda: trains_at(low, 2), 240)
    fleet.wait("a few steps of low", lambda: len(read_rows(low)) > 10, 120)
    high = fleet.submit("high", 2, 2, 5)
    fleet.wait("job low suspended", lambda: fleet.status("low").phase is Phase.SUSPENDED, 120)
    why = [e.status.reason for e in read_events(fleet.store, fleet.keys)[0]]  # (its status
    # moves on to why it waits; the history keeps why it was suspended)
    assert any(f"suspended to make room for {fleet.job_ids['high']}" in w for w in why), why
    fleet.wait("job high to train", lambda: trains_at(high, 2), 240)
    fleet.wait("low's agents gone", lambda: not any(
        a["job_id"] == fleet.job_ids["low"] for a in fleet.agents()), 120)  # fmt: skip
    before = step_rows(low)
    top = max(int(r["step"]) for r in before)
    cancel(fleet.store, fleet.keys, fleet.job_ids["high"])
    fleet.wait("job low resumed", lambda: fleet.status("low").phase is Phase.RUNNING, 240)
    assert "resumed" in fleet.status("low").reason
    fleet.wait(
        "job low training again on 2 GPUs",
        lambda: len(step_rows(low)) > len(before) and trains_at(low, 2),
        240,
    )
    resumed = step_rows(low)[len(before) :]
    first = min(int(r["step"]) for r in resumed)
    # step N logged means N - 1 was committed; all of low's ranks persisted on leaving
    assert top <= first <= top + 1, (top, first)  # no committed step lost, none skipped
    assert not {r["pid"] for r in resumed} & {r["pid"] for r in before}  # new workers


def test_a_host_daemon_killed_and_restarted_does_not_stop_training(fleet: Fleet) -> None:
    """Even when it comes back after its lease expired (under load, a restart can take
    longer than the TTL): it registers its host before it allocates, and adopts its agents."""
    name = "gpu-c.us-central1-a.c.proj.internal"
    fleet.host(name)
    job = fleet.submit("steady", 2, 2, 0)
    fleet.wait("job steady to train", lambda: trains_at(job, 2), 240)
    gen = newest(job)["gen"]
    fleet.daemons[name].send_signal(signal.SIGKILL)
    fleet.daemons[name].wait(timeout=30)
    steps = len(read_rows(job))
    wait_until("steps while the daemon is away", lambda: len(read_rows(job)) > steps + 5, 120)
    # Away longer than its lease: its host record is gone when it comes back.
    fleet.wait("the host record to expire", lambda: fleet.store.get(fleet.keys.host(name)) is None)
    fleet.start(name)
    fleet.wait(
        "the new daemon to adopt the agent",
        lambda: "adopted agent" in (fleet.tmp / f"node-{name}.log").read_text(),
        120,
    )
    steps = len(read_rows(job))
    wait_until("steps after the restart", lambda: len(read_rows(job)) > steps + 10, 120)
    assert newest(job)["gen"] == gen  # no rescale, no restart: the same generation trains
    assert fleet.status("steady").phase is Phase.RUNNING


def test_the_fleet_tried_without_gpus_on_simulated_ones(fleet: Fleet) -> None:
    """docs/fleet.md's way to try the fleet on a host without GPUs: EFDL_SIMULATED_GPUS=2 on
    its daemon (nothing else): the job is placed on both, its agent starts one worker per
    simulated GPU, and they train on the CPU."""
    fleet.simulated_host("laptop-1.local", 2)
    out = fleet.submit("tried", 1, 2, 0)
    fleet.wait("job tried on both simulated GPUs", lambda: trains_at(out, 2), 240)
    host, indices = fleet.status("tried").gpus[0]
    assert host == "laptop-1.local" and indices == (0, 1)
