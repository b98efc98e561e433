"""The step as a transaction (pure): what a failure leaves of a rank's state, and who sends
what after a rebuild."""

from __future__ import annotations

import pytest
import torch

from efdl.worker.digest import digest
from efdl.worker.layout import Layout, covers, overlap, rows
from efdl.worker.transaction import Choice, Loss, Recovery, Standing, StepPhase, choose, recovery


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        (StepPhase.COMMITTED, Recovery.KEEP),  # failed in forward/backward: tensors untouched
        (StepPhase.STEPPED, Recovery.ROLL_FORWARD),  # failed after optimizer.step(): count it
        (StepPhase.STEPPING, Recovery.DISCARD),  # failed inside optimizer.step(): torn
    ],
)
def test_a_failure_leaves_a_committed_state_without_a_copy(
    phase: StepPhase, expected: Recovery
) -> None:
    assert recovery(phase, has_copy=False) is expected


@pytest.mark.parametrize("phase", list(StepPhase))
def test_a_rollback_copy_wins_where_one_is_kept(phase: StepPhase) -> None:
    assert recovery(phase, has_copy=True) is Recovery.RESTORE_COPY


@pytest.mark.parametrize("phase", list(StepPhase))
@pytest.mark.parametrize("has_copy", [False, True])
def test_an_unverified_step_is_torn_whatever_the_phase(phase: StepPhase, has_copy: bool) -> None:
    """The step the rank would hold was not verified (NCCL: its communication failed before
    it was known complete): neither keeping, rolling forward nor a copy of it may stand."""
    assert recovery(phase, has_copy, trusted=False) is Recovery.DISCARD


def test_standings_order_by_step_then_settled() -> None:
    standings = [Standing(None), Standing(4, False), Standing(4), Standing(5, False)]
    keys = [s.key() for s in standings]
    assert keys == sorted(keys) and keys[0] == -1
    for s in (Standing(None), Standing(None, torn=True), Standing(0), Standing(7, False)):
        assert Standing.from_key(s.key()) == s
    assert Standing(None, torn=True).key() < Standing(None).key()


def test_only_the_ranks_that_lack_the_newest_step_receive() -> None:
    # A graceful pause: survivors 0-2 at step 9, a newcomer at 3.
    keys = [Standing(9).key()] * 3 + [Standing(None).key()]
    assert choose(keys) == Choice(9, 0, (0, 1, 2), (3,))


def test_the_newest_step_wins_and_a_settled_holder_is_the_primary() -> None:
    # A peer died mid-step: rank 0 failed in backward (step 9), rank 1 rolled forward to 10
    # (failed in a collective after optimizer.step), rank 2 committed 10, rank 3 is torn.
    keys = [Standing(9).key(), Standing(10, False).key(), Standing(10).key(), Standing(None).key()]
    assert choose(keys) == Choice(10, 2, (1, 2), (0, 3))


def test_rolled_forward_holders_are_a_source_when_no_rank_settled() -> None:
    keys = [Standing(10, False).key(), Standing(10, False).key()]
    assert choose(keys) == Choice(10, 0, (0, 1), ())


def test_a_cold_start_takes_rank_0s_state() -> None:
    assert choose([-1, -1, -1]) == Choice(None, 0, (0,), (1, 2))
    assert choose([-1]) == Choice(None, 0, (0,), ())


def test_no_holder_after_committed_steps_is_lost_not_a_cold_start() -> None:
    """Every rank new (all the holders died together) while the job had committed step 56:
    not a cold start from rank 0's initial weights; a job that never committed is one."""
    assert choose([-1, -1], job_step=56).loss is Loss.GONE
    assert not choose([-1, -1], job_step=0).lost


def test_a_holder_behind_the_jobs_step_is_not_taken_silently() -> None:
    """The ranks that trained the job to step 1000 are gone; the only holder left is stale
    (it holds step 600): a sync from it would roll the job back by 400 steps without a word.
    The choice says so (the caller asks the remote cache for something newer, or stops)."""
    stale = choose([Standing(600).key(), -1], job_step=1000)
    assert stale.loss is Loss.BEHIND and stale.step == 600 and stale.holders == (0,)
    assert not choose([Standing(1000).key(), -1], job_step=1000).lost
    # A holder that rolled forward past the job's step, or at it, is not behind.
    assert not choose([Standing(1001, False).key()], job_step=1000).lost


def test_an_older_line_loses_to_the_current_one_whatever_its_step() -> None:
    """Rank 0 trained on in generation 4 while cut off (it reached step 1000 there); the job
    went on in generation 5 from a snapshot, to step 950. Back, rank 0 holds the higher
    step of a line the job left: generation 5's state is the job's."""
    old, current = Standing(1000, generation=4), Standing(950, generation=5)
    assert Standing.from_key(old.key()) == old and old.key() < current.key()
    choice = choose([old.key(), current.key()], job_step=940, job_generation=5)
    assert (choice.step, choice.generation, choice.holders, choice.needy) == (950, 5, (1,), (0,))
    assert not choice.lost
    # Alone, the old line is behind the job's progress (generation 5, step 940).
    assert choose([old.key()], job_step=940, job_generation=5).loss is Loss.BEHIND


