"""Breaks of issue 57: the node's own collective's deadline (efdl.launcher.collective)."""

from __future__ import annotations

import time

import pytest

from efdl.launcher import collective


@pytest.mark.timeout(90)
def test_a_hung_collective_is_killed_at_the_health_check_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/operating.md: the collective's program is "killed at --health-check-timeout".
    # A program that hangs (a wedged driver, an NCCL init that never returns) stands here
    # as `sleep`: check() gives it --health-check-timeout + 30 s, and then says it "did not
    # finish in 1 s".
    monkeypatch.setattr(collective, "command", lambda ranks, gpus, timeout_s: "sleep 120")
    t0 = time.monotonic()
    found = collective.check(2, (), 1.0)
    took = time.monotonic() - t0
    assert found is not None and "did not finish in 1 s" in found.reason
    assert took < 6, f"the hung collective ran {took:.0f} s under --health-check-timeout 1"
