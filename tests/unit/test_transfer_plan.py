"""Planning a state transfer (pure): bounded messages that carry every byte exactly once to
every rank that needs it, spread over the holders, in one order every rank shares."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from efdl.worker.transfer import (
    Leaf,
    Message,
    Piece,
    Span,
    UnheldError,
    fan_out,
    own_copies,
    plan,
    routes,
)

MB = 1 << 20


def covered(messages: list[Message]) -> Counter[tuple[int, int]]:
    """How many times each (leaf, byte) range boundary pair is sent: byte counts per leaf."""
    out: Counter[tuple[int, int]] = Counter()
    for m in messages:
        for p in m.pieces:
            out[(p.leaf, p.start)] += p.nbytes
    return out


def whole(nbytes: int, holders: tuple[int, ...], ranks: range, on_device: bool = False) -> Leaf:
    return Leaf.whole(nbytes, on_device, holders, ranks)


def test_every_byte_goes_once_in_messages_of_at_most_a_bucket() -> None:
    sizes = [3 * MB, 100, 200, 10 * MB + 7, 0, 1 * MB, 64]
    leaves = [whole(n, (0,), range(2)) for n in sizes]
    messages = plan(leaves, 4 * MB)
    assert all(0 < m.nbytes <= 4 * MB for m in messages)
    per_leaf: Counter[int] = Counter()
    for m in messages:
        for p in m.pieces:
            assert 0 <= p.start < p.end <= sizes[p.leaf]
            per_leaf[p.leaf] += p.nbytes
    assert per_leaf == Counter({i: n for i, n in enumerate(sizes) if n})
    # The large leaf goes alone, in slices; the small ones share buckets.
    assert [len(m.pieces) for m in messages if m.pieces[0].leaf == 3] == [1, 1, 1]
    assert any(len(m.pieces) > 1 for m in messages)


def test_leaves_of_different_holders_or_links_never_share_a_message() -> None:
    leaves = [
        whole(10, (0,), range(3)),
        whole(10, (0,), range(3), on_device=True),
        whole(10, (1,), range(3)),
        whole(10, (0,), range(3)),
    ]
    messages = plan(leaves, MB)
    kinds = {(m.on_device, m.senders): [p.leaf for p in m.pieces] for m in messages}
    assert kinds == {(False, (0,)): [0, 3], (True, (0,)): [1], (False, (1,)): [2]}


def test_a_bucket_must_hold_a_byte() -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        plan([whole(1, (0,), range(2))], 0)


def test_each_needy_rank_receives_each_message_once_spread_over_the_holders() -> None:
    messages = plan([whole(8 * MB, (0, 1, 2), range(5))], MB)  # 8 messages, 3 holders
    needy = [3, 4]
    got = list(routes(messages))
    assert Counter((r.message, r.dst) for r in got) == Counter(
        (j, d) for j in range(8) for d in needy
    )
    assert all(r.src in (0, 1, 2) for r in got)
    sent_by = Counter(r.src for r in got)
    assert max(sent_by.values()) - min(sent_by.values()) <= 1  # spread evenly
    assert [(r.message, r.dst) for r in got] == sorted((r.message, r.dst) for r in got)


def test_a_needy_rank_does_not_receive_what_it_holds() -> None:
    # Resuming from the cache: every rank read some parts and needs the others.
    leaves = [whole(10, (0,), range(3)), whole(10, (1,), range(3)), whole(10, (2,), range(3))]
    got = {(r.message, r.src, r.dst) for r in routes(plan(leaves, MB))}
    assert got == {(0, 0, 1), (0, 0, 2), (1, 1, 0), (1, 1, 2), (2, 2, 0), (2, 2, 1)}


def test_the_operation_timeout_grows_with_the_receivers_one_holder_serves() -> None:
    assert fan_out(plan([whole(10, (0,), range(1))], MB)) == 1
    assert fan_out(plan([whole(10, (0,), range(4))], MB)) == 3
    assert fan_out(plan([whole(10, (0, 1), range(5))], MB)) == 2


def test_the_holders_share_the_bytes_not_just_the_messages() -> None:
    # Tensors of 67 MiB in 64 MiB buckets: slices of 64 and 3 MiB. Taking turns by message
    # would give one holder every large slice.
    leaves = [whole(67 * MB, (0, 1), range(3)) for _ in range(6)]
    messages = plan(leaves, 64 * MB)
    sent = Counter[int]()
    for r in routes(messages):
        sent[r.src] += messages[r.message].nbytes
    assert abs(sent[0] - sent[1]) <= 64 * MB, sent


def rows(length: int, shards: int, index: int) -> tuple[int, int]:
    """torch.chunk's rows for shard ``index`` of ``shards`` (FSDP2's layout)."""
    size = -(-length // shards)
    start = min(index * size, length)
    return start, min(start + size, length)


def sharded(length: int, row: int, old: int, new: int) -> Leaf:
    """A tensor of ``length`` rows of ``row`` bytes, laid out over ``old`` ranks, then ``new``."""
    held = tuple(Span(r, a * row, b * row) for r in range(old) for a, b in [rows(length, old, r)])
    wanted = tuple(Span(r, a * row, b * row) for r in range(new) for a, b in [rows(length, new, r)])
    return Leaf(length * row, False, held, wanted)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 4), (1, 5), (5, 1), (7, 3)])
def test_a_resharded_tensor_gives_each_rank_exactly_its_new_rows(old: int, new: int) -> None:
    length, row = 1001, 24
    leaf = sharded(length, row, old, new)
    got: dict[int, list[tuple[int, int]]] = {r: [] for r in range(new)}
    for j, m in enumerate(messages := plan([leaf], 4096)):
        assert m.nbytes <= 4096
        for route in routes(messages):
            if route.message != j:
                continue
            for p in m.pieces:
                src_rows = rows(length, old, route.src)
                assert src_rows[0] * row <= p.start < p.end <= src_rows[1] * row  # it holds them
                got[route.dst].append((p.start, p.end))
    for r in range(new):
        got[r] += [(p.start, p.end) for p in own_copies([leaf], r)]
        a, b = rows(length, new, r)
        covered = sorted(got[r])
        assert sum(e - s for s, e in covered) == (b - a) * row  # no byte twice
        assert all(x[1] == y[0] for x, y in itertools.pairwise(covered))
        assert (covered[0][0], covered[-1][1]) == (a * row, b * row) if covered else a == b


def test_a_rank_keeps_its_own_rows_without_sending_them() -> None:
    leaf = sharded(8, 10, 2, 2)  # the same layout: nothing travels
    assert plan([leaf], MB) == []
    assert list(own_copies([leaf], 1)) == [Piece(0, 40, 80)]


def test_replicas_share_the_sending_of_a_shard() -> None:
    # Two replicas of a 2-way sharded tensor (HSDP): a newcomer's rows come from either.
    held = (Span(0, 0, 50), Span(1, 50, 100), Span(2, 0, 50), Span(3, 50, 100))
    leaf = Leaf(100, False, held, (Span(4, 0, 100),))
    messages = plan([leaf], 10)
    assert {m.senders for m in messages} == {(0, 2), (1, 3)}
    assert {r.src for r in routes(messages)} == {0, 1, 2, 3}


def test_rows_nobody_holds_are_an_error_that_says_which() -> None:
    leaf = Leaf(100, False, (Span(0, 0, 50),), (Span(1, 0, 100),))
    with pytest.raises(UnheldError, match=r"bytes \[50, 100\)"):
        plan([leaf], MB)
