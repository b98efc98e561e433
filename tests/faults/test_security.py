"""Security with real efdl-run agents: etcd with TLS (server and client certificates) and a
user whose role is limited to its job's prefix. A job runs; a wrong password, a missing
certificate or a role without access is a clear error at start, not a hang; the password is
never in logs, command lines, worker environments or `efdl status`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2
from etcd3.utils import prefix_range_end

from efdl.rendezvous.embedded import EmbeddedEtcd, ServerTls
from tests.e2e.harness import EFDL_RUN, SCRIPTS, alive
from tests.faults.conftest import Recorder
from tests.integration.test_etcd_security import Pki, pki  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)
PASSWORD = "s3cret-Pa55-do-not-leak"


def _enable_auth(server: EmbeddedEtcd, pki: Pki) -> None:  # noqa: F811
    """Users root and alice (read-write on keys starting /efdl/job-a only: jobs job-a-*),
    then auth on, over TLS."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes(),
        certificate_chain=pki.client_cert.read_bytes(),
    )
    channel = grpc.secure_channel(server.endpoint.target, creds)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="root-pw"))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="job-a"))
    prefix = b"/efdl/job-a"
    perm = auth_pb2.Permission(
        permType=auth_pb2.Permission.READWRITE, key=prefix, range_end=prefix_range_end(prefix)
    )
    auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="job-a", perm=perm))
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="alice", password=PASSWORD))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="alice", role="job-a"))
    auth.AuthEnable(etcdrpc.AuthEnableRequest())
    channel.close()


@pytest.fixture(scope="module")
def secure_etcd(pki: Pki) -> Iterator[EmbeddedEtcd]:  # noqa: F811
    tls = ServerTls(pki.server_cert, pki.server_key, client_ca=pki.ca)
    with EmbeddedEtcd(tls=tls, extra_args=("--auth-token=simple",)) as server:
        _enable_auth(server, pki)
        yield server


def etcd_args(server: EmbeddedEtcd, pki: Pki, tmp: Path, password: str = PASSWORD) -> list[str]:  # noqa: F811
    secret = tmp / "password"
    secret.write_text(password + "\n")
    secret.chmod(0o600)
    return [
        "--etcd",
        server.endpoint.target,
        "--etcd-ca",
        str(pki.ca),
        "--etcd-cert",
        str(pki.client_cert),
        "--etcd-key",
        str(pki.client_key),
        "--etcd-user",
        "alice",
        "--etcd-password-file",
        str(secret),
    ]


def run(args: list[str], tmp: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT_DIR": str(tmp), "STEP_SECONDS": "0", "EPOCHS": "1"}
    return subprocess.run(
        [*EFDL_RUN, *args], capture_output=True, text=True, timeout=timeout_s, env=env, check=False
    )


JOB = ["--host", "127.0.0.1", "--min", "2", "--max", "2", "--nproc-per-node", "2"]


def test_a_job_runs_and_the_password_never_shows(
    secure_etcd: EmbeddedEtcd,
    pki: Pki,  # noqa: F811
    tmp_path: Path,
    record: Recorder,
    attempt: int,
) -> None:
    """etcd with TLS (server and client certificates) and auth, the job's user limited to its
    prefix: the job trains and ends; the password is in no log, command line, worker
    environment or `efdl status` output."""
    job = f"job-a-{uuid.uuid4().hex[:6]}"  # a fresh job each run (soak)
    args = [*etcd_args(secure_etcd, pki, tmp_path), "--job-id", job, *JOB]
    env = {**os.environ, "OUT_DIR": str(tmp_path), "STEP_SECONDS": "0.2", "EPOCHS": "1"}
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [*EFDL_RUN, *args, str(SCRIPTS / "elastic_steps.py")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 90
        events = tmp_path / "events.jsonl"
        while not (events.exists() and events.read_text().count("\n") >= 2):
            assert agent.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        # Training: neither the agent's nor a worker's command line or environment has it.
        procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
        assert len(procs) >= 3, [p.cmdline() for p in procs]
        for p in procs:
            assert PASSWORD not in " ".join(p.cmdline())
            assert PASSWORD not in str(p.environ())
        status = subprocess.run(
            [sys.executable, "-m", "efdl", "status", "--job-id", job, *args[:12]],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert "active, world size 2" in status.stdout
        assert PASSWORD not in status.stdout + status.stderr
        assert agent.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        assert not alive([p.pid for p in procs[1:]]), "a worker outlived the job"
    assert PASSWORD not in log.read_text()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("wrong password", "'alice'"),
        ("no client certificate", "no client certificate was given"),
        ("a job outside the role", "job-b"),
    ],
)
def test_bad_credentials_are_a_clear_error_at_start(
    secure_etcd: EmbeddedEtcd,
    pki: Pki,  # noqa: F811
    tmp_path: Path,
    change: str,
    expected: str,
    record: Recorder,
    attempt: int,
) -> None:
    """A wrong password, no client certificate, or a job outside the user's role: efdl-run
    exits non-zero at start (not a hang) with an error naming what is wrong, without the
    password or a traceback, and no worker trains."""
    args = etcd_args(
        secure_etcd, pki, tmp_path, "wrong" if change == "wrong password" else PASSWORD
    )
    job = f"job-a-{uuid.uuid4().hex[:6]}"
    if change == "no client certificate":
        cut = args.index("--etcd-cert")
        del args[cut : cut + 4]
    if change == "a job outside the role":
        job = "job-b"
    t0 = time.monotonic()
    done = run([*args, "--job-id", job, *JOB, str(SCRIPTS / "elastic_steps.py")], tmp_path)
    took = time.monotonic() - t0
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-2000:]
    assert took < 60, f"{change}: took {took:.0f} s to fail"
    assert expected in out, out[-2000:]
    assert PASSWORD not in out and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "events.jsonl").exists()  # no worker ever trained
