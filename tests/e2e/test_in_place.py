"""In-process elasticity with real efdl-run agents: no restarts, identical state, no lost step."""

from __future__ import annotations

import os
import signal
import socket
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.e2e.harness import (
    Job,
    alive,
    check_consistent,
    in_place_job,
    last_step_of,
    latest_gen,
    lines_changed_for_efdl,
    pids_of,
    rank0_rows,
    regrown,
    standalone,
    steps_at_world,
)
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).parents[2]


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "inplace")
    yield j
    j.stop()


def test_grow_shrink_and_crash_without_restarting_survivors(job: Job) -> None:
    """A newcomer, a graceful leave and a dead node, each rebuilt in place (the survivors are
    never restarted). The dead node leaves on the evidence, long before its lease expires:
    the survivor's collective fails when the dead node's connections close; its agent
    reports it, the leader finds the dead agent's probe port refusing and ends its lease: the
    job goes on within seconds, not the 60 s lease TTL."""
    job.common = [*job.common, "--lease-ttl", "60"]
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    a_pid, b_pid = pids_of(rows, "a"), pids_of(rows, "b")
    assert len(a_pid) == len(b_pid) == 1

    job.start("c", script="elastic_steps.py")  # scale up: a and b rebuild in place
    rows = job.wait_for("three workers", steps_at_world(3, g2))
    g3 = latest_gen(rows)
    assert pids_of(rows, "a") == a_pid and pids_of(rows, "b") == b_pid
    assert "in place" in job.agents["a"].output()

    job.agents["c"].signal(signal.SIGTERM)  # graceful leave: pause, commit, exit
    assert job.agents["c"].wait(60) == 0
    rows = job.wait_for("back to two", steps_at_world(2, g3))
    g4 = latest_gen(rows)
    assert pids_of(rows, "a") == a_pid and pids_of(rows, "b") == b_pid

    b_workers = job.agents["b"].worker_pids()
    job.agents["b"].signal(signal.SIGKILL)  # a whole node dies
    job.agents["b"].wait()
    rows = job.wait_for("a alone", steps_at_world(1, g4), timeout_s=45)
    assert pids_of(rows, "a") == a_pid
    assert "node b is gone: its agent at 127.0.0.1:" in job.agents["a"].output()
    assert not alive(b_workers)
    check_consistent(rows)


def test_a_crashed_worker_is_replaced_while_the_others_go_on_without_it(job: Job) -> None:
    job.env["FAIL_AT"] = "1:15"
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("the replacement training", regrown(2))
    ranks_of = {r["node"]: r["rank"] for r in rows if int(r["step"]) < 15}
    victim = next(n for n, rank in ranks_of.items() if rank == 1)
    survivor = next(n for n in ranks_of if n != victim)
    assert len(pids_of(rows, survivor)) == 1  # never restarted
    assert len(pids_of(rows, victim)) == 2  # replaced once
    alone = [r for r in rows if r["world"] == 1]
    assert alone and {r["node"] for r in alone} == {survivor}  # it trained on meanwhile
    assert (
        "lost workers being replaced" in job.agents[survivor].output() + job.agents[victim].output()
    )
    check_consistent(rows)


def test_each_sample_once_per_epoch_across_a_graceful_rescale(job: Job) -> None:
    # 150 steps at world size 2: 2 s a step until the third joins (300 s, however slowly it
    # starts on a busy machine), 0.1 s after.
    job.env.update(EPOCHS="1", SAMPLES="600", STEP_SECONDS="0.1", SLOW_BELOW_WORLD="3:2")
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    job.wait_for("two workers", steps_at_world(2))
    job.start("c", script="elastic_steps.py")
    job.wait_for("three workers", steps_at_world(3))
    for name in "abc":
        assert job.agents[name].wait(120) == 0, job.agents[name].output()[-2000:]
    rows = job.events()
    seen: dict[int, int] = defaultdict(int)
    for r in rows:
        for i in r["samples"]:  # type: ignore[attr-defined]
            seen[int(i)] += 1
    assert sorted(seen) == list(range(600))
    assert sum(seen.values()) - 600 <= 2  # at most world-1 repeats to fill the last batch
    assert {r["world"] for r in rows} == {2, 3}  # the epoch did span the rescale
    check_consistent(rows)


def test_a_crash_in_the_first_step_of_an_epoch_does_not_repeat_the_epoch(job: Job) -> None:
    """Rolled back to the last commit of the previous epoch, the job must go on with the new
    epoch, not train the finished one again (found in the convergence benchmark: a crash at
    an epoch boundary trained one epoch too many)."""
    job.env.update(EPOCHS="3", SAMPLES="96", BATCH="2", FAIL_AT="1:24", STEP_SECONDS="0.05")
    job.start("a", script="elastic_steps.py")  # 2 workers x batch 2: 24 steps per epoch
    job.start("b", script="elastic_steps.py")
    for name in "ab":
        assert job.agents[name].wait(120) == 0, job.agents[name].output()[-2000:]
    rows = job.events()
    assert any(r["rescales"] for r in rows), "no worker crashed"
    last = {(r["step"], r["rank"]): r for r in rows}  # the committed try of each step
    steps = sorted({int(step) for step, _ in last})  # type: ignore[call-overload]
    # Every step once; 72 at two workers, more while the survivor trained alone (its
    # per-worker batch stays 2) until the replacement joined.
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 72
    for epoch in range(3):
        seen = sorted(
            int(i)
            for r in last.values()
            if r["epoch"] == epoch
            for i in r["samples"]  # type: ignore[attr-defined]
        )
        assert seen == list(range(96)), f"epoch {epoch}"
    check_consistent(rows)


