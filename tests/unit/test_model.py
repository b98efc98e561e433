"""Records read from etcd are untrusted: bad ones are refused with a sentence."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from efdl.errors import ConfigError
from efdl.rendezvous.records import (
    GpuInfo,
    JobKeys,
    Member,
    NodeRecord,
    RecordError,
    Round,
    RoundStatus,
    check_id,
)

GOOD = NodeRecord(
    "n1",
    "10.0.0.1",
    29500,
    2,
    (GpuInfo(0, "H100", 81559), GpuInfo(1, "H100", 81559)),
    16,
    "0.1.0",
    1.0,
)


def test_node_record_roundtrip() -> None:
    assert NodeRecord.from_json(GOOD.to_json(), "/efdl/j/nodes/n1") == GOOD
    one_down = replace(GOOD, down=1, incarnation=4, probe_port=40123)
    assert NodeRecord.from_json(one_down.to_json(), "/efdl/j/nodes/n1") == one_down
    assert one_down.offered == 1
    older = json.loads(GOOD.to_json())  # an agent that never wrote 'down'
    del older["down"], older["probe_port"]  # nor 'probe_port': it is never probed
    parsed = NodeRecord.from_json(json.dumps(older).encode(), "/efdl/j/nodes/n1")
    assert (parsed.down, parsed.probe_port) == (0, 0)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("host"), "has no field 'host'"),
        (lambda d: d.update(slots=0), r"field 'slots' is 0; expected 1..4096"),
        (lambda d: d.update(slots="2"), r"field 'slots' is '2'; expected int"),
        (lambda d: d.update(store_port=70000), r"'store_port' is 70000"),
        (lambda d: d.update(gpus=[{"index": -1, "model": "x", "memory_mb": 1}]), r"gpus\[0\]"),
        (lambda d: d.update(node_id="n2"), "names node 'n2', not the node of its key"),
        (lambda d: d.update(host="x" * 300), "longer than 256"),
        (
            lambda d: d.update(host="$(touch /tmp/x)"),
            "'host' is '\\$\\(touch /tmp/x\\)', not a host",
        ),
        (lambda d: d.update(slots=10**9), r"field 'slots' is 1000000000; expected 1..4096"),
        (lambda d: d.update(down=3), r"field 'down' is 3; expected 0..2"),
        (lambda d: d.update(down=-1), r"field 'down' is -1; expected 0..2"),
        (lambda d: d.update(probe_port=65536), r"field 'probe_port' is 65536; expected 0..65535"),
        (lambda d: d.update(probe_port="1"), r"field 'probe_port' is '1'; expected int"),
    ],
)
def test_bad_node_records(mutate: object, message: str) -> None:
    data = json.loads(GOOD.to_json())
    mutate(data)  # type: ignore[operator]
    with pytest.raises(RecordError, match=message):
        NodeRecord.from_json(json.dumps(data).encode(), "/efdl/j/nodes/n1")


@pytest.mark.parametrize("raw", [b"not json", b"[1,2]", b"\xff\xfe", b"null"])
def test_garbage_is_a_record_error(raw: bytes) -> None:
    with pytest.raises(RecordError, match="/efdl/j/nodes/n1"):
        NodeRecord.from_json(raw, "/efdl/j/nodes/n1")


def test_bad_rounds() -> None:
    good = json.loads(
        Round(3, RoundStatus.ACTIVE, world_size=2, nodes=1, head="a", round_id="x").to_json()
    )
    for mutate, message in [
        (lambda d: d.update(status="running"), "status 'running'; expected one of active"),
        (lambda d: d.update(nodes=3), "active with 3 nodes, 2 workers"),
        (lambda d: d.update(head=""), "and a head node"),
        (lambda d: d.update(generation=0), "'generation' is 0"),
        (lambda d: d.update(members_revision=-1), "'members_revision' is -1"),
    ]:
        data = dict(good)
        mutate(data)
        with pytest.raises(RecordError, match=message):
            Round.from_json(json.dumps(data).encode(), "/efdl/j/round")


def test_bad_members() -> None:
    good = Member("a", 2, 4, "10.0.0.1", 0, 17, 1, 3, "x")
    assert Member.from_json(good.to_json(), "/efdl/j/members/a") == good
    for patch, message in [
        ({"node_id": "b"}, "names node 'b', not the node of its key"),
        ({"workers": 0}, "'workers' is 0"),
        ({"revision": -1}, "'revision' is -1"),
        ({"round_id": 5}, "'round_id' is 5; expected str"),
    ]:
        data = {**json.loads(good.to_json()), **patch}
        with pytest.raises(RecordError, match=message):
            Member.from_json(json.dumps(data).encode(), "/efdl/j/members/a")


@pytest.mark.parametrize("job_id", ["a/b", "..", "a..b", "", "/abs", "-x", "x" * 200, "a b"])
def test_ids_that_would_escape_their_prefix_are_refused(job_id: str) -> None:
    with pytest.raises(ConfigError, match=r"The job id .* is not allowed"):
        check_id(job_id)
    with pytest.raises(ConfigError, match=r"The node id .* is not allowed"):
        check_id(job_id, "node id")


def test_job_keys_stay_under_the_job_prefix() -> None:
    k = JobKeys("resnet-50.v2")
    assert k.prefix == "/efdl/resnet-50.v2/"
    assert all(
        x.startswith(k.prefix)
        for x in (k.nodes, k.members, k.round, k.node("n1"), k.member("n1"), k.failures, k.cache)
    )


def test_cache_record_roundtrip_and_hostile_values() -> None:
    from efdl.rendezvous.records import CacheRecord

    good = CacheRecord(120, 3, 4, "s3://b/j", 1.5)
    assert CacheRecord.from_json(good.to_json(), "/efdl/j/cache") == good
    for patch, message in (
        ({"step": -1}, "'step'"),
        ({"step": True}, r"field .step. is True; expected int"),
        ({"epoch": "3"}, "'epoch'"),
        ({"world_size": 0}, "'world_size'"),
        ({"url": 7}, "'url'"),
    ):
        data = json.loads(good.to_json())
        data.update(patch)
        with pytest.raises(RecordError, match=message):
            CacheRecord.from_json(json.dumps(data).encode(), "/efdl/j/cache")
    with pytest.raises(RecordError, match="not valid JSON"):
        CacheRecord.from_json(b"{", "/efdl/j/cache")


def fleet_ids(n: int) -> list[str]:
    """Cloud host names padded to 64 characters, the longest node ids users have."""
    return [
        f"ip-10-{i // 256}-{i % 256}-34.us-west-2.compute.internal-{i:06x}".ljust(64, "z")
        for i in range(n)
    ]


def test_a_round_of_4096_nodes_is_well_inside_etcds_request_limit_and_reads_back() -> None:
    """What efdl writes, efdl reads: at 4096 nodes of 8 workers with 64-character ids, the
    round and every member's record, none of which grows with the fleet."""
    from efdl.rendezvous.decide import JobView, NodeView, Policy, decide

    ids = fleet_ids(4096)
    nodes = {
        n: NodeView(
            NodeRecord(n, f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 29500, 8, incarnation=3),
            joined_revision=1_000_000 + i,
        )
        for i, n in enumerate(ids)
    }
    policy = Policy(1, 8 * 4096, settle_s=1)
    first = decide(JobView(nodes, None, last_change=0.0, leader=ids[0]), policy, 10.0)
    assert first.round is not None and first.round.world_size == 8 * 4096
    raw = first.round.to_json()
    # Every agent watches the round: it does not grow with the fleet.
    assert len(raw) < 1024, f"{len(raw)} bytes"
    assert Round.from_json(raw, "/efdl/j/round") == first.round
    assert len(first.members) == 4096
    for m in first.members:
        raw = m.to_json()
        assert len(raw) < 512, f"{len(raw)} bytes"
        assert Member.from_json(raw, f"/efdl/j/members/{m.node_id}") == m
    # A crash of half the fleet: the next round (and its reason) stay as small.
    half = {n: v for i, (n, v) in enumerate(nodes.items()) if i % 2}
    view = JobView(half, first.round, last_change=0.0, leader=ids[1], members=first.members)
    second = decide(view, policy, 20.0).round
    assert second is not None and len(second.reason) < 400 and len(second.to_json()) < 1024
    assert Round.from_json(second.to_json(), "/efdl/j/round") == second


def test_a_node_record_with_8_gpus_and_a_64_character_id_reads_back() -> None:
    gpus = tuple(
        GpuInfo(i, "NVIDIA H100 80GB HBM3", 81559, f"GPU-{i:08x}-1111-2222-3333-{i:012x}")
        for i in range(8)
    )
    record = NodeRecord(fleet_ids(1)[0], "10.0.0.1", 29500, 8, gpus, 192, "0.1.0", 1.0)
    raw = record.to_json()
    assert len(raw) < 4096
    assert NodeRecord.from_json(raw, f"/efdl/j/nodes/{record.node_id}") == record
