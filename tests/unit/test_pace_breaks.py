"""Breaks of issue 57: straggler eviction (efdl.worker.pace, efdl.launcher.stragglers)."""

from __future__ import annotations

from efdl.launcher.stragglers import PaceJudge
from efdl.protocol.messages import Paced
from efdl.worker.pace import Pace


def test_two_slow_nodes_do_not_both_evict_themselves_below_min() -> None:
    # Four one-worker nodes, --min 3, no spare, --evict-stragglers. Two nodes are slow
    # alike (a bad rack: 3 s of their own per step against 1 s). Every node sees the same
    # agreed slots; each slow node's agent judges alone that the others hold 3 workers,
    # not below --min 3, so both leave: the job is left with 2 workers, below its min.
    window = 5
    pace = Pace(window)
    for _ in range(window):
        pace.add([3_000_000, 3_000_000, 1_000_000, 1_000_000])
    min_workers, world = 3, 4
    evicted = []
    for node in range(4):
        p = pace.of_node(node)
        assert p is not None
        slow = PaceJudge(1.5, evict=True).judge(
            Paced(7, p.node_s, p.others_s, p.steps, p.slower), 1, world - 1, 0, min_workers
        )
        if slow is not None and slow.evict:
            evicted.append(node)
    assert world - len(evicted) >= min_workers, f"nodes {evicted} all left: below --min"


def test_a_spare_too_small_to_keep_min_does_not_license_an_eviction() -> None:
    # Two nodes of 2 workers, --min 4, and a spare of 1 slot waiting: evicting the slow
    # node leaves 2 + 1 = 3 workers, below --min 4; the judge counts the spare, not its slots.
    slow = PaceJudge(1.5, evict=True).judge(Paced(3, 0.6, 0.2, 20), 2, 2, 1, 4)
    assert slow is not None
    assert not slow.evict, slow.text
