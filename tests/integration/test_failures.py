"""Failures classified by what torch raises, not by hand-typed messages: two real gloo ranks,
a real failure each time (a peer killed, a collective timed out, the store's host gone,
efdl's own breaker cutting the group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from efdl.worker.failure import Failure
from tests.integration.ranks import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "failures.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "rank", "kind"),
    [
        ("kill", 0, Failure.PEER),  # its peer's connections closed
        ("timeout", 0, Failure.TIMEOUT),  # connections up, nobody came
        ("store", 1, Failure.PEER),  # DistNetworkError, not the wait's timeout
        ("cut", 0, Failure.PEER),  # efdl's record, whatever gloo says of the cut
    ],
)
def test_a_real_failure_is_classified(tmp_path: Path, mode: str, rank: int, kind: Failure) -> None:
    run_ranks(SCRIPT, [[str(r), mode, str(tmp_path)] for r in range(2)])
    seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
    assert seen["verdict"] == kind, seen
    assert seen["cut"] == (mode == "cut"), seen  # efdl's own record, not gloo's words
