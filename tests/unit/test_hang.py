"""Hangs judged from outside the worker (efdl.worker.hang, efdl.launcher.hangs): each worker's
beat and marks, with a manual clock, a dict for the generation's store and the collective
counts given; the agent's judge reading real beat files: who is the rank the others wait on,
also when its own threads cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from efdl.launcher.hangs import HangJudge
from efdl.worker.hang import (
    MARK_KEY,
    Beat,
    Hang,
    HangWatch,
    default_timeout,
    judge,
    raise_top,
    read_top,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """What a c10d store client does for the watch and the judge: counters, key checks."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.values: dict[str, bytes] = {}

    def add(self, key: str, n: int) -> int:
        self.keys[key] = self.keys.get(key, 0) + n
        return self.keys[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys or k in self.values for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.values.get(key, b"").decode()
        if current == expected:
            self.values[key] = desired.encode()
        return self.values.get(key, b"")

    def get(self, key: str) -> bytes:
        return self.values[key]

    def marked(self, group: str, n: int) -> int:
        return self.add(MARK_KEY.format(group, n), 0)

    def top(self, group: str) -> int | None:
        return read_top(self, group)


def rank(
    store: Store, clock: Clock, counts: dict[str, int], beat_dir: Path | None = None
) -> HangWatch:
    """One rank's watch on the shared ``store``; ``counts``: its collectives entered."""
    w = HangWatch(beat_dir, 30.0, timeout_s=5.0, clock=clock, count=lambda _: dict(counts))
    w._connect = lambda: store  # joined a generation (without the thread: by hand)
    return w


def look(*watches: HangWatch) -> None:
    for w in watches:
        w._mark()


def test_the_rank_behind_a_waiting_peer_is_hung_the_waiting_one_is_not() -> None:
    clock, store = Clock(), Store()
    hung = rank(store, clock, {"0": 8})  # stuck in user code after 8 collectives
    peer = rank(store, clock, {"0": 9})  # inside the 9th, waiting for the other
    for w in (hung, peer):
        w.committed(20)
    clock.now += 3  # standing still: each marks where it stands
    look(hung, peer)
    assert MARK_KEY.format("0", 8) in store.keys and MARK_KEY.format("0", 9) in store.keys
    assert judge(hung.beat(), clock.now, store.marked) is None  # not for the timeout yet
    clock.now += 3
    verdict = judge(hung.beat(), clock.now, store.marked)
    assert verdict == Hang(20, 6.0, 5.0, 0.0, "0")
    assert judge(peer.beat(), clock.now, store.marked) is None


def test_a_frozen_rank_is_judged_from_the_last_beat_it_wrote() -> None:
    """A C call that holds the GIL (or SIGSTOP): the worker's threads stop, and so does its
    beat; what it wrote last says where it stood, and the judge, outside it, goes on. It
    wrote its counts a moment before it froze, and entered seven more collectives after (a
    second of steps): the peer waits past them, so only the group's top tells."""
    clock, store = Clock(), Store()
    frozen = rank(store, clock, {"0": 8})
    frozen.committed(20)
    last = frozen.beat()  # written just before it froze; it writes nothing after
    peer = rank(store, clock, {"0": 16})  # waits in the 16th: the frozen one entered 15
    peer.committed(23)
    clock.now += 3
    look(peer)  # only the peer's thread runs
    assert judge(Beat.from_json(last.to_json()), clock.now, store.marked) is None
    clock.now += 60
    verdict = judge(Beat.from_json(last.to_json()), clock.now, store.marked, store.top)
    assert verdict is not None and verdict.frozen_s == 63.0 and verdict.stalled_s == 63.0
    # The top speaks only of a worker whose beat went silent: a fresh beat's counts are
    # where it stands, and only a mark one above them says a peer waits on it.
    assert judge(frozen.beat(), clock.now, store.marked, store.top) is None


def test_a_rank_stopped_inside_a_collective_its_peer_entered_too_is_hung() -> None:
    """Rank 1 entered the step's all-reduce with rank 0 and was stopped inside it: their
    counts are equal, so no mark is above its count; but its beat is silent, and a peer's
    mark (not its own) stands at its count: it holds that peer."""
    clock, store = Clock(), Store()
    stopped = rank(store, clock, {"0": 35})
    peer = rank(store, clock, {"0": 35})
    for w in (stopped, peer):
        w.committed(31)
    clock.now += 3
    look(stopped)  # it stood a while before it was stopped: its own mark at 35
    last = stopped.beat()
    look(peer)  # the peer, inside the same collective, marks 35 too
    clock.now += 10
    verdict = judge(Beat.from_json(last.to_json()), clock.now, store.marked, store.top)
    assert verdict is not None and verdict.frozen_s == 10.0
    assert judge(peer.beat(), clock.now, store.marked, store.top) is None  # it beats on
    # Its own mark alone is no peer waiting: a rank frozen in a long save of its own, whom
    # nobody waits for inside a collective, is left to the collective timeout.
    lone, alone = Store(), rank(Store(), clock, {"0": 35})
    alone._connect = lambda: lone
    alone.committed(31)
    clock.now += 3
    look(alone)
    last = alone.beat()
    clock.now += 10
    assert judge(Beat.from_json(last.to_json()), clock.now, lone.marked, lone.top) is None


def test_collectives_entered_are_progress() -> None:
    """An evaluation that all-reduces every batch commits nothing for minutes: its ranks
    enter collectives all the while, in lockstep; none of them is stalled, whatever a peer
    marked a moment ago."""
    clock, store = Clock(), Store()
    counts = {"0": 8}
    evaluating = rank(store, clock, counts)
    evaluating.committed(20)
    evaluating.beat()
    for _ in range(30):  # 30 s of evaluation: a beat a second, collectives in between
        clock.now += 1
        counts["0"] += 5
        store.add(MARK_KEY.format("0", counts["0"] + 1), 1)  # a peer a collective ahead
        assert judge(evaluating.beat(), clock.now, store.marked, store.top) is None


def test_a_groups_top_only_goes_up() -> None:
    store = Store()
    raise_top(store, "0", 5)
    raise_top(store, "0", 3)
    raise_top(store, "0", 9)
    assert read_top(store, "0") == 9 and read_top(store, "1") is None


def test_ranks_standing_still_together_judge_nobody() -> None:
    """Every rank in the same long step (an evaluation on all of them): the same counts."""
    clock, store = Clock(), Store()
    watches = [rank(store, clock, {"0": 12, "1": 3}) for _ in range(4)]
    for w in watches:
        w.committed(7)
    clock.now += 60
    look(*watches)
    assert all(judge(w.beat(), clock.now, store.marked) is None for w in watches)


def test_groups_are_compared_one_by_one() -> None:
    """Pipeline or tensor parallelism: ranks run different numbers of collectives in
    different groups by design. A sum over groups would take rank 0 (many more collectives in
    its own group "tp0") for ahead of rank 1, which waits in group "dp" for it."""
    clock, store = Clock(), Store()
    stuck = rank(store, clock, {"dp": 4, "tp0": 100})  # has not entered dp's 5th
    peer = rank(store, clock, {"dp": 5, "tp1": 3})  # inside dp's 5th, waiting
    for w in (stuck, peer):
        w.committed(9)
    clock.now += 6
    look(stuck, peer)
    verdict = judge(stuck.beat(), clock.now, store.marked)
    assert verdict is not None and verdict.group == "dp"
    assert judge(peer.beat(), clock.now, store.marked) is None  # tp1: nobody else in it


def test_nothing_is_judged_during_the_sync_outside_a_generation_or_at_the_fence() -> None:
    clock, store = Clock(), Store()
    store.add(MARK_KEY.format("0", 4), 1)  # a peer waits in a collective this rank has not entered
    w = rank(store, clock, {"0": 3})
    clock.now += 60  # the state sync (a transfer the peer waits for): not training yet
    assert w.beat().since is None and judge(w.beat(), clock.now, store.marked) is None
    w.trains()
    w.committed(1)
    w.left()  # a rescale: out of the generation
    clock.now += 60
    assert judge(w.beat(), clock.now, store.marked) is None
    w._connect = lambda: store
    w.trains()
    with w.paused():  # fenced: it waits on purpose
        clock.now += 60
        assert judge(w.beat(), clock.now, store.marked) is None
    assert judge(w.beat(), clock.now, store.marked) is None  # its clock starts again


def test_a_rank_stuck_at_its_first_batch_of_a_generation_is_hung() -> None:
    """Synced and training, but stuck before its first commit in the generation (a
    DataLoader that waits on a read at its iteration's start) while the peer waits in the
    first step's collective: it holds the job as much as after a commit."""
    clock, store = Clock(), Store()
    stuck = rank(store, clock, {"0": 8})
    stuck.committed(20)  # the generation before
    stuck.left()
    stuck._connect = lambda: store  # a new generation
    store.add(MARK_KEY.format("0", 9), 1)  # the peer, in the first step's all-reduce
    stuck.trains()
    clock.now += 3
    assert judge(stuck.beat(), clock.now, store.marked) is None
    clock.now += 3
    verdict = judge(stuck.beat(), clock.now, store.marked)
    assert verdict is not None and verdict.step == 20 and verdict.first


def test_the_default_timeout_is_most_of_the_collective_timeout_and_five_long_steps() -> None:
    assert default_timeout(600.0, 0.1) == 540.0  # torch's 10-minute collective timeout
    assert default_timeout(30.0, 8.0) == 40.0
    clock = Clock()
    w = HangWatch(None, 30.0, clock=clock)
    for _ in range(3):
        w.committed(1)
        clock.now += 7.0  # steps of 7 s
    w.committed(4)
    assert w.timeout_s() == 35.0


def test_the_agents_judge_reads_beat_files_and_judges_each_worker_once(tmp_path: Path) -> None:
    clock, store = Clock(), Store()
    hung = rank(store, clock, {"0": 8}, beat_dir=tmp_path)  # (both "pid" os.getpid():
    hung.committed(20)  # the beat file is named by the writer's pid)
    peer = rank(store, clock, {"0": 9})
    peer.committed(20)
    clock.now += 6
    look(peer)
    hung._write_beat()
    said: list[tuple[int, Hang]] = []
    where: list[tuple[str, int]] = []

    def connect(host: str, port: int) -> Any:
        where.append((host, port))
        return store

    import os

    judge_ = HangJudge(
        tmp_path,
        lambda: [os.getpid(), 424242],  # a worker that has written no beat: not judged
        lambda generation: ("10.0.0.1", 5000) if generation == 0 else None,
        lambda pid, h: said.append((pid, h)),
        clock=clock,
        connect=connect,
    )
    judge_.look()
    judge_.look()
    assert [(pid, h.step) for pid, h in said] == [(os.getpid(), 20)]
    assert where == [("10.0.0.1", 5000)]
    (tmp_path / f"beat-{os.getpid()}.json").write_text("not a beat")
    judge_.forget(os.getpid())
    assert not (tmp_path / f"beat-{os.getpid()}.json").exists()
