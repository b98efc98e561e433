"""How efdl node starts an agent (efdl.fleet.launch, efdl.fleet.sandbox, efdl.fleet.wrap),
without etcd: no shell, the job's command after ``--`` and nothing in it read as an option,
the daemon's etcd settings kept out of the agent's environment, the uid picked for a job, and
the wrapper that records the exit code."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from efdl.cli.run import run_main
from efdl.config import LaunchConfig
from efdl.errors import ConfigError
from efdl.fleet import sandbox
from efdl.fleet.launch import (
    EFDL_RUN,
    FLEET_JOIN_TIMEOUT_S,
    EtcdAccess,
    agent_argv,
    agent_env,
    split_command,
    wrapped,
)
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.records import JobSpec
from efdl.fleet.sandbox import UidRange, job_uids, pick_uid
from efdl.options import load
from tests.wait import wait_until

HOSTILE = ("train.py", "--etcd", "evil:2379", "--job-id", "other", "-", "$(id); `id` | x > y &")
ACCESS = EtcdAccess(
    "https://etcd-1:2379",
    Path("/run/a/etcd-ca.pem"),
    user="efdl-agent.h.1",
    password_file=Path("/run/a/etcd-password"),
)


def argv_of(command: tuple[str, ...]) -> list[str]:
    return agent_argv("job-a", command, 1, 4, "", (3,), "h-g3-ab12", "10.0.0.1", ACCESS)


def test_the_jobs_command_comes_after_double_dash_as_it_is() -> None:
    argv = argv_of(HOSTILE)
    assert argv[: len(EFDL_RUN)] == list(EFDL_RUN) and "/bin/sh" not in argv
    cut = argv.index("--")
    assert tuple(argv[cut + 1 :]) == HOSTILE
    options = argv[len(EFDL_RUN) : cut]
    assert options[options.index("--job-id") + 1] == "job-a"
    assert options[options.index("--etcd") + 1] == "https://etcd-1:2379"
    assert options[options.index("--etcd-user") + 1] == "efdl-agent.h.1"
    assert "--etcd-password-file" in options and not any("password=" in o for o in options)


def test_efdl_run_reads_the_daemons_options_and_passes_the_command_on_literally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """efdl-run's own parser, on the argv the daemon builds: the spec's '--etcd' and
    '--job-id' are the script's arguments, not efdl-run's options."""
    seen: list[tuple[object, list[str]]] = []
    monkeypatch.setattr("efdl.cli.run.launch", lambda cfg, args: seen.append((cfg, args)) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    argv = agent_argv("job-a", HOSTILE, 1, 4, "", (3,), "h-g3-ab12", "10.0.0.1", EtcdAccess("e:1"))
    result = CliRunner().invoke(run_main, argv[len(EFDL_RUN) :], env={"EFDL_JOB_ID": "x"})
    assert result.exit_code == 0, result.output
    ((cfg, args),) = seen
    assert args == [sys.executable, *HOSTILE]
    assert cfg.job_id == "job-a" and cfg.etcd == "e:1"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (("-m", "pkg.train", "--lr", "1"), ("-m",)),
        (("--no-python", "/usr/bin/env", "-i"), ("--no-python",)),
        (("train.py", "-m", "x"), ()),
    ],
)
def test_the_flags_that_shape_a_command_go_before_double_dash(
    command: tuple[str, ...], flags: tuple[str, ...]
) -> None:
    argv = argv_of(command)
    cut = argv.index("--")
    assert tuple(argv[cut - len(flags) : cut]) == flags
    assert tuple(argv[cut + 1 :]) == command[len(flags) :]


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ((), "has no command"),
        (("-m",), "has no command"),
        (("--job-id", "other", "train.py"), "starts with the option '--job-id'"),
        (("--etcd-password-file", "/etc/efdl/pw", "t.py"), "'--etcd-password-file'"),
        (("-m", "-c", "import os"), "starts with the option '-c'"),
        (("--", "t.py"), "starts with the option '--'"),
    ],
)
def test_a_command_that_starts_with_another_option_is_refused(
    command: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=f"Job 'job-a'.*{message}"):
        split_command("job-a", command)
    with pytest.raises(ConfigError, match=message):
        JobSpec("job-a", command, "/srv", 1, 1)


def test_the_daemons_etcd_settings_never_reach_the_agent(tmp_path: Path) -> None:
    daemon = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/opt/fakes",
        "EFDL_ETCD": "etcd-1:2379",
        "EFDL_ETCD_USER": "root",
        "EFDL_ETCD_PASSWORD": "daemon-secret",
        "EFDL_ETCD_PASSWORD_FILE": "/etc/efdl/pw",
        "EFDL_ETCD_KEY": "/etc/efdl/key.pem",
        "EFDL_JOB_UIDS": "70000-70999",
        "EFDL_JOB_TOKEN": "daemon-token-0123456789",
        "EFDL_FLEET": "prod",
        "CREDENTIALS_DIRECTORY": "/run/credentials/efdl-node.service",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "HOME": "/root",
        "USER": "root",
        "TMPDIR": "/tmp",
    }
    env = agent_env(daemon, (("NCCL_DEBUG", "WARN"),), tmp_path, Path("/tmp/efdl-job-x"), 70005)
    assert "daemon-secret" not in str(env) and "daemon-token" not in str(env)
    assert "/etc/efdl" not in str(env)
    assert not {k for k in env if k.startswith("EFDL_ETCD") or k == "EFDL_JOB_UIDS"}
    assert env["PATH"] == "/usr/bin" and env["PYTHONPATH"] == "/opt/fakes"
    assert env["NCCL_DEBUG"] == "WARN" and "CREDENTIALS_DIRECTORY" not in env
    assert env["HOME"] == str(tmp_path) and env["TMPDIR"] == "/tmp/efdl-job-x"
    assert env["USER"] == env["LOGNAME"] == "efdl-job-70005"
    shared = agent_env(daemon, (("TMPDIR", "/scratch"),), tmp_path, None, uid=None)
    assert shared["HOME"] == "/root" and shared["TMPDIR"] == "/scratch"  # the job's own wins
    assert agent_env(daemon, (), tmp_path, None, None)["TMPDIR"] == "/tmp"  # the daemon's


def test_a_fleet_job_below_its_min_waits_for_the_allocator_not_600_s(tmp_path: Path) -> None:
    """Inference may push a job without a cache below its min; the allocator gives it back
    first, and the agents wait for it as long as the fleet lets a job wait."""
    daemon = {"EFDL_JOIN_TIMEOUT": "5", "PATH": "/usr/bin"}
    env = agent_env(daemon, (), tmp_path, None, None)
    assert float(env["EFDL_JOIN_TIMEOUT"]) == FLEET_JOIN_TIMEOUT_S == FleetPolicy().max_wait_s
    own = agent_env(daemon, (("EFDL_JOIN_TIMEOUT", "900"),), tmp_path, None, None)
    assert own["EFDL_JOIN_TIMEOUT"] == "900"  # the job's own wins
    cfg = load(LaunchConfig, {}, env=env)
    assert cfg.join_timeout_s == FLEET_JOIN_TIMEOUT_S  # as efdl-run reads it


def test_job_uids_as_root_must_be_asked_for_and_a_range_is_checked() -> None:
    with pytest.raises(ConfigError, match="runs as root, so every job would run as root"):
        job_uids(None, euid=0)
    assert job_uids("shared", euid=0) is None and job_uids(None, euid=1000) is None
    assert job_uids("70000-70999", euid=0) == UidRange(70000, 70999)
    for text, message in [
        ("70000", "is neither a range of uids"),
        ("9-3", "is not a range of uids"),
        ("0-10", "is not a range of uids"),
        ("65000-66000", "holds uid 65534"),
    ]:
        with pytest.raises(ConfigError, match=message):
            job_uids(text, euid=0)
    with pytest.raises(ConfigError, match="needs efdl node to run as root \\(it runs as uid 1000"):
        job_uids("70000-70999", euid=1000)


def test_a_range_that_overlaps_a_users_subordinate_ids_is_refused(tmp_path: Path) -> None:
    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\n# a comment\nbob:165536:65536\n")
    sandbox.check_subordinate_ids(UidRange(70000, 70999), [subuid, tmp_path / "missing"])
    overlap = r"ids 165536-231071 of user 'bob' in .* \(200000-200009\)"
    with pytest.raises(ConfigError, match=overlap):
        sandbox.check_subordinate_ids(UidRange(200000, 200009), [subuid])


def test_a_job_gets_the_same_uid_from_its_id_or_the_next_free_one() -> None:
    uids = UidRange(70000, 70009)
    first = pick_uid("llama-7b", uids, lambda u: False)
    assert first is not None and first in range(70000, 70010)
    assert pick_uid("llama-7b", uids, lambda u: False) == first  # the same on every host
    taken = {first, 70000 + (first - 70000 + 1) % 10}
    second = pick_uid("llama-7b", uids, lambda u: u in taken)
    assert second == 70000 + (first - 70000 + 2) % 10
    assert pick_uid("llama-7b", uids, lambda u: True) is None
    assert (
        len({pick_uid(f"job-{i}", UidRange(70000, 70999), lambda u: False) for i in range(50)}) > 40
    )


def test_check_reachable_names_the_directory_others_may_not_enter() -> None:
    top = Path(tempfile.mkdtemp(prefix="efdl-reach-", dir="/tmp"))  # pytest's tmp_path is 0700
    try:
        inner = top / "a" / "b"
        inner.mkdir(parents=True)
        top.chmod(0o755)
        sandbox.check_reachable(inner, "the test's directory")  # every one o+x
        (top / "a").chmod(0o700)
        with pytest.raises(ConfigError, match=f"'{top / 'a'}' has mode 0700, which other"):
            sandbox.check_reachable(inner, "the test's directory")
    finally:
        shutil.rmtree(top)


def run_wrapped(tmp_path: Path, *command: str) -> tuple[subprocess.Popen[bytes], Path]:
    exit_file = tmp_path / "exit"
    proc = subprocess.Popen(wrapped(exit_file, command), cwd=tmp_path)
    return proc, exit_file


@pytest.mark.parametrize(
    ("command", "code"),
    [
        ((sys.executable, "-c", "raise SystemExit(7)"), 7),
        ((sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), 137),
        (("/nonexistent/program", "-x"), 127),
    ],
)
def test_the_wrapper_records_the_exit_code(
    tmp_path: Path, command: tuple[str, ...], code: int
) -> None:
    proc, exit_file = run_wrapped(tmp_path, *command)
    assert proc.wait(timeout=30) == code
    assert exit_file.read_text() == f"{code}\n"


def test_the_wrapper_passes_arguments_on_literally_and_forwards_sigterm(tmp_path: Path) -> None:
    script = (
        "import json, signal, sys, time\n"
        "json.dump(sys.argv[1:], open('argv.json', 'w'))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\n"
        "open('ready', 'w').close()\n"
        "time.sleep(60)\n"
    )
    args = ("-", "--help", "a b", "$(id)", "'; rm -rf /'", "-c")
    proc, exit_file = run_wrapped(tmp_path, sys.executable, "-c", script, *args)
    try:
        wait_until("the program to start", (tmp_path / "ready").exists, 30)
        os.kill(proc.pid, signal.SIGTERM)  # the wrapper: it passes the signal on
        assert proc.wait(timeout=30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert tuple(json.loads((tmp_path / "argv.json").read_text())) == args
    assert exit_file.read_text() == "3\n"