def test_the_efdl_example_differs_from_the_torchrun_one_by_at_most_12_lines() -> None:
    changed = lines_changed_for_efdl(ROOT / "examples" / "digits")
    assert 0 < changed <= 12, changed


def test_both_digits_examples_reach_the_same_accuracy(short_tmp: Path) -> None:
    """The change keeps what the script learns: the same model, data and seed reach the same
    test accuracy under efdl-run (the sample order differs: ElasticSampler splits the epoch
    as DistributedSampler does, with its own shuffle)."""
    final = {}
    for name in ("train_torchrun.py", "train_efdl.py"):
        done = standalone(
            ROOT / "examples" / "digits" / name,
            "--nproc-per-node",
            "2",
            script_args=["--epochs", "6"],
            env={"TMPDIR": str(short_tmp)},
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        rows = rank0_rows(done.stdout)
        assert [r["epoch"] for r in rows] == list(range(6)), done.stdout[-2000:]
        final[name] = float(rows[-1]["accuracy"])  # type: ignore[arg-type]
    assert min(final.values()) >= 0.9, final
    assert abs(final["train_torchrun.py"] - final["train_efdl.py"]) <= 0.03, final


def test_ranks_pause_together_when_the_news_reaches_them_at_different_times(job: Job) -> None:
    # Rank 1 of the first generation never sees the agent's news itself (600 s late): it
    # pauses only because rank 0 did, however long the newcomer takes to start.
    job.env["PAUSE_SKEW"] = "1:600"
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    pids = {r["pid"] for r in rows}
    job.start("c", script="elastic_steps.py")
    rows = job.wait_for("three workers", steps_at_world(3, g2))
    old = [r for r in rows if r["gen"] == g2]
    # Only rank 0 had news when they paused: rank 1 never saw it in this generation...
    assert any(r["news"] for r in old if r["rank"] == 0)
    assert not any(r["news"] for r in old if r["rank"] == 1)
    # ...yet both left the generation at the same step boundary, and went on in place.
    ends = last_step_of(rows, g2)
    assert ends[0] == ends[1], ends
    assert pids <= {r["pid"] for r in rows if int(r["gen"]) > g2}  # type: ignore[call-overload]
    check_consistent(rows)


def test_a_node_joins_while_a_rebuild_is_in_progress(job: Job) -> None:
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    g2 = latest_gen(rows)
    a_pid, b_pid = pids_of(rows, "a"), pids_of(rows, "b")
    job.start("c", script="elastic_steps.py")
    wait_until(  # c's round is out: rebuilding
        "c's round",
        lambda: "ranks 2-2 of 3" in job.agents["c"].output(),
        60,
        context=job.agents["c"].output,
    )
    job.start("d", script="elastic_steps.py")  # a second newcomer before the first one trains
    rows = job.wait_for("four workers", steps_at_world(4, g2), timeout_s=120)
    assert pids_of(rows, "a") == a_pid and pids_of(rows, "b") == b_pid
    assert {r["node"] for r in rows if r["world"] == 4} == set("abcd")
    check_consistent(rows)


def test_the_job_finishes_while_a_newcomer_is_still_starting(job: Job) -> None:
    # The survivors have declared themselves for the newcomer's generation and watch for the
    # go when their training ends: they must exit cleanly (no abort, no restart), and so must
    # every agent, the newcomer's included.
    # Before that, a node dies: the broken group of that generation is still held (buried)
    # when they exit.
    job.env.update(EPOCHS="1", SAMPLES="360")
    for name in "abd":
        job.start(name, script="elastic_steps.py")
    rows = job.wait_for("three workers", steps_at_world(3))
    for pid in [job.agents["d"].pid, *job.agents["d"].worker_pids()]:
        os.kill(pid, signal.SIGKILL)
    job.agents["d"].wait()
    job.wait_for("two workers", steps_at_world(2, latest_gen(rows)))
    # Only the newcomer is slow (the first workers may be of generation 2 too, if the first
    # round had fewer nodes).
    job.env["JOIN_DELAY"] = "60"
    job.start("c", script="elastic_steps.py")
    # c's round is out and its worker sleeps: then the job finishes under it
    wait_until("c's worker to start", lambda: "started workers" in job.agents["c"].output(), 60)
    for name in "abc":
        assert job.agents[name].wait(120) == 0, job.agents[name].output()[-3000:]
    logs = "".join(job.agents[n].output() for n in "abc")
    assert "SIGABRT" not in logs and "terminate called" not in logs and "restarting" not in logs
    steps = sorted(int(r["step"]) for r in job.events() if r["rank"] == 0)  # type: ignore[call-overload]
    assert steps == list(range(1, steps[-1] + 1))  # one pass, nothing trained twice


def newcomer_in_setup(job: Job) -> Path:
    """Wait until a newcomer started with SETUP_GATE is in its setup; its gate."""
    wait_until("the newcomer in its setup", lambda: any(job.out.glob("setup-*.sock")), 120)
    return next(job.out.glob("setup-*.sock"))


def end_setup(gate: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(gate))


def test_a_round_during_a_newcomers_setup_takes_it_to_the_newer_generation(job: Job) -> None:
    """A newcomer's setup can be long (it builds its model while the others train): a node
    that joins meanwhile makes a newer round, and the newcomer, at its training function's
    entry, goes to that one instead of declaring itself for the round it joined (which the
    others have left). Both newcomers train with the survivors, on one state."""
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    job.env["SETUP_GATE"] = "1"
    job.start("c", script="elastic_steps.py")
    gate = newcomer_in_setup(job)
    del job.env["SETUP_GATE"]
    job.start("d", script="elastic_steps.py")
    wait_until("the round with d", lambda: "d joined" in job.agents["c"].output(), 120)
    end_setup(gate)
    rows = job.wait_for("four workers", steps_at_world(4, latest_gen(rows)))
    check_consistent(rows)
    assert {r["node"] for r in rows if r["world"] == 4} == {"a", "b", "c", "d"}
    assert {r["world"] for r in rows} == {2, 4}  # c's round of three never trained
    (c_first,) = [r for r in rows if r["node"] == "c"][:1]
    assert int(c_first["rescales"]) == 1, c_first  # type: ignore[call-overload]


def test_a_replica_corrupted_mid_run_is_repaired_at_the_next_sync(job: Job) -> None:
    """Rank 1 changes one parameter element after step 3's update: DDP trains on with two
    replicas that differ (it averages gradients, never parameters). When a third node joins,
    the sync compares the holders' digests, takes rank 1 as torn and sends it rank 0's state:
    from that generation on every rank holds the same parameters at every step."""
    job.env["CORRUPT_AT"] = "1:3"
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")

    def diverged(rows: list[dict[str, object]]) -> bool:
        seen: dict[object, set[object]] = defaultdict(set)
        for r in rows:
            if r["world"] == 2 and int(r["step"]) > 4:  # type: ignore[call-overload]
                seen[(r["gen"], r["step"])].add(r["digest"])
        return any(len(d) == 2 for d in seen.values())

    rows = job.wait_for("the replicas to differ", diverged)
    g2 = latest_gen(rows)
    job.start("c", script="elastic_steps.py")
    rows = job.wait_for("three workers", steps_at_world(3, g2))
    g3 = min(int(r["gen"]) for r in rows if r["world"] == 3)  # type: ignore[call-overload]
    check_consistent([r for r in rows if int(r["gen"]) >= g3])  # type: ignore[call-overload]
    logs = job.agents["a"].output() + job.agents["b"].output()
    assert "differ: rank(s) [1] hold tensors unlike those of rank(s) [0]" in logs


def test_ddp_options_and_a_bf16_compression_hook_hold_across_a_join(job: Job) -> None:
    """elastic_state(ddp_kwargs=..., comm_hook=...): every DDP wrapper efdl builds, the one
    rebuilt when a node joins included, has the script's options and runs its hook (bf16
    gradient compression) in every step; the replicas stay identical."""
    job.env["COMM_HOOK"] = "bf16"
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    job.start("c", script="elastic_steps.py")
    rows = job.wait_for("three workers", steps_at_world(3, latest_gen(rows)))
    three = [r for r in rows if r["world"] == 3]
    assert {r["node"] for r in three} == {"a", "b", "c"}
    for r in rows:
        assert r["ddp"] == [1024 * 1024, True], r  # bucket_cap_mb=1, gradient_as_bucket_view
        assert int(r["hooked"]) >= 1, r  # type: ignore[call-overload]
    check_consistent(rows)


def test_survivors_train_on_while_a_newcomer_sets_up(job: Job) -> None:
    """A newcomer declares itself ready at its training function's entry, not when it joins
    the group: while it sets up (builds its model; here it waits for the test) the survivors
    go on training, and nobody stands still for it (no warning says so). Declared at its
    join, they would pause and wait in the sync: no step until its setup ends."""
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2))
    job.env["SETUP_GATE"] = "1"
    job.start("c", script="elastic_steps.py")
    gate = newcomer_in_setup(job)

    def steps() -> dict[str, int]:  # each survivor's newest step
        return {n: max(int(str(r["step"])) for r in job.events() if r["node"] == n) for n in "ab"}

    last = steps()

    def survivors_stepped() -> bool:
        return all(step >= last[n] + 3 for n, step in steps().items())

    wait_until("the survivors to step while the newcomer sets up", survivors_stepped, 120)
    assert {r["world"] for r in job.events()} == {2}
    end_setup(gate)
    rows = job.wait_for("three workers", steps_at_world(3, latest_gen(rows)))
    check_consistent(rows)
    for node in ("a", "b", "c"):
        assert "for this newcomer's setup" not in job.agents[node].output()
