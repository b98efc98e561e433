"""A job's quarantine of an agent carried up to its host in the fleet
(efdl.fleet.host_holds.carried_quarantine, pure)."""

from __future__ import annotations

from efdl.fleet.host_holds import agent_prefix, carried_quarantine
from efdl.rendezvous.holds import Hold, HoldKind

HOST = "gpu-7.us-central1-a.c.proj.internal"
NOW = 1_800_000_000.0


def quarantine(node: str, until: float, reason: str = "GPU 3: 2 uncorrectable ECC errors") -> Hold:
    return Hold(node, HoldKind.QUARANTINE, reason, NOW - 60, until)


def test_an_agent_quarantined_in_a_job_holds_its_host_until_the_quarantine_ends() -> None:
    node = f"{agent_prefix(HOST)}3-ab12"
    holds = {"gpt": {node: quarantine(node, NOW + 3600)}}
    h = carried_quarantine(HOST, holds, None, NOW)
    assert h is not None and h.node == HOST and h.kind is HoldKind.QUARANTINE
    assert h.until == NOW + 3600 and h.since == NOW
    assert h.reason == f"job gpt quarantined its node {node}: GPU 3: 2 uncorrectable ECC errors"


def test_the_quarantine_that_ends_last_is_carried_and_one_as_long_is_not_written_again() -> None:
    a, b = f"{agent_prefix(HOST)}0-aaaa", f"{agent_prefix(HOST)}1-bbbb"
    holds = {"gpt": {a: quarantine(a, NOW + 600)}, "bert": {b: quarantine(b, NOW + 7200)}}
    h = carried_quarantine(HOST, holds, None, NOW)
    assert h is not None and h.until == NOW + 7200 and "job bert" in h.reason
    assert carried_quarantine(HOST, holds, h, NOW + 5) is None  # in force already
    shorter = Hold(HOST, HoldKind.QUARANTINE, "x", NOW - 10, NOW + 600)
    assert carried_quarantine(HOST, holds, shorter, NOW) is not None  # lengthened
    drained = Hold(HOST, HoldKind.DRAIN, "maintenance", NOW - 10, None)
    assert carried_quarantine(HOST, holds, drained, NOW) is None  # a drain holds it already


def test_no_hold_from_other_hosts_drains_ended_quarantines_or_a_longer_host_name() -> None:
    other = f"{agent_prefix('gpu-70.us-central1-a.c.proj.internal')}0-cccc"
    mine = f"{agent_prefix(HOST)}2-dddd"
    holds = {
        "gpt": {
            other: quarantine(other, NOW + 3600),
            mine: Hold(mine, HoldKind.DRAIN, "by hand", NOW - 10, None),
        },
        "bert": {f"{agent_prefix(HOST)}4-eeee": quarantine("x", NOW - 1)},  # ended
    }
    assert carried_quarantine(HOST, holds, None, NOW) is None
    longer = f"{agent_prefix(HOST + '-g0')}1-ffff"  # host <HOST>-g0's agent begins <HOST>-g
    holds = {"gpt": {longer: quarantine(longer, NOW + 3600)}}
    assert carried_quarantine(HOST, holds, None, NOW) is None
    assert carried_quarantine(HOST + "-g0", holds, None, NOW) is not None
    assert carried_quarantine(HOST, holds, None, NOW) is None
