"""The hang watch's judgement, with a manual clock, a dict for the generation's store and the
collective counts given: who is the rank the others wait on."""

from __future__ import annotations

from typing import Any

from efdl.state.hang import MARK_KEY, HangWatch, default_timeout


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """What a c10d store client does for the watch: counters, and whether keys exist."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.keys[key] = self.keys.get(key, 0) + n
        return self.keys[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


def rank(store: Store, clock: Clock, count: list[int], reports: list[dict[str, Any]]) -> HangWatch:
    """One rank's watch on the shared ``store``; ``count[0]``: its collectives entered."""
    w = HangWatch(reports.append, 30.0, timeout_s=5.0, clock=clock, count=lambda _: count[0])
    w._connect = lambda: store  # joined a generation (without the thread: _look by hand)
    return w


def test_the_rank_behind_a_waiting_peer_is_hung_the_waiting_one_is_not() -> None:
    clock, store = Clock(), Store()
    hung_says: list[dict[str, Any]] = []
    peer_says: list[dict[str, Any]] = []
    hung = rank(store, clock, [8], hung_says)  # stuck in user code after 8 collectives
    peer = rank(store, clock, [9], peer_says)  # inside the 9th, waiting for the other
    for w in (hung, peer):
        w.committed(20)
    clock.now += 3  # standing still: each marks where it stands
    for w in (hung, peer):
        w._look()
    assert MARK_KEY.format(8) in store.keys and MARK_KEY.format(9) in store.keys
    assert not hung_says and not peer_says  # not for the hang timeout yet
    clock.now += 3
    for w in (hung, peer):
        w._look()
        w._look()
    assert [r["type"] for r in hung_says] == ["hung"] and hung_says[0]["step"] == 20
    assert not peer_says


def test_ranks_standing_still_together_judge_nobody() -> None:
    """Every rank in the same long step (an evaluation on all of them): the same count."""
    clock, store = Clock(), Store()
    said: list[dict[str, Any]] = []
    watches = [rank(store, clock, [12], said) for _ in range(4)]
    for w in watches:
        w.committed(7)
    clock.now += 60
    for w in watches:
        w._look()
    assert not said


def test_nothing_is_judged_during_the_sync_or_outside_a_generation() -> None:
    clock, store = Clock(), Store()
    said: list[dict[str, Any]] = []
    store.add(MARK_KEY.format(4), 1)  # a peer waits in a collective this rank has not entered
    w = rank(store, clock, [3], said)
    clock.now += 60  # the state sync (a transfer the peer waits for): not training yet
    w._look()
    w.trains()
    w.committed(1)
    w.left()  # a rescale: out of the generation
    clock.now += 60
    w._look()
    w.trains()  # (a call out of a generation starts no clock)
    clock.now += 60
    w._look()
    assert not said and not store.keys.get(MARK_KEY.format(3))


def test_a_rank_stuck_at_its_first_batch_of_a_generation_is_hung() -> None:
    """Synced and training, but stuck before its first commit in the generation (a
    DataLoader that waits on a read at its iteration's start) while the peer waits in the
    first step's collective: it holds the job as much as after a commit."""
    clock, store = Clock(), Store()
    said: list[dict[str, Any]] = []
    stuck = rank(store, clock, [8], said)
    stuck.committed(20)  # the generation before
    stuck.left()
    stuck._connect = lambda: store  # a new generation
    store.add(MARK_KEY.format(9), 1)  # the peer, in the first step's all-reduce
    stuck.trains()
    clock.now += 3
    stuck._look()
    assert not said  # not for the hang timeout yet
    clock.now += 3
    stuck._look()
    assert [(r["type"], r["step"]) for r in said] == [("hung", 20)]


def test_the_default_timeout_is_most_of_the_collective_timeout_and_five_long_steps() -> None:
    assert default_timeout(30.0, 0.1) == 27.0
    assert default_timeout(30.0, 8.0) == 40.0
    clock = Clock()
    w = HangWatch(lambda _: None, 30.0, clock=clock)
    for _ in range(3):
        w.committed(1)
        clock.now += 7.0  # steps of 7 s
    w.committed(4)
    assert w.timeout_s() == 35.0
