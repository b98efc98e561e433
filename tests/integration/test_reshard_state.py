"""Resharding an FSDP2 model's state with real torch.distributed (gloo) processes: after a
join, a leave, both at once, the full state the new world holds between its shards is the
old world's, bit for bit; each rank holds only its rows (plus a bucket) throughout; a crash
that takes rows nobody else holds is a clear error, never a silent restart, unless a remote
cache holds a snapshot: then the rows come back from it, laid out for the new world."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.worker.cache import SnapshotStorage
from tests.integration.ranks import ForkServer

# One fork server (and the runs the tests share) per module: on one xdist worker.
pytestmark = pytest.mark.xdist_group("reshard-state")

SCRIPT = Path(__file__).parent / "scripts" / "reshard_state.py"
MB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """Every rank of this module is forked from one process that imported torch once."""
    with ForkServer() as forks:
        yield forks


def run(
    server: ForkServer,
    tmp_path: Path,
    ranks: list[tuple[int, int]],
    old: int,
    new: int,
    crash: bool = False,
    cache: Path | None = None,
):
    """``ranks``: (old rank or -1, new rank or -1) per process. ``cache``: persist every step
    there."""
    env = {"EFDL_SYNC_BUCKET_MB": "1"}
    if crash:
        env["RESHARD_CRASH"] = "1"
    if cache is not None:
        env |= {
            "EFDL_CACHE_URL": str(cache),
            "EFDL_CACHE_EVERY_STEPS": "1",
            "EFDL_CACHE_EVERY": "0",
        }
    args = [
        [str(old), str(a), str(new), str(b), str(tmp_path), str(tmp_path / f"out{i}.json")]
        for i, (a, b) in enumerate(ranks)
    ]
    server.run_ranks(SCRIPT, args, env, timeout_s=150)
    return [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(len(ranks))]


JOIN = "join 2 -> 3"
CASES = {
    JOIN: (2, 3, [(0, 0), (1, 1), (-1, 2)]),
    "leave 3 -> 2 (the middle rank; the others change places)": (3, 2, [(0, 1), (1, -1), (2, 0)]),
    "join and leave 3 -> 3": (3, 3, [(0, 0), (1, -1), (2, 2), (-1, 1)]),
    "shrink 4 -> 1": (4, 1, [(0, -1), (1, -1), (2, 0), (3, -1)]),
}


@pytest.fixture(scope="module")
def joined(server: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The join 2 -> 3 run: two tests read it."""
    old, new, ranks = CASES[JOIN]
    return run(server, tmp_path_factory.mktemp("join"), ranks, old, new)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_the_new_world_holds_the_old_state_bit_for_bit(
    server: ForkServer, tmp_path: Path, request: pytest.FixtureRequest, case: str
) -> None:
    old, new, ranks = CASES[case]
    if case == JOIN:
        results = request.getfixturevalue("joined")
    else:
        results = run(server, tmp_path, ranks, old, new)
    staying = [r for (a, b), r in zip(ranks, results, strict=True) if b >= 0]
    assert len(staying) == new
    for r in staying:
        assert "error" not in r, r.get("traceback")
        assert r["same"] == r["keys"] and len(r["keys"]) > 20  # every tensor, bit for bit
        assert r["step"] == 3 and r["optimizer_on_model"] and r["trained"]
        # Memory: its rows before and after, a bucket, and the allocator's slack; never the
        # whole state (76 MB) where the world is larger than one.
        state = r["state_bytes"]
        assert r["grew"] < state / old + state / new + 8 * MB, (r["grew"], state)
    newcomers = [r for (a, _), r in zip(ranks, results, strict=True) if a < 0]
    assert all(r["received"] > 0 for r in newcomers)


@pytest.mark.timeout(200)
def test_a_survivor_that_keeps_its_place_receives_only_its_new_rows(joined: list[dict]) -> None:
    results = joined  # ranks (0, 0), (1, 1), (-1, 2): 0 and 1 keep their places
    # The state is sent once in all (each row to the one rank that needs it): what ranks
    # receive adds up to what they send, and a rank never receives its whole state.
    assert sum(r["received"] for r in results) == sum(r["sent"] for r in results)
    total = sum(r["received"] for r in results)
    assert results[0]["received"] == 0  # its new rows are a part of its old ones
    assert results[1]["received"] < total


@pytest.mark.timeout(200)
def test_a_crash_that_takes_rows_nobody_else_holds_is_a_clear_error(
    server: ForkServer, tmp_path: Path
) -> None:
    results = run(server, tmp_path, [(0, 0), (1, -1), (2, 1)], 3, 2, crash=True)
    for r in (results[0], results[2]):
        assert r["error"].startswith("StateLostError: The job's sharded state is lost")


def check_resumed(results: list[dict[str, object]], cache: Path, old: int, new: int) -> None:
    """Each rank of the new world resumed the cache's newest snapshot, bit for bit, holding
    only its rows (and a part being read) on the way."""
    found = SnapshotStorage(str(cache)).newest()
    assert found is not None
    manifest, _ = found
    assert manifest.world_size == old and manifest.step >= 2
    for r in results:
        assert "error" not in r, r.get("traceback")
        assert r["step"] == manifest.step  # the same step: nothing trained twice or skipped
        assert r["same"] == r["keys"] and len(r["keys"]) > 20
        assert r["optimizer_on_model"] and r["trained"]
        state = r["state_bytes"]
        assert r["grew"] < state / old + state / new + 8 * MB, (r["grew"], state)


@pytest.mark.timeout(200)
def test_a_crash_that_takes_rows_comes_back_from_the_cache_laid_out_anew(
    server: ForkServer, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    results = run(server, tmp_path, [(0, 0), (1, -1), (2, 1)], 3, 2, crash=True, cache=cache)
    check_resumed([results[0], results[2]], cache, 3, 2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1)])
def test_a_job_resumes_from_the_cache_at_another_world_size(
    server: ForkServer, tmp_path: Path, old: int, new: int
) -> None:
    cache = tmp_path / "cache"
    run(server, tmp_path, [(r, -1) for r in range(old)], old, new, cache=cache)  # all leave
    results = run(server, tmp_path, [(-1, r) for r in range(new)], old, new, cache=cache)
    check_resumed(results, cache, old, new)
