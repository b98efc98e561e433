"""The timeline picture of a job's history, drawn from synthetic events."""

from __future__ import annotations

from pathlib import Path

import pytest

from efdl.errors import ConfigError
from efdl.rendezvous.records import Event, EventKind
from efdl.timeline import draw, world_steps

EVENTS = [
    Event(100.0, EventKind.JOIN, "a", 0, "joined"),
    Event(101.0, EventKind.ROUND, "a", 1, "active: a joined", 1),
    Event(110.0, EventKind.JOIN, "b", 1, "joined"),
    Event(111.0, EventKind.ROUND, "a", 2, "active: b joined", 2),
    Event(111.3, EventKind.RESCALE, "a", 2, "went on", 2, 80, 0.3),
    Event(120.0, EventKind.CRASH, "b", 2, "worker rank 1 failed"),
    Event(120.1, EventKind.ROUND, "a", 3, "waiting: 1 of 2 workers", 1),
    Event(125.0, EventKind.ROUND, "a", 4, "active: c joined", 2),
]


def test_world_size_follows_the_rounds() -> None:
    # In place the new size counts from rank 0's first step at it (the rescale event).
    assert world_steps(EVENTS) == [(101.0, 1), (111.3, 2), (120.1, 0), (125.0, 2)]


def test_draws_a_png(tmp_path: Path) -> None:
    out = draw(EVENTS, tmp_path / "sub" / "job.png", "job resnet")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_nothing_to_draw_is_said(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no rounds in its history"):
        draw(EVENTS[:1], tmp_path / "x.png", "job empty")