def test_a_torn_state_with_no_holder_left_is_lost_not_a_cold_start() -> None:
    torn, new = Standing(None, torn=True).key(), Standing(None).key()
    assert choose([torn, new]).lost
    assert not choose([torn, Standing(3).key()]).lost  # a holder is left: it sends


# A sharded state: each rank holds some rows (chunk ``index`` of ``shards``), so a step counts
# only if its holders hold every row between them.


def test_sharded_survivors_of_a_graceful_pause_cover_their_step() -> None:
    keys = [Standing(9).key()] * 3 + [Standing(None).key()]
    layouts = [Layout(3, 0), Layout(3, 1), Layout(3, 2), None]
    assert choose(keys, layouts) == Choice(9, 0, (0, 1, 2), (3,))


def test_a_sharded_step_missing_a_dead_ranks_rows_is_lost() -> None:
    # Rank 1 of 3 died: its rows of step 9 are gone; the others stepped past step 8.
    keys = [Standing(9).key(), Standing(9).key(), Standing(None).key()]
    layouts = [Layout(3, 0), Layout(3, 2), None]
    choice = choose(keys, layouts)
    assert choice.step is None and choice.lost


def test_the_newest_sharded_step_whose_rows_are_all_held_wins() -> None:
    # Two replicas of two shards (HSDP): rank 2 rolled forward to step 10, its replica
    # (rank 0) did not, and rank 3 died: step 10 lacks rows, step 9 has them all.
    keys = [Standing(9).key(), Standing(9).key(), Standing(10, False).key()]
    layouts = [Layout(2, 0), Layout(2, 1), Layout(2, 0)]
    assert choose(keys, layouts) == Choice(9, 0, (0, 1), (2,))


def test_a_sharded_cold_start_keeps_each_ranks_own_rows() -> None:
    layouts = [Layout(2, 0), Layout(2, 1)]
    choice = choose([Standing(None).key()] * 2, layouts)
    assert choice.step is None and not choice.lost


@pytest.mark.parametrize(
    ("layouts", "expected"),
    [
        ([Layout(3, 0), Layout(3, 1), Layout(3, 2)], True),
        ([Layout(3, 0), Layout(3, 2)], False),
        ([Layout(1, 0)], True),
        ([Layout(2, 0), Layout(2, 1), Layout(2, 1)], True),
        ([Layout(2, 0), Layout(3, 1), Layout(3, 2)], False),  # two layouts: not comparable
        ([], False),
    ],
)
def test_layouts_cover_every_row_only_with_every_index(
    layouts: list[Layout], expected: bool
) -> None:
    assert covers(layouts) is expected


@pytest.mark.parametrize(("length", "shards"), [(7, 3), (5, 4), (1, 2), (0, 3), (1000, 7)])
def test_rows_are_torch_chunks(length: int, shards: int) -> None:
    import torch

    chunks = list(torch.arange(length).chunk(shards)) if length else []
    for index in range(shards):
        start, end = rows(length, Layout(shards, index))
        chunk = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, end)) == chunk


def test_the_rows_two_layouts_share() -> None:

    assert overlap(101, Layout(2, 0), Layout(3, 1)) == (34, 51)  # chunks of 51 and of 34
    assert overlap(101, Layout(2, 1), Layout(3, 0)) == (51, 34)  # none: start >= end
    assert overlap(101, Layout(3, 2), Layout(1, 0)) == (68, 101)
    assert overlap(2, Layout(4, 3), Layout(4, 3)) == (2, 2)  # an empty chunk holds nothing


def test_holders_whose_digest_differs_from_the_others_are_torn() -> None:
    k = Standing(5).key()
    three = choose([k, k, k, -1], digests=[7, 9, 9, 0])
    assert (three.holders, three.diverged, three.primary) == ((1, 2), (0,), 1)
    assert three.needy == (0, 3)
    # Two that differ: no majority; the lowest settled holder's stands.
    rolled = Standing(5, settled=False).key()
    two = choose([rolled, k], digests=[7, 9])
    assert (two.holders, two.diverged) == ((1,), (0,))
    # Equal digests, or none (0: a sharded state, a rank holding nothing): nothing diverges.
    assert choose([k, k], digests=[7, 7]).diverged == ()
    assert choose([k, k], digests=[0, 9]).holders == (0, 1)


def test_the_digest_sees_one_changed_bit_and_not_where_a_tensor_lies() -> None:
    params = [torch.randn(1000), torch.randn(3, 5, dtype=torch.float16), torch.zeros(0)]
    d = digest(params)
    assert d == digest([p.clone() for p in params]) and d != 0
    flipped = [p.clone() for p in params]
    flipped[0].view(torch.int32)[777] ^= 1  # the lowest bit of one element
    assert digest(flipped) != d
    assert digest(params[::-1]) != d  # order counts
    base = torch.arange(20, dtype=torch.float32)
    assert digest([base[1:9]]) == digest([base[1:9].clone()])  # a view at an odd offset
    assert digest([base.reshape(4, 5).t()]) == digest([base.reshape(4, 5).t().contiguous()])
