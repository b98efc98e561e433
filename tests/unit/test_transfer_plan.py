"""Planning a state transfer (pure): bounded messages that carry every byte exactly once to
every rank that needs it, spread over the holders, in one order every rank shares."""

from __future__ import annotations

from collections import Counter

import pytest

from efdl.state.transfer import Leaf, Message, fan_out, plan, routes

MB = 1 << 20


def covered(messages: list[Message]) -> Counter[tuple[int, int]]:
    """How many times each (leaf, byte) range boundary pair is sent: byte counts per leaf."""
    out: Counter[tuple[int, int]] = Counter()
    for m in messages:
        for p in m.pieces:
            out[(p.leaf, p.start)] += p.nbytes
    return out


def test_every_byte_goes_once_in_messages_of_at_most_a_bucket() -> None:
    sizes = [3 * MB, 100, 200, 10 * MB + 7, 0, 1 * MB, 64]
    leaves = [Leaf(n, False, (0,)) for n in sizes]
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
        Leaf(10, False, (0,)),
        Leaf(10, True, (0,)),
        Leaf(10, False, (1,)),
        Leaf(10, False, (0,)),
    ]
    messages = plan(leaves, MB)
    kinds = {(m.on_device, m.holders): [p.leaf for p in m.pieces] for m in messages}
    assert kinds == {(False, (0,)): [0, 3], (True, (0,)): [1], (False, (1,)): [2]}


def test_a_bucket_must_hold_a_byte() -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        plan([Leaf(1, False, (0,))], 0)


def test_each_needy_rank_receives_each_message_once_spread_over_the_holders() -> None:
    messages = plan([Leaf(8 * MB, False, (0, 1, 2))], MB)  # 8 messages, 3 holders
    needy = [3, 4]
    got = list(routes(messages, needy))
    assert Counter((r.message, r.dst) for r in got) == Counter(
        (j, d) for j in range(8) for d in needy
    )
    assert all(r.src in (0, 1, 2) for r in got)
    sent_by = Counter(r.src for r in got)
    assert max(sent_by.values()) - min(sent_by.values()) <= 1  # spread evenly
    assert [(r.message, r.dst) for r in got] == sorted((r.message, r.dst) for r in got)


def test_a_needy_rank_does_not_receive_what_it_holds() -> None:
    # Resuming from the cache: every rank read some parts and needs the others.
    leaves = [Leaf(10, False, (0,)), Leaf(10, False, (1,)), Leaf(10, False, (2,))]
    got = {(r.message, r.src, r.dst) for r in routes(plan(leaves, MB), [0, 1, 2])}
    assert got == {(0, 0, 1), (0, 0, 2), (1, 1, 0), (1, 1, 2), (2, 2, 0), (2, 2, 1)}


def test_the_operation_timeout_grows_with_the_receivers_one_holder_serves() -> None:
    messages = plan([Leaf(10, False, (0,))], MB)
    assert fan_out(messages, []) == 1
    assert fan_out(messages, [1, 2, 3]) == 3
    assert fan_out(plan([Leaf(10, False, (0, 1))], MB), [2, 3, 4]) == 2


def test_the_holders_share_the_bytes_not_just_the_messages() -> None:
    # Tensors of 67 MiB in 64 MiB buckets: slices of 64 and 3 MiB. Taking turns by message
    # would give one holder every large slice.
    leaves = [Leaf(67 * MB, False, (0, 1)) for _ in range(6)]
    messages = plan(leaves, 64 * MB)
    sent = Counter[int]()
    for r in routes(messages, [2]):
        sent[r.src] += messages[r.message].nbytes
    assert abs(sent[0] - sent[1]) <= 64 * MB, sent
