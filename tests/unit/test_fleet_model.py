"""The fleet's records (efdl.fleet.records): round trips, and a sentence for every bad value."""

from __future__ import annotations

import json

import pytest

from efdl.errors import ConfigError
from efdl.fleet.records import FleetGpu, FleetKeys, Host, JobSpec, JobStatus, Phase, describe
from efdl.rendezvous.records import RecordError

KEYS = FleetKeys("prod")
HOST = "ip-10-0-3-17.ec2.internal"


def spec(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(
        job_id="llama-7b",
        argv=("train.py", "--lr", "3e-4"),
        workdir="/srv/code",
        min_workers=8,
        max_workers=64,
        priority=10,
        cache_url="s3://ckpt/llama-7b",
        env=(("NCCL_DEBUG", "WARN"),),
        submitted=1764115200.5,
    )
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def test_keys_stay_under_the_fleet_prefix() -> None:
    assert KEYS.host(HOST) == f"/efdl-fleet/prod/hosts/{HOST}"
    assert KEYS.spec("llama-7b") == "/efdl-fleet/prod/jobs/llama-7b/spec"
    assert FleetKeys.job_of(KEYS.status("llama-7b")) == "llama-7b"
    with pytest.raises(ConfigError, match=r"fleet name '\.\./x'"):
        FleetKeys("../x")


def test_records_round_trip() -> None:
    h = Host(HOST, "10.0.3.17", (FleetGpu(0, "GPU-8a1f"), FleetGpu(1, "GPU-c3d0", True)), "0.1.0")
    assert Host.from_json(h.to_json(), KEYS.host(HOST)) == h
    assert h.usable() == {0}
    s = spec()
    assert JobSpec.from_json(s.to_json(), KEYS.spec(s.job_id)) == s
    st = JobStatus(
        Phase.RUNNING, ((HOST, (0, 1)), ("ip-10-0-3-18.ec2.internal", (7,))), 12.5, "started"
    )
    assert JobStatus.from_json(st.to_json(), KEYS.status("j")) == st
    assert st.size == 3 and describe(st.gpus) == f"{HOST}:0,1 ip-10-0-3-18.ec2.internal:7"
    # the allocator's counts: GPU-seconds and seconds held before `changed`, the last start,
    # the suspensions; a record written before they were kept reads as zeros
    counted = JobStatus(Phase.RUNNING, ((HOST, (0, 1)),), 100.0, "grew", 7200.0, 40.0, 3600.0, 2)
    assert JobStatus.from_json(counted.to_json(), KEYS.status("j")) == counted
    assert counted.attained(130.0) == 7200.0 + 2 * 30 and counted.held(130.0) == 3600.0 + 30
    old = {k: v for k, v in counted.fields().items() if k in ("phase", "gpus", "changed", "reason")}
    back = JobStatus.from_json(json.dumps(old).encode(), KEYS.status("j"))
    assert (back.gpu_s, back.started, back.held_s, back.suspends) == (0.0, 0.0, 0.0, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"argv": ()}, "has no command"),
        ({"argv": ("--job-id", "other", "t.py")}, "starts with the option '--job-id'"),
        ({"workdir": "code"}, "working directory 'code' is not absolute"),
        ({"min_workers": 9, "max_workers": 8}, "--min 9 and --max 8 are not a size"),
        ({"min_workers": 0}, "--min 0"),
        ({"priority": 5000}, "priority 5000 is out of range; expected -1000..1000"),
        ({"env": (("RANK", "3"),)}, "environment variable 'RANK' cannot be set"),
        ({"env": (("A B", "3"),)}, "environment variable 'A B' cannot be set"),
        ({"job_id": "a/b"}, "job id 'a/b' is not allowed"),
    ],
)
def test_a_bad_spec_is_refused_with_a_sentence(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        spec(**change)


def _edit(raw: bytes, **fields: object) -> bytes:
    data = json.loads(raw)
    data.update(fields)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"gpus": [{"index": 0, "uuid": "", "foreign": "no"}]},
            "field 'foreign' is 'no'; expected bool",
        ),
        ({"gpus": [{"index": 0, "uuid": "", "foreign": False}] * 2}, "lists a GPU index twice"),
        ({"address": "a b"}, "field 'address' is 'a b', not a host name"),
        ({"host_id": "other"}, "names host 'other', not the host of its key"),
    ],
)
def test_a_bad_host_record_names_the_field(fields: dict[str, object], message: str) -> None:
    raw = Host(HOST, "10.0.3.17", (FleetGpu(0),)).to_json()
    with pytest.raises(RecordError, match=message):
        Host.from_json(_edit(raw, **fields), KEYS.host(HOST))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"argv": ["train.py", 3]}, "field 'argv' must be a list of strings"),
        ({"argv": ["--etcd-user", "root", "t.py"]}, "starts with the option '--etcd-user'"),
        ({"env": {"A": 1}}, "field 'env' must map names to strings"),
        ({"min_workers": 0}, "field 'min_workers' is 0; expected 1..65536"),
        ({"priority": 5000}, "priority 5000 is out of range"),
        ({"job_id": "other"}, "names job 'other', not the job of its key"),
    ],
)
def test_a_bad_spec_record_names_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        JobSpec.from_json(_edit(spec().to_json(), **fields), KEYS.spec("llama-7b"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"phase": "paused"}, "field 'phase' is 'paused'; expected one of queued, running"),
        ({"gpus": {HOST: [0, "1"]}}, "field 'gpus' has"),
        ({"gpus": {"a/b": [0]}}, "field 'gpus' has 'a/b'"),
        ({"changed": "now"}, "field 'changed' is 'now'"),
        ({"gpu_s": -1}, "field 'gpu_s' is -1.0, outside 0.0"),
        ({"suspends": 1.5}, "field 'suspends' is 1.5; expected int"),
    ],
)
def test_a_bad_status_record_names_the_field(fields: dict[str, object], message: str) -> None:
    raw = JobStatus(Phase.QUEUED).to_json()
    with pytest.raises(RecordError, match=message):
        JobStatus.from_json(_edit(raw, **fields), KEYS.status("j"))
