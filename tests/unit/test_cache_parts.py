"""How a snapshot is cut into parts and the parts shared out over the ranks (pure)."""

from __future__ import annotations

from efdl.worker.persist import Cut, assign_parts, split_parts


def test_consecutive_tensors_are_packed_into_parts_of_at_most_the_limit() -> None:
    assert split_parts([40, 10, 10, 30, 30, 5], 40) == [[0], [1, 2], [3], [4, 5]]
    assert split_parts([100, 1], 40) == [[0], [1]]  # a larger tensor is a part by itself
    assert split_parts([], 10) == []


def test_parts_go_largest_first_to_the_rank_with_the_fewest_bytes() -> None:
    assert assign_parts([40, 20, 30, 35], 2) == [0, 0, 1, 1]  # 60 and 65 bytes
    assert assign_parts([5, 5], 4) == [0, 1]
    assert assign_parts([7, 7, 7], 1) == [0, 0, 0]


def test_every_rank_gets_a_share_of_a_large_state() -> None:
    mib = 1 << 20
    sizes = {f"['model']['layer{i}']": 64 * mib for i in range(16)}  # 1 GiB in 16 tensors
    layout = Cut.of(sizes, world=4)
    shares = [0] * 4
    for key, part in zip(layout.keys, layout.part_of, strict=True):
        shares[layout.owner[part]] += sizes[key]
    assert shares == [256 * mib] * 4
    assert Cut.of(sizes, world=4).owner == layout.owner  # the same on every rank


def test_each_rank_writes_its_own_rows_of_a_sharded_tensor_in_parts_of_its_own() -> None:
    mib = 1 << 20
    rows = {"['model']['w']": [48 * mib, 48 * mib, 40 * mib], "['model']['b']": [mib, mib, 0]}
    cut = Cut.of({"['model']['scale']": 4}, world=3, row_sizes=rows)
    assert cut.keys == ["['model']['scale']"] and cut.owner[cut.part_of[0]] == 0
    for key in rows:
        parts = cut.rows[key]
        assert [cut.owner[p] for p in parts] == [0, 1, 2]  # rank r writes its own rows
        assert len(set(parts)) == 3 and cut.part_of[0] not in parts
    # A rank's rows are cut into several parts (its writers write them at once, a reader
    # loads one at a time): 49 MB over 4 writers is parts of at most 16 MB, so w is alone.
    assert cut.rows["['model']['w']"][0] != cut.rows["['model']['b']"][0]
    assert Cut.of({"['model']['scale']": 4}, world=3, row_sizes=rows) == cut  # every rank
