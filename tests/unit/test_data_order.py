"""The streamed epoch's order (efdl.data.order): each row once per epoch, a function of
(seed, epoch) alone, rows moved less than a window, and each rank reading only its lanes,
whatever the world does between steps."""

from __future__ import annotations

import random

import pytest

from efdl.data.order import EpochOrder, StreamShareError, check_world, lane_share, most_ranks, share

# Uneven shards, as Parquet files written by different jobs are (one empty).
ROWS = (1000, 37, 0, 512, 999, 64, 2048, 5, 700)


def order(epoch: int = 0, seed: int = 7, lanes: int = 16, window: int = 100) -> EpochOrder:
    return EpochOrder(ROWS, seed, epoch, lanes, window)


def test_an_epoch_is_every_row_once() -> None:
    o = order()
    rows = [o.at(p) for p in range(o.total)]
    assert o.total == sum(ROWS)
    assert sorted(rows) == sorted((s, r) for s, n in enumerate(ROWS) for r in range(n))


def test_the_order_is_seed_and_epoch_alone() -> None:
    first = [order().at(p) for p in range(0, order().total, 97)]
    assert [order().at(p) for p in range(0, order().total, 97)] == first  # a new instance
    assert [order(epoch=1).at(p) for p in range(0, order().total, 97)] != first
    assert [order(seed=8).at(p) for p in range(0, order().total, 97)] != first


def test_rows_move_less_than_a_window_within_their_lane() -> None:
    o = order(window=50)
    for lane in (0, 5, 15):
        start, length = o.lane_start(lane), o.lane_length(lane)
        if o.backward(lane):  # odd lanes are read from their end
            moved = [start + length - 1 - o.lane_row(lane, k) - k for k in range(length)]
        else:
            moved = [o.lane_row(lane, k) - start - k for k in range(length)]
        assert max(map(abs, moved)) < 50
        assert sorted(o.lane_row(lane, k) for k in range(length)) == list(
            range(start, start + length)
        )
    assert sum(o.lane_length(lane) for lane in range(16)) == o.total


@pytest.mark.parametrize("lanes", [1, 7, 16, 64])
def test_lanes_split_any_world(lanes: int) -> None:
    for world in range(1, lanes + 1):  # each rank its own contiguous lanes
        got = [lane_share(r, world, lanes) for r in range(world)]
        assert [lane for s in got for lane in s.lanes] == list(range(lanes))
        assert max(len(s.lanes) for s in got) - min(len(s.lanes) for s in got) <= 1
        assert all(s.group == 1 for s in got)
    for world in (lanes + 1, 2 * lanes + 3):  # more ranks than lanes: they share lanes
        got = [lane_share(r, world, lanes) for r in range(world)]
        assert all(len(s.lanes) == 1 for s in got)
        for lane in range(lanes):
            sharing = [s for s in got if s.lanes[0] == lane]
            assert sorted(s.index for s in sharing) == list(range(sharing[0].group))
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        lane_share(4, 4, lanes)


def test_each_row_once_through_joins_leaves_and_batch_changes() -> None:
    o = order()
    rng = random.Random(3)
    cursor, seen = 0, []
    while cursor < o.total:
        world = rng.randint(1, 24)  # a rescale may come before any step (16 lanes)
        n = rng.choice([64, 100, 256, 7])  # per-rank batch fixed (N moves) or global fixed
        shares = [share(o, cursor, n, r, world) for r in range(world)]
        got = sorted(p for s in shares for p in s)
        assert got == list(range(cursor, min(cursor + n, o.total)))  # the next n positions
        for r, s in enumerate(shares):  # only its own lanes
            assert {p % o.lanes for p in s} <= set(lane_share(r, world, o.lanes).lanes)
        seen += [o.at(p) for p in got]
        cursor += n
    assert len(seen) == len(set(seen)) == o.total


def test_a_rank_reads_its_lanes_in_stream_order_window_by_window() -> None:
    o = order(window=64)
    mine = share(o, 0, o.total, 2, 4)  # rank 2 of 4, the whole epoch
    lanes = lane_share(2, 4, 16).lanes
    stream = [o.lane_row(p % 16, p // 16) for p in mine]
    lo = o.lane_start(lanes[0])
    hi = o.lane_start(lanes[-1]) + o.lane_length(lanes[-1])
    assert all(lo <= i < hi for i in stream)  # a contiguous quarter of the stream
    for lane in lanes:  # and within a lane, window after window
        ks = [p // 16 for p in mine if p % 16 == lane]
        assert [k // 64 for k in ks] == sorted(k // 64 for k in ks)


def test_bad_settings_are_refused_with_the_value() -> None:
    with pytest.raises(
        ValueError, match=r"row counts must be >= 0, with some rows \(got \[0, 0\]\)"
    ):
        EpochOrder((0, 0), 1, 0, 4, 10)
    with pytest.raises(ValueError, match=r"lanes \(0\) and window \(10\)"):
        EpochOrder((5,), 1, 0, 0, 10)
    with pytest.raises(IndexError, match="lane 0 has"):
        order().lane_row(0, 10**6)


def test_every_rank_has_a_row_of_every_step_exactly_within_check_world() -> None:
    """A sweep over small worlds, lanes and global batches, from every cursor phase: within
    ``lanes * (n // lanes)`` ranks every rank has a row of every step but the epoch's last;
    past it some step of a fixed batch leaves a rank none, and check_world refuses it."""
    for lanes in range(1, 6):
        for n in range(lanes, 3 * lanes + 2):
            o = EpochOrder((3 * n * lanes + 5,), 1, 0, lanes, 4)  # 3 * lanes steps at least
            for world in range(1, n + 3):
                fits = world <= most_ranks(lanes, n)
                phases = range(lanes) if fits else range(1)  # a fixed batch from cursor 0
                short = [
                    (c, r)
                    for first in phases
                    for c in range(first, o.total - n + 1, n)  # the steps before the last
                    for r in range(world)
                    if not share(o, c, n, r, world)
                ]
                assert bool(short) != fits, (world, lanes, n, short[:3])
                if fits:
                    check_world(world, lanes, n)
                else:
                    with pytest.raises(StreamShareError, match=f"world of {world} ranks"):
                        check_world(world, lanes, n)


@pytest.mark.parametrize(
    ("world", "lanes", "n", "said"),
    [
        (
            24,
            16,
            24,
            r"24 ranks cannot share steps of 24 rows .* over 16 lanes.* at most 16 "
            r"ranks, a global batch of at least 32 .* lanes from 24 to the batch",
        ),
        (3, 2, 3, r"3 ranks cannot share steps of 3 rows .* over 2 lanes.* at least 4"),
        (129, 16, 128, r"129 ranks is larger than the global batch \(128\).* at least 144"),
    ],
)
def test_a_world_that_would_repeat_a_row_mid_epoch_is_refused_with_what_fits(
    world: int, lanes: int, n: int, said: str
) -> None:
    o = EpochOrder((960,), 1, 0, lanes, 16)
    if world <= n:  # as found: a step that gives some rank no row, mid-epoch
        assert any(not share(o, c, n, r, world) for c in range(0, 480, n) for r in range(world))
    with pytest.raises(StreamShareError, match=said):
        check_world(world, lanes, n)
    assert isinstance(StreamShareError("x"), ValueError)  # as before: a bad setting
