"""The agent's metrics: causes, the step rate, and a real scrape over HTTP on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import pytest

from efdl.launcher.metrics import Metrics, cause_of


@pytest.mark.parametrize(
    ("status", "reason", "cause"),
    [
        ("active", "ip-10-0-0-7 joined", "join"),
        ("active", "a, b and 510 more joined again", "join"),
        ("active", "b left", "leave"),
        ("active", "c held out (quarantine: crash loop: workers restarted ...)", "hold"),
        ("active", "b lost workers being replaced", "lost"),
        ("active", "a restarted its workers", "restart"),
        ("waiting", "b left; waiting: 1 of 2 workers", "wait"),
        ("active", "the workers per node changed", "other"),
    ],
)
def test_causes(status: str, reason: str, cause: str) -> None:
    assert cause_of(status, reason) == cause


def test_scrape_shows_what_was_set() -> None:
    m = Metrics("resnet-50", "ip-10-0-12-34.eu-west-1.compute.internal")
    port = m.serve("127.0.0.1", 0)
    try:
        m.generation.set(7)
        m.rescales.labels("join").inc()
        m.stood_still.observe(0.3)
        m.progress(100, at=10.0)
        m.progress(150, at=12.0)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        m.close()
    text = body.decode()
    assert "efdl_generation 7.0" in text
    assert 'efdl_rescales_total{cause="join"} 1.0' in text
    assert 'efdl_rescales_total{cause="leave"} 0.0' in text
    assert 'efdl_stood_still_seconds_bucket{le="0.5"} 1.0' in text
    assert "efdl_last_committed_step 150.0" in text
    assert "efdl_steps_per_second 25.0" in text
    assert 'node="ip-10-0-12-34.eu-west-1.compute.internal"' in text
