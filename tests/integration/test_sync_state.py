"""The rebuild's sync with real torch.distributed (gloo) processes: only the ranks that lack
the newest committed state receive it, from every rank that holds it, in place, in bounded
messages; the rest of the state comes from one rank."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.ranks import ForkServer

# One fork server (and the runs the tests share) per module: on one xdist worker.
pytestmark = pytest.mark.xdist_group("sync-state")

SCRIPT = Path(__file__).parent / "scripts" / "sync_state.py"
BUCKET_MB = 1


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """Every rank of this module is forked from one process that imported torch once."""
    with ForkServer() as forks:
        yield forks


def run_world(
    server: ForkServer, tmp_path: Path, world: int, env: dict[str, str] | None = None
) -> list[dict[str, object]]:
    args = [
        [str(r), str(world), str(tmp_path / "store"), str(tmp_path / f"rank{r}.json")]
        for r in range(world)
    ]
    server.run_ranks(SCRIPT, args, {"EFDL_SYNC_BUCKET_MB": str(BUCKET_MB), **(env or {})})
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(120)
def test_only_stale_ranks_and_newcomers_receive_spread_over_the_holders(
    server: ForkServer, tmp_path: Path
) -> None:
    ranks = run_world(server, tmp_path, 5)  # holders 0, 1 at step 5; rank 2 at step 4; 3, 4 new
    want = ranks[0]
    size = int(want["state_bytes"])  # type: ignore[call-overload]
    for r in ranks:  # everyone holds the holders' state now, exactly
        assert (r["params"], r["momentum"], r["step"], r["cursor"]) == (
            want["params"],
            want["momentum"],
            5,
            want["cursor"],
        )
        assert r["note"] == "rank 0"  # the rest of the state is the primary's
        assert r["same_params"]  # the optimizer still steps the model's own parameters
    assert ranks[0]["received"] == ranks[1]["received"] == 0  # holders receive nothing
    for r in ranks[2:]:
        assert r["received"] == size
    # Both holders sent, about half each: 3 receivers x the state, spread.
    sent = [int(r["sent"]) for r in ranks[:2]]  # type: ignore[call-overload]
    assert sum(sent) == 3 * size and min(sent) >= size
    assert all(r["sent"] == 0 for r in ranks[2:])


@pytest.mark.timeout(120)
def test_a_newcomer_receives_in_place_with_at_most_a_bucket_extra(
    server: ForkServer, tmp_path: Path
) -> None:
    ranks = run_world(server, tmp_path, 4)
    newcomer = ranks[3]
    momentum = int(newcomer["state_bytes"]) // 2  # type: ignore[call-overload]
    # Parameters land in the model's own tensors; only the momentum buffers (which it did
    # not have) are new. A copy of the parameters, or of the whole state, would show here.
    slack = 6 << 20
    assert int(newcomer["grew"]) <= momentum + BUCKET_MB * (1 << 20) + slack, newcomer["grew"]  # type: ignore[call-overload]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("corrupt", [0, 2])
def test_a_replica_that_differs_is_found_and_repaired(
    server: ForkServer, tmp_path: Path, corrupt: int
) -> None:
    """Three ranks hold step 5; one of them (the would-be primary, rank 0, or another) has one
    parameter element changed: the holders compare digests, the odd one out is taken as torn
    and receives the state of the other two; nobody receives the odd one's tensors."""
    ranks = run_world(server, tmp_path, 4, {"SYNC_HOLDERS": "3", "SYNC_CORRUPT": str(corrupt)})
    good = ranks[1]
    size = int(good["state_bytes"])  # type: ignore[call-overload]
    for r in ranks:
        assert (r["params"], r["momentum"], r["step"]) == (good["params"], good["momentum"], 5)
    assert ranks[corrupt]["received"] == size  # repaired: it received every tensor
    assert ranks[corrupt]["sent"] == 0  # and spread nothing
    assert ranks[3]["received"] == size


@pytest.mark.timeout(120)
def test_a_rank_whose_step_communication_failed_never_holds_the_step(
    server: ForkServer, tmp_path: Path
) -> None:
    """NCCL's asynchronous step on gloo with stand-in CUDA events: rank 1's group reports an
    error before its step 3 is known complete (its update ran on torn gradients). The verdict
    rides the commit agreement: both ranks leave at the same commit; rank 1 takes itself as
    torn, rank 0 holds its step, and the sync makes rank 1 hold rank 0's tensors."""
    script = Path(__file__).parent / "scripts" / "verdict_vote.py"
    args = [[str(r), str(tmp_path / "store"), str(tmp_path / f"rank{r}.json")] for r in range(2)]
    server.run_ranks(script, args)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["left_at"] == r1["left_at"] == 4  # flagged at commit 3, agreed at commit 4
    assert (r0["held"], r0["torn"]) == (4, False)
    assert (r1["held"], r1["torn"]) == (None, True), r1
    assert r1["action"].startswith("the update was torn")
    assert r1["params"] == r0["params"] and r1["step"] == r0["step"] == 4
    assert r1["received"] > 0 and r0["received"] == 0
