"""Config layering (flag > env > YAML > default) and validation, with no network."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from efdl.config import EtcdClientConfig, LaunchConfig, read_password
from efdl.errors import ConfigError
from efdl.launcher.warm import default_warm
from efdl.options import load, read_yaml
from efdl.rendezvous.api import Endpoint, EtcdSettings


@dataclass(frozen=True, slots=True)
class Sample:
    lease_ttl_s: float = 5.0
    max_restarts: int = 3
    tee: bool = False
    job_id: str | None = None


def test_precedence_flag_env_yaml_default() -> None:
    yaml_data = {"lease-ttl": 7, "max_restarts": 9, "tee": True, "job_id": "from-yaml"}
    env = {"EFDL_LEASE_TTL": "6", "EFDL_JOB_ID": "from-env"}
    cfg = load(Sample, {"lease_ttl_s": 4.5, "job_id": None}, env=env, yaml_data=yaml_data)
    assert cfg == Sample(lease_ttl_s=4.5, max_restarts=9, tee=True, job_id="from-env")
    assert load(Sample, {}, env={}) == Sample()


def test_unknown_yaml_key_names_the_key_and_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"Unknown key 'lease_tll' in job.yaml; known keys: .*lease-ttl"
    ):
        load(Sample, {}, env={}, yaml_data={"lease_tll": 3}, yaml_source="job.yaml")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"env": {"EFDL_MAX_RESTARTS": "three"}},
            r"EFDL_MAX_RESTARTS is 'three'; expected a whole number",
        ),
        (
            {"yaml": {"tee": "maybe"}},
            r"'tee' in the config file is 'maybe'; expected true or false",
        ),
        ({"yaml": {"max_restarts": 2.5}}, r"expected a whole number"),
        ({"flags": {"lease_ttl_s": "soon"}}, r"--lease-ttl is 'soon'; expected a number"),
    ],
)
def test_bad_values_name_the_value_and_the_type(
    source: dict[str, dict[str, object]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load(
            Sample,
            source.get("flags", {}),
            env=source.get("env", {}),  # type: ignore[arg-type]
            yaml_data=source.get("yaml"),
        )


def test_a_bad_yaml_value_names_the_key_as_the_user_wrote_it() -> None:
    with pytest.raises(ConfigError, match=r"^'min' in job.yaml is 'two'; expected a whole"):
        load(LaunchConfig, {}, env={}, yaml_data={"min": "two"}, yaml_source="job.yaml")
    with pytest.raises(ConfigError, match=r"^'lease-ttl' in job.yaml is 'x'; expected a whole"):
        load(LaunchConfig, {}, env={}, yaml_data={"lease-ttl": "x"}, yaml_source="job.yaml")


def test_read_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("lease_ttl: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' is not valid YAML at line"):
        read_yaml(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping.*holds a list"):
        read_yaml(listy)
    with pytest.raises(ConfigError, match="Cannot read the config file"):
        read_yaml(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert read_yaml(empty) == {}


def test_password_from_file_then_env_never_flag(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("s3cret\n")
    assert read_password(f, env={"EFDL_ETCD_PASSWORD": "env"}) == "s3cret"
    assert read_password(None, env={"EFDL_ETCD_PASSWORD": "env"}) == "env"
    assert read_password(None, env={}) is None
    with pytest.raises(ConfigError, match="Cannot read the etcd password file"):
        read_password(tmp_path / "nope", env={})


def test_etcd_client_config_builds_settings(tmp_path: Path) -> None:
    cfg = load(EtcdClientConfig, {"etcd": "a:2379,b:2380", "etcd_user": "root"}, env={})
    settings = cfg.etcd_settings(env={"EFDL_ETCD_PASSWORD": "pw"})
    assert [e.target for e in settings.endpoints] == ["a:2379", "b:2380"]
    assert settings.user == "root" and settings.password == "pw"
    assert "pw" not in repr(settings)
    with pytest.raises(ConfigError, match="needs both a user and a password"):
        cfg.etcd_settings(env={})
    with pytest.raises(ConfigError, match="No etcd endpoints were given"):
        EtcdClientConfig().etcd_settings(env={})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("etcd-1:2379", Endpoint("etcd-1", 2379)),
        ("http://10.0.0.5:2379/", Endpoint("10.0.0.5", 2379)),
        ("https://etcd:2379", Endpoint("etcd", 2379, tls=True)),
        ("[::1]:2379", Endpoint("::1", 2379)),
    ],
)
def test_endpoint_parse(text: str, expected: Endpoint) -> None:
    assert Endpoint.parse(text) == expected


@pytest.mark.parametrize(
    "text", ["etcd", "etcd:", "etcd:0", "etcd:70000", "::1:2379", "h:2379x", ""]
)
def test_endpoint_parse_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="is not of the form host:port"):
        Endpoint.parse(text)


def test_endpoint_target_and_str() -> None:
    assert Endpoint("::1", 2379).target == "[::1]:2379"
    assert str(Endpoint("h", 1, tls=True)) == "https://h:1"


def test_settings_validation(tmp_path: Path) -> None:
    ep = (Endpoint("h", 1),)
    with pytest.raises(ConfigError, match="No etcd endpoint"):
        EtcdSettings(())
    with pytest.raises(ConfigError, match="needs its key"):
        EtcdSettings(ep, cert_file=tmp_path / "c.pem")
    with pytest.raises(ConfigError, match=r"The etcd TLS CA file '.*ca.pem' does not exist"):
        EtcdSettings(ep, ca_file=tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match=r"request_timeout_s \(0\) must be greater than zero"):
        EtcdSettings(ep, request_timeout_s=0)
    assert EtcdSettings(ep, ca_file=None).tls is False
    assert EtcdSettings((Endpoint("h", 1, tls=True),)).tls is True


def test_launch_config_maps_torchrun_nnodes_to_workers() -> None:
    from efdl.cli.launching import _policy
    from efdl.config import LaunchConfig

    cfg = load(LaunchConfig, {"standalone": True, "nnodes": "2:4"}, env={})
    assert cfg.node_range() == (2, 4)
    p = _policy(cfg, slots=8)
    assert (p.min_workers, p.max_workers) == (16, 32)
    only_min = _policy(load(LaunchConfig, {"standalone": True, "min_workers": 3}, env={}), 1)
    assert only_min.min_workers == 3 and only_min.max_workers >= 1_000_000
    alone = _policy(load(LaunchConfig, {"standalone": True}, env={}), 2)
    assert (alone.min_workers, alone.max_workers) == (2, 2)  # torchrun's default: this node
    with pytest.raises(ConfigError, match="expected N or MIN:MAX"):
        load(LaunchConfig, {"standalone": True, "nnodes": "two"}, env={})
    assert load(LaunchConfig, {"etcd": "h:1"}, env={}).job_id == "none"  # torchrun's default


def test_no_etcd_and_one_node_is_standalone_as_torchrun_runs_it() -> None:
    """torchrun runs `--nproc-per-node 2 train.py` (no rendezvous) and `--nnodes 1`: so does
    efdl-run, standalone (the store on --master-port). More nodes without etcd are torchrun's
    static rendezvous: an etcd that the node of --node-rank 0 serves at --master-addr and
    --master-port (torchrun's defaults 127.0.0.1 and 29500)."""
    from efdl.config import LaunchConfig

    for flags in ({}, {"nnodes": "1"}, {"nnodes": "1:1", "store_port": 29600}):
        cfg = load(LaunchConfig, flags, env={})
        assert cfg.standalone and not cfg.etcd and not cfg.serve_etcd, flags
    assert load(LaunchConfig, {"master_port": 29601}, env={}).store_port == 29601
    assert not load(LaunchConfig, {"etcd": "h:1", "job_id": "j"}, env={}).standalone
    assert not load(LaunchConfig, {}, env={"EFDL_ETCD": "h:1", "EFDL_JOB_ID": "j"}).standalone
    first = load(LaunchConfig, {"nnodes": "2", "master_addr": "10.0.0.5"}, env={})
    assert (first.etcd, first.serve_etcd, first.standalone) == ("10.0.0.5:29500", True, False)
    other = load(LaunchConfig, {"nnodes": "1:4", "node_rank": 3, "master_port": 29555}, env={})
    assert (other.etcd, other.serve_etcd, other.job_id) == ("127.0.0.1:29555", False, "none")
    v6 = load(LaunchConfig, {"nnodes": "2", "master_addr": "fd00::5"}, env={})
    assert v6.etcd == "[fd00::5]:29500"
    with pytest.raises(ConfigError, match=r"--node-rank \(-1\) must not be negative"):
        load(LaunchConfig, {"nnodes": "2", "node_rank": -1}, env={})


def test_cache_options_from_flags_env_and_yaml_and_their_checks(tmp_path: Path) -> None:
    from efdl.config import LaunchConfig
    from efdl.worker.cache import CacheSettings

    cfg = load(
        LaunchConfig,
        {"standalone": True, "cache_every_steps": 5},
        env={"EFDL_CACHE_KEEP": "3"},
        yaml_data={"cache-url": "s3://b/job", "cache_every": 0},
    )
    assert (cfg.cache_url, cfg.cache_every_steps, cfg.cache_every_s, cfg.cache_keep) == (
        "s3://b/job",
        5,
        0.0,
        3,
    )
    assert cfg.cache_for("j") == "s3://b/job"
    settings = CacheSettings("s3://b/job", 5, 0.0, 3)
    assert CacheSettings.from_env(settings.to_env()) == settings  # what the workers get
    assert CacheSettings.from_env({}) is None
    # --standalone keeps its cache under the job's log dir; a multi-node job needs a URL.
    logs = load(LaunchConfig, {"standalone": True, "log_dir": tmp_path}, env={})
    assert logs.cache_for("j") == str(tmp_path / "j" / "cache")
    assert load(LaunchConfig, {"standalone": True}, env={}).cache_for("j") is None
    assert (
        load(LaunchConfig, {"etcd": "h:1", "job_id": "j", "log_dir": tmp_path}, env={}).cache_for(
            "j"
        )
        is None
    )
    for flags, message in (
        ({"cache_keep": 0}, r"--cache-keep \(0\) must be at least 1"),
        ({"cache_every_steps": -1}, r"--cache-every-steps \(-1\)"),
        ({"cache_url": " "}, "--cache-url is empty"),
        ({"peer_copies": -1}, r"--peer-copies \(-1\) must be a number of commits"),
    ):
        with pytest.raises(ConfigError, match=message):
            load(LaunchConfig, {"standalone": True, **flags}, env={})
    with pytest.raises(ConfigError, match="EFDL_CACHE"):
        CacheSettings.from_env({"EFDL_CACHE_URL": "/x", "EFDL_CACHE_KEEP": "many"})


def test_warm_workers_default_and_bad_values() -> None:
    base = {"standalone": True}
    assert load(LaunchConfig, base, env={}).warm_workers is None  # see default_warm
    assert load(LaunchConfig, base, env={"EFDL_WARM_WORKERS": "0"}).warm_workers == 0
    with pytest.raises(ConfigError, match=r"--warm-workers \(-1\) must not be negative"):
        load(LaunchConfig, {**base, "warm_workers": -1}, env={})


def test_workers_are_forked_by_default_where_a_core_can_be_spared() -> None:
    assert default_warm(slots=8, gpus=True, cpus=16) == 1  # a GPU node
    assert default_warm(slots=2, gpus=False, cpus=8) == 1  # 4 cores per slot
    assert default_warm(slots=2, gpus=False, cpus=2) == 0  # the workers' own cores
