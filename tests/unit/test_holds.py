"""Holds (drain, quarantine): the record and its strict parsing, the decision with held
nodes, the health verdicts, the crash-loop count, and the agent's reactions to them; no
network (the store is the in-memory one, which passes the same contract tests as etcd)."""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import replace

import pytest

from efdl.config import LaunchConfig
from efdl.errors import ConfigError
from efdl.launcher import react
from efdl.launcher.health import (
    GpuReader,
    GpuReading,
    HealthMonitor,
    HealthSettings,
    Severity,
    judge_command,
    judge_disk,
    judge_gpus,
    local_cache_dir,
    run_command,
)
from efdl.launcher.react import AgentPhase, AgentView, Limits, WorkerMode
from efdl.launcher.restarts import RestartBudget, Verdict
from efdl.launcher.workers import WorkerExit
from efdl.rendezvous.decide import Decision, JobView, decide
from efdl.rendezvous.holds import Hold, HoldKind, hold, make_hold, read_holds, release
from efdl.rendezvous.memory_store import MemoryStore
from efdl.rendezvous.records import JobKeys, RecordError, Round, RoundStatus
from tests.unit.test_decide import T0, P, layout, node, settled, view
from tests.wait import wait_until

KEYS = JobKeys("job1")
KEY = KEYS.hold("n1")


# ---------------------------------------------------------------- the record


def test_a_hold_round_trips_and_ends_at_its_until() -> None:
    h = make_hold("n1", HoldKind.QUARANTINE, "GPU 3 has 2 uncorrectable ECC errors", 60, 100.0)
    assert Hold.from_json(h.to_json(), KEY) == h
    assert h.until == 160.0 and h.active(159.9) and not h.active(160.0)
    drain = make_hold("n1", HoldKind.DRAIN, "  kernel\nupdate ", None, 100.0)
    assert drain.reason == "kernel update" and drain.until is None and drain.active(1e10)
    assert "until released" in drain.describe(200.0)
    assert "1.0 min left" not in h.describe(100.0) and "1 min left" in h.describe(100.0)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"not json", r"The hold record at /efdl/job1/holds/n1 is not valid JSON"),
        (b"[]", r"must be a JSON object"),
        (
            b'{"node":"n1","kind":"cordon","reason":"x","since":1,"until":null}',
            r"has kind 'cordon'; expected one of drain, quarantine",
        ),
        (
            b'{"node":"n2","kind":"drain","reason":"x","since":1,"until":null}',
            r"names node 'n2', not the node of its key",
        ),
        (
            b'{"node":"n1","kind":"quarantine","reason":"x","since":1,"until":null}',
            r"is a quarantine with no 'until'",
        ),
        (
            b'{"node":"n1","kind":"drain","reason":"x","since":"soon","until":null}',
            r"field 'since' is 'soon'; expected int/float",
        ),
        (b'{"node":"n1","kind":"drain","since":1}', r"has no field 'reason'"),
        (
            b'{"node":"n1","kind":"quarantine","reason":"x","since":1,"until":-5}',
            r"field 'until' is -5.0, outside 0.0",
        ),
    ],
)
def test_a_bad_hold_record_names_its_key_and_field(raw: bytes, expected: str) -> None:
    with pytest.raises(RecordError, match=expected):
        Hold.from_json(raw, KEY)


def test_bad_holds_are_refused_before_they_are_written() -> None:
    with pytest.raises(ConfigError, match=r"quarantine of node n1 needs a positive time to live"):
        make_hold("n1", HoldKind.QUARANTINE, "x", None, 0.0)
    with pytest.raises(ConfigError, match=r"drain of node n1 lasts until released"):
        make_hold("n1", HoldKind.DRAIN, "x", 60, 0.0)
    with pytest.raises(ConfigError, match=r"node id 'a/b' is not allowed"):
        make_hold("a/b", HoldKind.DRAIN, "x", None, 0.0)
    long = make_hold("n1", HoldKind.DRAIN, "y" * 5000, None, 0.0)
    assert len(long.reason) == 900 and long.reason.endswith("...")


