"""Breaks of issue 57: a job's quarantine carried up to the host (efdl.fleet.host_holds)."""

from __future__ import annotations

from efdl.fleet.host_holds import agent_prefix, carried_quarantine
from efdl.rendezvous.holds import Hold, HoldKind
from efdl.rendezvous.records import check_id

NOW = 1_800_000_000.0


def test_a_quarantine_of_one_long_named_hosts_agent_does_not_hold_out_another_host() -> None:
    # Two hosts whose ids (valid: up to 128 characters) differ only after character 80, as
    # long FQDNs or pod names may: agent node ids keep only host_id[:80], so an agent of
    # host A reads as one of host B as well, and B is held out of the fleet for A's GPU.
    stem = "node-pool-a100-80gb-" + "x" * 60  # 80 characters
    host_a, host_b = check_id(stem + ".zone-a", "host id"), check_id(stem + ".zone-b", "host id")
    node_of_a = f"{agent_prefix(host_a)}3-ab12"  # as efdl.fleet.spawn names A's agent
    holds = {
        "gpt": {node_of_a: Hold(node_of_a, HoldKind.QUARANTINE, "GPU 3: ECC", NOW - 60, NOW + 3600)}
    }
    assert carried_quarantine(host_a, holds, None, NOW) is not None
    assert carried_quarantine(host_b, holds, None, NOW) is None
