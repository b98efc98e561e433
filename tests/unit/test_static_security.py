"""Who may reach the etcd a node of the job serves, where its data lives, and the warning for
credentials sent over plain http: the decisions, without a network."""

from __future__ import annotations

import logging
import stat
import uuid
from pathlib import Path

import pytest

from efdl.config import EtcdClientConfig, LaunchConfig, read_job_token
from efdl.errors import ConfigError
from efdl.options import load
from efdl.rendezvous.api import EtcdSettings
from efdl.rendezvous.plaintext import is_loopback, plaintext_endpoints, warn_plaintext
from efdl.rendezvous.served import default_state_dir, job_directory, make_job_directory, refusal

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("addresses", "token", "refused"),
    [
        (("127.0.0.1",), False, False),
        (("::1",), False, False),
        (("127.0.1.1",), False, False),  # Debian's address for the host's own name
        (("10.0.0.5",), False, True),
        (("127.0.0.1", "10.0.0.5"), False, True),  # a name for both: reachable all the same
        (("0.0.0.0",), False, True),  # every interface
        (("10.0.0.5",), True, False),
        ((), False, True),  # does not resolve: not known to be loopback
    ],
)
def test_only_loopback_is_served_without_a_token(
    addresses: tuple[str, ...], token: bool, refused: bool
) -> None:
    why = refusal("node-0:29500", addresses, token, serving=True)
    assert (why is not None) == refused, why
    if why:
        assert why.startswith("Cannot serve the job's etcd at node-0:29500 without a job token")
        assert "EFDL_JOB_TOKEN" in why and "--job-token-file" in why
        assert (addresses[-1] if addresses else "node-0:29500") in why


def test_a_node_that_joins_across_hosts_without_a_token_is_told_why() -> None:
    why = refusal("10.0.0.5:29500", ("10.0.0.5",), False, serving=False)
    assert why is not None and why.startswith("Cannot join the job's etcd at 10.0.0.5:29500")
    assert "EFDL_JOB_TOKEN" in why
    assert refusal("127.0.0.1:29500", ("127.0.0.1",), False, serving=False) is None


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "::1", "[::1]", "localhost", "127.9.9.9"]))
    assert not any(map(is_loopback, ["10.0.0.5", "fd00::5", "etcd-1", "0.0.0.0"]))


def test_plaintext_endpoints_are_those_a_password_reaches_in_clear(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    both = "10.0.0.5:2379,127.0.0.1:2379"
    with_password = EtcdSettings.from_list(both, user="u", password="p")
    assert [e.target for e in plaintext_endpoints(with_password)] == ["10.0.0.5:2379"]
    assert plaintext_endpoints(EtcdSettings.from_list(both)) == ()
    tls = EtcdSettings.from_list(both, user="u", password="p", ca_file=ca)
    assert plaintext_endpoints(tls) == ()
    https = EtcdSettings.from_list("https://10.0.0.5:2379", user="u", password="p")
    assert plaintext_endpoints(https) == ()
    local = EtcdSettings.from_list("127.0.0.1:2379,localhost:2380", user="u", password="p")
    assert plaintext_endpoints(local) == ()


def test_the_plaintext_warning_comes_once_per_endpoints_and_user(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = f"etcd-{uuid.uuid4().hex[:8]}"  # endpoints no other test warned about
    settings = EtcdSettings.from_list(f"{host}:2379", user="alice", password="s3cret")
    with caplog.at_level(logging.WARNING, logger="efdl.rendezvous.etcd_store"):
        assert warn_plaintext(settings)
        assert not warn_plaintext(settings)
        assert not warn_plaintext(EtcdSettings.from_list(f"{host}:2379"))  # no password
    (record,) = caplog.records
    message = record.getMessage()
    assert f"http://{host}:2379" in message and "'alice'" in message
    assert "s3cret" not in message


def test_the_job_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert read_job_token(f, env={"EFDL_JOB_TOKEN": "x" * 20}) == TOKEN
    assert read_job_token(None, env={"EFDL_JOB_TOKEN": "y" * 20}) == "y" * 20
    assert read_job_token(None, env={}) is None
    with pytest.raises(ConfigError, match="EFDL_JOB_TOKEN holds a token of 5 characters"):
        read_job_token(None, env={"EFDL_JOB_TOKEN": "short"})
    with pytest.raises(ConfigError, match="Cannot read the job token file"):
        read_job_token(tmp_path / "missing", env={})


def test_a_job_token_is_etcds_root_password_and_excludes_another_user(tmp_path: Path) -> None:
    env = {"EFDL_JOB_TOKEN": TOKEN, "EFDL_ETCD_PASSWORD": "other"}
    settings = load(EtcdClientConfig, {"etcd": "h:1"}, env={}).etcd_settings(env=env)
    assert (settings.user, settings.password) == ("root", TOKEN)
    f = tmp_path / "token"
    f.write_text(TOKEN)
    cfg = load(EtcdClientConfig, {"etcd": "h:1"}, env={"EFDL_JOB_TOKEN_FILE": str(f)})
    assert cfg.etcd_settings(env={}).password == TOKEN
    with pytest.raises(ConfigError, match=r"Both --etcd-user \('alice'\) and a job token"):
        load(EtcdClientConfig, {"etcd": "h:1", "etcd_user": "alice"}, env={}).etcd_settings(env=env)
    no_token = load(EtcdClientConfig, {"etcd": "h:1"}, env={}).etcd_settings(env={})
    assert (no_token.user, no_token.password) == (None, None)


def test_the_served_etcd_keeps_its_data_in_a_private_directory_of_the_job(tmp_path: Path) -> None:
    assert default_state_dir({"XDG_STATE_HOME": "/x/state"}) == Path("/x/state/efdl")
    assert default_state_dir({}) == Path.home() / ".local" / "state" / "efdl"
    assert default_state_dir({"XDG_STATE_HOME": "relative"}) == default_state_dir({})
    state = tmp_path / "a" / "state"
    made = make_job_directory(state, "job", 29500)
    assert made == job_directory(state, "job", 29500) == state / "etcd" / "job-29500"
    for d in (tmp_path / "a", state, state / "etcd", made):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    made.chmod(0o755)
    assert stat.S_IMODE(make_job_directory(state, "job", 29500).stat().st_mode) == 0o700
    (state / "etcd" / "other-1").write_text("a file where the directory goes")
    with pytest.raises(ConfigError, match="is not a directory"):
        make_job_directory(state, "other", 1)
    cfg = load(LaunchConfig, {"nnodes": "2"}, env={"EFDL_STATE_DIR": str(state)})
    assert cfg.state_dir == state