def test_read_holds_skips_ended_and_bad_records(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    hold(store, KEYS, "n1", HoldKind.QUARANTINE, "crash loop", 10, wall=100.0)
    hold(store, KEYS, "n2", HoldKind.DRAIN, "maintenance", None, wall=100.0)
    store.put(KEYS.hold("n3"), b'{"node":"n3","kind":"nope"}')
    with caplog.at_level(logging.ERROR):
        assert set(read_holds(store, KEYS, now=105.0)) == {"n1", "n2", "n3"} - {"n3"}
    assert "ignoring a bad hold record" in caplog.text and "holds/n3" in caplog.text
    assert set(read_holds(store, KEYS, now=111.0)) == {"n2"}  # the quarantine ended
    assert release(store, KEYS, "n2") and not release(store, KEYS, "n2")
    assert read_holds(store, KEYS, now=111.0) == {}


# ---------------------------------------------------------------- the decision


def test_a_held_member_leaves_at_once_and_a_held_node_is_never_placed_nor_a_spare() -> None:
    first = settled(view(node("a"), node("b"), node("c")), P)
    assert [m[0] for m in layout(first)] == ["a", "b", "c"]
    held = replace(view(node("a"), node("b"), node("c"), round=first), held={"b": "drain: fw"})
    d = decide_now(held)
    assert d.round is not None, d.reason  # urgent: no settle window
    assert [m[0] for m in layout(d)] == ["a", "c"]
    assert d.round.spares == 0 and "b held out (drain: fw)" in d.reason
    # Held, it stays out round after round (its record stands: its agent waits).
    again = replace(view(node("a"), node("b"), node("c"), round=d), held={"b": "drain: fw"})
    assert decide_now(again).round is None
    # Released, it is a newcomer: placed after the settle window.
    back = view(node("a"), node("b"), node("c"), round=d)
    assert [m[0] for m in layout(settled(back, P))] == ["a", "c", "b"]


def test_holds_below_min_make_a_waiting_round_that_counts_no_held_spare() -> None:
    first = settled(view(node("a"), node("b")), P)
    held = replace(view(node("a"), node("b"), round=first), held={"a": "quarantine: ecc"})
    d = decide_now(held)
    assert d.round is not None and d.round.status is RoundStatus.WAITING
    assert d.round.spares == 1 and "a held out" in d.reason


def decide_now(v: JobView) -> Decision:
    return decide(v, P, T0)


# ---------------------------------------------------------------- health verdicts


def test_hard_gpu_faults_quarantine_and_throttling_only_warns() -> None:
    found = judge_gpus(
        [
            GpuReading(0, "GPU-a", ecc_uncorrected=0, throttle=0x4),  # power cap: normal
            GpuReading(1, "GPU-b", ecc_uncorrected=2),
            GpuReading(2, "GPU-c", retired_pending=True, remap_pending=True, remap_failed=True),
            GpuReading(-1, "GPU-d", lost=True, ecc_uncorrected=9),
            GpuReading(4, "GPU-e", xids=(79, 13), throttle=0x40 | 0x8),
        ]
    )
    by = [(f.check, f.severity, f.reason) for f in found]
    assert (
        "ecc",
        Severity.FAULT,
        "GPU 1 (GPU-b) has 2 uncorrectable ECC error(s) since the driver loaded",
    ) in by
    assert [c for c, s, _ in by if s is Severity.FAULT] == [
        "ecc",
        "retired-pages",
        "remapped-rows",
        "remapped-rows",
        "gpu-lost",  # and nothing else of a lost GPU
        "xid",
    ]
    warnings = [r for _, s, r in by if s is Severity.WARNING]
    assert warnings == [
        "GPU 4 (GPU-e) reported Xid 13 (usually the program's own error)",
        "GPU 4 (GPU-e) is throttled: hardware slowdown, hardware thermal slowdown (reasons 0x48)",
    ]


def test_disk_and_command_verdicts_name_the_path_the_value_and_the_output() -> None:
    assert judge_disk(local_cache_dir("/c") or local_cache_dir(""), 10, 5) is None  # type: ignore[arg-type]
    f = judge_disk(local_cache_dir("file:///data/cache"), 100_000_000, 3_000_000_000)  # type: ignore[arg-type]
    assert f is not None and f.reason == (
        "the cache directory /data/cache has 100 MB free; at least 3000 MB are needed "
        "(--health-min-free, and twice the last snapshot)"
    )
    assert local_cache_dir("s3://bucket/x") is None
    assert judge_command("true", 0, "", 5) is None
    f = judge_command("check.sh", 2, "line1\nNIC eth0 down\n", 5)
    assert f is not None and f.reason == "the health check 'check.sh' exited 2: line1 NIC eth0 down"
    f = judge_command("check.sh", None, "x" * 1000, 5)
    assert f is not None and "ran past its timeout (5 s): ..." in f.reason and len(f.reason) < 400


def test_a_health_command_that_hangs_is_killed_at_its_timeout() -> None:
    code, out = run_command("echo started; sleep 30", 0.5)
    assert code is None and "started" in out
    assert run_command("echo bad >&2; exit 3", 5) == (3, "bad\n")


def test_the_gpu_reader_through_the_nvml_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fakes import pynvml

    gpus = [
        {"uuid": "GPU-0", "ecc_uncorrected": 0},
        {"uuid": "GPU-1", "ecc_uncorrected": 3, "remap_pending": True, "xid": [48]},
        {"uuid": "GPU-2", "lost": True},
    ]
    monkeypatch.setenv("EFDL_FAKE_NVML", json.dumps(gpus))
    monkeypatch.delenv("EFDL_FAKE_NVML_FILE", raising=False)
    offered = [(0, "GPU-0"), (1, "GPU-1"), (2, "GPU-2"), (9, "GPU-9")]
    offered += [(1, "MIG-1a"), (1, "MIG-1b")]  # read as their parent, GPU-1, once
    reader = GpuReader(offered, nvml=pynvml)
    try:
        readings = reader.read()
        assert [
            (g.index, g.lost, g.ecc_uncorrected, g.remap_pending, g.xids) for g in readings
        ] == [
            (0, False, 0, False, ()),
            (1, False, 3, True, (48,)),
            (2, True, None, None, ()),
            (9, True, None, None, ()),  # gone from the bus: NVML no longer finds it
        ]
        assert reader.read()[1].xids == ()  # an Xid is read once
    finally:
        reader.close()


def test_without_nvml_the_gpu_checks_are_skipped_and_say_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.fakes import pynvml

    monkeypatch.delenv("EFDL_FAKE_NVML", raising=False)
    monkeypatch.delenv("EFDL_FAKE_NVML_FILE", raising=False)
    settings = HealthSettings(0, None, 5, None, 0)
    with caplog.at_level(logging.INFO):
        monitor = HealthMonitor(settings, [(0, "GPU-0")], lambda: 0, lambda: "job j node n", pynvml)
    assert "GPU health checks are skipped: NVML is not available" in caplog.text
    assert monitor.check() == []
    monitor.close()


# ---------------------------------------------------------------- crash loops


def test_the_same_error_quarantine_after_times_within_the_window_quarantines() -> None:
    budget = RestartBudget(10, quarantine_after=3, window_s=100.0)
    verdicts = []
    for i, (code, error, at) in enumerate(
        [
            (1, "RuntimeError: CUDA error: ECC\n  stack a", 0.0),
            (1, "OSError: other", 10.0),  # another error: not counted with it
            (1, "RuntimeError: CUDA error: ECC\n  stack b", 20.0),  # same line, other stack
            (-9, "", 30.0),
            (1, "RuntimeError: CUDA error: ECC", 40.0),
        ]
    ):
        judged = budget.judge(code, error, step=100 * i, now=at)  # steps trained between
        budget = judged.budget
        verdicts.append(judged.verdict)
    assert verdicts[:4] == [Verdict.RESTART] * 4 and verdicts[4] is Verdict.QUARANTINE
    assert budget.failures == ()  # the hold consumes them


def test_failures_outside_the_window_do_not_count_and_zero_never_quarantines() -> None:
    budget = RestartBudget(10, quarantine_after=2, window_s=60.0)
    first = budget.judge(1, "E: x", 1, now=0.0)
    assert first.budget.judge(1, "E: x", 2, now=61.0).verdict is Verdict.RESTART
    assert first.budget.judge(1, "E: x", 2, now=59.0).verdict is Verdict.QUARANTINE
    never = RestartBudget(10)
    for at in range(5):
        never = never.judge(-11, "", at, now=float(at)).budget
    assert never.used == 5


def test_failures_a_dead_peer_causes_are_not_counted() -> None:
    budget = RestartBudget(10, quarantine_after=2)
    for i, (code, line) in enumerate(
        [
            (1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242"),
            (1, "torch.distributed.DistBackendError: NCCL error in: ... remote process exited"),
            (-15, ""),  # SIGTERM: stopped from outside
            (1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242"),
        ]
    ):
        judged = budget.judge(code, line, i, now=float(i))
        budget = judged.budget
        assert judged.verdict is Verdict.RESTART and judged.repeats == 0
    assert budget.failures == ()


def _view(**changes: object) -> AgentView:
    base = AgentView(
        Limits(slots=1, max_workers=8, grace_period_s=30.0, join_timeout_s=600.0),
        AgentPhase.FOLLOWING,
        generation=3,
        workers=WorkerMode.PLAIN,
        placed=True,
        restarts=RestartBudget(5, quarantine_after=1),
        trained=10,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_a_crash_loop_holds_the_node_out_instead_of_restarting() -> None:
    e = WorkerExit(3, local_rank=0, rank=2, pid=9, code=-6)
    reaction = react.judge_failure(_view(now=5.0), react.JudgeFailure(e, "", False))
    kinds = [type(a) for a in reaction.actions]
    assert kinds == [react.CountRestart, react.Say, react.HoldOut]
    hold_out = reaction.actions[-1]
    assert isinstance(hold_out, react.HoldOut) and hold_out.kind is HoldKind.QUARANTINE
    assert hold_out.reason == "crash loop: workers failed 1 times within 1800 s with signal SIGABRT"
    assert reaction.phase is AgentPhase.FOLLOWING  # no restart is asked for


def test_a_held_node_left_out_of_a_round_says_what_it_waits_for() -> None:
    r = Round(5, RoundStatus.ACTIVE, world_size=2, nodes=2, reason="b held out")
    said = react.hand_over(_view(held="drain: maintenance (since ...)"), r).actions[-1]
    assert isinstance(said, react.Say)
    assert "held out of the job (drain: maintenance (since ...)); it waits" in said.message
    assert "efdl release" in said.message


def test_a_crash_loop_hold_etcd_refuses_falls_back_to_the_restart() -> None:
    e = WorkerExit(3, local_rank=0, rank=2, pid=9, code=1)
    plain = react.judge_failure(_view(), react.JudgeFailure(e, "E: x", False)).actions[-1]
    assert isinstance(plain, react.HoldOut)
    assert [type(a) for a in plain.otherwise] == [react.ReportFailure, react.HoldRestart]
    placed = react.judge_failure(_view(), react.JudgeFailure(e, "E: x", True)).actions[-1]
    assert isinstance(placed, react.HoldOut)
    assert placed.otherwise == (react.StartReplacement(0),)


def test_a_held_nodes_in_place_workers_leave_when_the_job_waits() -> None:
    r = Round(5, RoundStatus.WAITING, reason="1 of the 2 workers needed are here")
    held = _view(workers=WorkerMode.IN_PLACE, held="drain: fw")
    assert react.TellLeave in [type(a) for a in react.on_round(held, r).actions]
    kept = react.on_round(_view(workers=WorkerMode.IN_PLACE), r)
    assert react.TellWaiting in [type(a) for a in kept.actions]


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"quarantine_ttl_s": 0.0}, r"--quarantine-ttl \(0 s\) must be positive"),
        ({"quarantine_after": -1}, r"--quarantine-after \(-1\) must not be negative \(failures"),
        ({"quarantine_window_s": -3.0}, r"--quarantine-window \(-3 s\) must be positive"),
        ({"health_interval_s": -1.0}, r"--health-interval \(-1 s\) must not be negative"),
        ({"health_check": "  "}, r"--health-check is empty; expected a command to run"),
        ({"health_check_timeout_s": 0.0}, r"--health-check-timeout \(0 s\) must be positive"),
        ({"health_min_free_mb": -5}, r"--health-min-free \(-5 MB\) must not be negative"),
    ],
)
def test_bad_hold_and_health_flags_name_the_value(flags: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        LaunchConfig(**flags)  # type: ignore[arg-type]


def test_the_drain_signal_is_not_a_leave_signal_by_default() -> None:
    from efdl.launcher.agent import DRAIN_SIGNAL

    assert DRAIN_SIGNAL is signal.SIGUSR2
    assert DRAIN_SIGNAL not in LaunchConfig().signals()


# ---------------------------------------------------------------- the agent's part


def test_the_agents_holding_renews_a_quarantine_quietly_and_keeps_a_drain() -> None:
    from efdl.launcher.holding import Holding
    from efdl.rendezvous.records import EventKind, NodeRecord

    store = MemoryStore()
    recorded: list[tuple[EventKind, str]] = []
    posted: list[object] = []
    holding = Holding(
        LaunchConfig(quarantine_ttl_s=60.0, health_interval_s=0.0),
        store,
        "job1",
        NodeRecord("n1", "127.0.0.1", 0, 1),
        posted.append,
        lambda kind, text: recorded.append((kind, text)),
        lambda: "job job1 node n1 gen 0",
    )
    try:
        holding.start()
        assert holding.active() is None and holding.due() is None
        first = holding.hold_out(HoldKind.QUARANTINE, "health check failed: disk")
        again = holding.hold_out(HoldKind.QUARANTINE, "health  check failed: disk")
        assert first is not None and again is not None
        assert first.until is not None and again.until is not None and again.until >= first.until
        assert again.since == first.since  # renewed: since when it has been bad
        assert recorded == [(EventKind.HOLD, "quarantine: health check failed: disk")]
        assert holding.due() is not None  # the re-check before it ends, and its end
        assert read_holds(store, KEYS)["n1"].kind is HoldKind.QUARANTINE
        hold(store, KEYS, "n1", HoldKind.DRAIN, "kernel update", None)
        wait_until("the watch to bring the drain", lambda: holding.text().startswith("drain"), 5)
        kept = holding.hold_out(HoldKind.QUARANTINE, "health check failed: disk")
        assert kept is not None and kept.kind is HoldKind.DRAIN
        assert recorded[-1] == (EventKind.HEALTH, "while drained: health check failed: disk")
        release(store, KEYS, "n1")
        wait_until("the watch to bring the release", lambda: holding.text() == "", 5)
    finally:
        holding.close()


def test_the_node_s_collective_runs_one_rank_per_gpu_by_uuid_else_gloo_per_slot() -> None:
    from efdl.launcher.collective import command
    from efdl.launcher.holding import collective_of
    from efdl.rendezvous.records import GpuInfo

    gpus = (GpuInfo(0, uuid="GPU-aa"), GpuInfo(1, uuid="GPU-bb"), GpuInfo(2))
    assert collective_of(False, 3, gpus, simulated=False) is None  # not asked for
    assert collective_of(True, 3, gpus, simulated=False) == (3, ("GPU-aa", "GPU-bb", "2"))
    assert collective_of(True, 4, (), simulated=False) == (4, ())  # a CPU node: gloo
    assert collective_of(True, 2, gpus, simulated=True) == (2, ())  # simulated GPUs
    line = command(3, ("GPU-aa", "GPU-bb", "2"), 60)
    assert "--ranks 3 --devices GPU-aa,GPU-bb,2 --timeout 60" in line
    assert "--devices - " in command(4, (), 60)
