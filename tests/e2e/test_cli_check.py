"""`efdl check` as a user runs it: a real process, a real (embedded) etcd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from efdl._process import free_port
from efdl.rendezvous.embedded import EmbeddedEtcd


def efdl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "efdl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_check_standalone_starts_and_stops_its_own_etcd() -> None:
    result = efdl("check", "--standalone")
    assert result.returncode == 0, result.stderr
    assert "works for efdl" in result.stdout
    assert "key removed with its lease" in result.stdout and "yes" in result.stdout
    assert "rendezvous: 2 agents form a round" in result.stdout
    assert "INFO]" not in result.stderr, result.stderr  # the table alone (-v: the steps too)
    verbose = efdl("-v", "check", "--standalone")
    assert verbose.returncode == 0 and "INFO]" in verbose.stderr, verbose.stderr


def test_check_against_a_running_etcd(etcd_server: EmbeddedEtcd) -> None:
    result = efdl("check", "--etcd", etcd_server.endpoint.target)
    assert result.returncode == 0, result.stderr
    assert etcd_server.endpoint.target in result.stdout


def test_check_unreachable_endpoint_exits_2_naming_it() -> None:
    port = free_port()
    result = efdl("check", "--etcd", f"127.0.0.1:{port}", "--etcd-timeout", "1")
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_check_bad_endpoint_and_bad_yaml(tmp_path: Path) -> None:
    result = efdl("check", "--etcd", "no-port-here")
    assert result.returncode == 2 and "'no-port-here' is not of the form host:port" in result.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("etcd_timout: 3\n")
    result = efdl("check", "--config", str(cfg), "--etcd", "127.0.0.1:1")
    assert result.returncode == 2 and "Unknown key 'etcd_timout'" in result.stderr
