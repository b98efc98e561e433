"""Fleet jobs kept apart, with real parts: an ``efdl node`` daemon run as root with
``--job-uids`` on an etcd with authentication on (its password in the daemon's environment),
without and with TLS and client certificates (the daemon presents its own, the jobs' agents
another: ``--job-etcd-cert``), a real efdl-run agent and worker, and a job whose script probes
what its uid can reach.

The agent runs with no shell between it and the daemon, as a uid of its own with no account
and no supplementary group; the job's command, shell metacharacters and leading ``-``
included, reaches the script as it was submitted; the job cannot read the daemon's
environment, state or logs, and the daemon's password and key are in none of the job's
processes' environments or command lines nor in its files; the agent's etcd user reads and
writes its job's keys and nothing else; and when the job ends its etcd user, its private
directory and every process of its uid are gone."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from etcd3 import etcdrpc

from efdl.errors import StoreAuthError
from efdl.fleet import sandbox
from efdl.fleet.records import Phase
from efdl.rendezvous.api import EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd, ServerTls
from efdl.rendezvous.etcd_store import EtcdStore
from tests.e2e.fleet_harness import Fleet
from tests.integration.test_etcd_security import _cert, _write_key

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="runs jobs as other uids: needs root"),
]
PASSWORD = f"daemon-{secrets.token_hex(12)}"
HOST = "gpu-iso"  # short: efdl-run's Unix socket goes under the state directory
UIDS = {"auth": "70000-70499", "tls+auth": "70500-70999"}  # a range is one daemon's

# What the job's uid can reach, and what it was given; it waits for the test's word to end.
PROBE = """
import json, os, pathlib, sys, time

out = pathlib.Path(os.environ["OUT_DIR"])
state = pathlib.Path(os.environ["STATE_DIR"])


def attempt(what, path):
    try:
        os.listdir(path) if what == "list" else pathlib.Path(path).read_bytes()
        return "allowed"
    except PermissionError:
        return "denied"
    except OSError as exc:
        return f"error {exc.errno}"


found = {
    "argv": sys.argv[1:],
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],
    "groups": os.getgroups(),
    "env": dict(os.environ),
    "daemon environ": attempt("read", f"/proc/{os.environ['DAEMON_PID']}/environ"),
    "state dir": attempt("list", state),
    "logs": attempt("list", state / "logs"),
    "agents.json": attempt("read", state / "agents.json"),
    "own dir": attempt("list", os.environ["HOME"]),
}
(out / "probe.json.tmp").write_text(json.dumps(found))
os.replace(out / "probe.json.tmp", out / "probe.json")
deadline = time.monotonic() + 180
while not (out / "release").exists():
    assert time.monotonic() < deadline, "the test never released the probe"
    time.sleep(0.05)
"""


@dataclass(frozen=True)
class Pki:
    """A CA, etcd's server certificate, the daemon's client certificate and another for the
    jobs' agents (whose name, its CN, is no etcd user)."""

    ca: Path
    server: tuple[Path, Path]
    daemon: tuple[Path, Path]
    jobs: tuple[Path, Path]

    @staticmethod
    def make(where: Path) -> Pki:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert("efdl fleet test CA", ca_key, None, ca=True)
        (where / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        pairs = {}
        for who in ("server", "daemon", "jobs"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(f"efdl fleet {who}", key, (ca.subject, ca_key), san_ip=who == "server")
            (where / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            _write_key(key, where / f"{who}-key.pem")
            (where / f"{who}-key.pem").chmod(0o600)
            pairs[who] = (where / f"{who}.pem", where / f"{who}-key.pem")
        return Pki(where / "ca.pem", pairs["server"], pairs["daemon"], pairs["jobs"])


@dataclass(frozen=True)
class Secured:
    """A fleet on an etcd with authentication on (and TLS with ``pki``)."""

    fleet: Fleet
    pki: Pki | None

    def settings(self, user: str, password: str) -> EtcdSettings:
        """How a client reaches the etcd as ``user``: with the jobs' certificate, if any."""
        return client_settings(self.fleet.server, self.pki, "jobs", user, password)


def client_settings(
    server: EmbeddedEtcd, pki: Pki | None, who: str, user: str, password: str
) -> EtcdSettings:
    if pki is None:
        return server.settings(user=user, password=password)
    cert, key = pki.daemon if who == "daemon" else pki.jobs
    return server.settings(
        ca_file=pki.ca, cert_file=cert, key_file=key, user=user, password=password
    )


def _enable_auth(server: EmbeddedEtcd, pki: Pki | None) -> None:
    """User root (the daemon's), then authentication on."""
    if pki is None:
        channel = grpc.insecure_channel(server.endpoint.target)
    else:
        creds = grpc.ssl_channel_credentials(
            root_certificates=pki.ca.read_bytes(),
            private_key=pki.daemon[1].read_bytes(),
            certificate_chain=pki.daemon[0].read_bytes(),
        )
        channel = grpc.secure_channel(server.endpoint.target, creds)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=PASSWORD))
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
    auth.AuthEnable(etcdrpc.AuthEnableRequest())
    channel.close()


@pytest.fixture()
def base() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="efdl-iso-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["auth", "tls+auth"])
def secured(request: pytest.FixtureRequest, base: Path, tmp_path: Path) -> Iterator[Secured]:
    pki = Pki.make(tmp_path) if request.param == "tls+auth" else None  # under a 0700 dir
    daemon_env = {"EFDL_ETCD_USER": "root", "EFDL_ETCD_PASSWORD": PASSWORD}
    args: tuple[str, ...] = ()
    tls = None
    if pki is not None:
        tls = ServerTls(*pki.server, client_ca=pki.ca)
        daemon_env.update(
            EFDL_ETCD_CA=str(pki.ca), EFDL_ETCD_CERT=str(pki.daemon[0]),
            EFDL_ETCD_KEY=str(pki.daemon[1]),
        )  # fmt: skip
        args = ("--job-etcd-cert", str(pki.jobs[0]), "--job-etcd-key", str(pki.jobs[1]))
    with EmbeddedEtcd(tls=tls, extra_args=("--auth-token=simple",)) as server:
        _enable_auth(server, pki)
        fleet = Fleet(
            server, base, job_uids=UIDS[request.param], daemon_env=daemon_env, daemon_args=args,
            settings=client_settings(server, pki, "daemon", "root", PASSWORD),
        )  # fmt: skip
        try:
            yield Secured(fleet, pki)
        finally:
            fleet.close()


def reported(fleet: Fleet, out: Path) -> bool:
    assert fleet.status("probe").phase is not Phase.FAILED, fleet.logs()
    return (out / "probe.json").exists()


def job_processes(wrapper_pid: int) -> list[psutil.Process]:
    wrapper = psutil.Process(wrapper_pid)
    return [wrapper, *wrapper.children(recursive=True)]


def supplementary_groups(p: psutil.Process) -> str:
    for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
        if line.startswith("Groups:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Groups line for pid {p.pid}")


def test_a_job_runs_as_its_own_uid_without_a_shell_and_reaches_only_its_own_keys(
    secured: Secured, base: Path
) -> None:
    fleet = secured.fleet
    code = base / "code"
    code.mkdir(mode=0o755)
    (code / "probe.py").write_text(PROBE)
    fleet.host(HOST, gpus=1)
    daemon = fleet.daemons[HOST]
    state = base / f"state-{HOST}"
    out = base / "probe"
    argv = (
        "probe.py", "--etcd", "evil:2379", "--job-id", "other", "-", f"$(touch {out}/pwned)",
        "`id`; echo pwned > x | cat &", "-c", "a b", "'", '"', "*",
    )  # fmt: skip
    fleet.submit(
        "probe", 1, 1, 0, argv=argv, workdir=code,
        env={
            "EFDL_WARM_WORKERS": "0", "EFDL_SETTLE": "0.5", "EFDL_LEASE_TTL": "3",
            "DAEMON_PID": str(daemon.pid), "STATE_DIR": str(state),
        },
    )  # fmt: skip
    job = fleet.job_ids["probe"]
    other = f"{job}-b"  # another job, whose id starts with this one's
    fleet.store.put(f"/efdl/{other}/secret", b"not yours")
    fleet.wait("the probe to report", lambda: reported(fleet, out), 240)
    found = json.loads((out / "probe.json").read_text())
    (row,) = fleet.agents(HOST)
    uid, user, private = int(row["uid"]), str(row["etcd_user"]), Path(str(row["dir"]))

    # Its uid, no account, no supplementary group, and no shell between it and the daemon.
    first, last = map(int, fleet.job_uids.split("-"))
    assert first <= uid <= last and not sandbox.has_account(uid)
    procs = job_processes(int(row["pid"]))
    wrapper, agent = procs[0], procs[1]
    assert len(procs) >= 3, [p.cmdline() for p in procs]  # wrapper, agent, worker
    assert wrapper.ppid() == daemon.pid and agent.ppid() == wrapper.pid
    for p in (psutil.Process(daemon.pid), *procs):
        assert p.name() not in ("sh", "bash", "dash") and "/bin/sh" not in p.cmdline()[:1]
        assert PASSWORD not in " ".join(p.cmdline())
    for p in procs:
        assert tuple(p.uids()) == (uid, uid, uid) and tuple(p.gids()) == (uid, uid, uid)
        assert supplementary_groups(p) == "", p.cmdline()
        assert PASSWORD not in str(p.environ()), p.cmdline()
    assert agent.cmdline()[agent.cmdline().index("--etcd-user") + 1] == user
    assert found["ids"] == [uid] * 4 and found["groups"] == []

    # The command as submitted, nothing run by a shell.
    assert tuple(found["argv"]) == argv[1:]
    assert not (out / "pwned").exists() and not (code / "x").exists()

    # Nothing of the daemon's reaches it.
    assert PASSWORD not in json.dumps(found["env"])
    assert not {k for k in found["env"] if k.startswith("EFDL_ETCD_PASSWORD")}
    assert found["daemon environ"] == "denied"
    assert found["state dir"] == found["logs"] == found["agents.json"] == "denied"
    assert found["own dir"] == "allowed"
    tmp = Path(str(row["tmp"]))
    assert found["env"]["TMPDIR"] == str(tmp) and tmp.parent == Path("/tmp")
    assert found["env"]["HOME"] == str(private)
    for d in (private, tmp):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == uid, d
    daemons = [PASSWORD.encode(), *([secured.pki.daemon[1].read_bytes()] if secured.pki else [])]
    for f in private.rglob("*"):
        assert f.stat().st_uid == uid, f
        if f.is_file():
            assert not [d for d in daemons if d in f.read_bytes()], f
    if secured.pki is not None:  # the jobs' certificate, not the daemon's
        assert (private / "etcd-key.pem").read_bytes() == secured.pki.jobs[1].read_bytes()
        flags = agent.cmdline()
        assert flags[flags.index("--etcd-key") + 1] == str(private / "etcd-key.pem")

    # Its etcd user: its job's keys, nothing else.
    password = (private / "etcd-password").read_text().strip()
    assert stat.S_IMODE((private / "etcd-password").stat().st_mode) == 0o600
    with EtcdStore(secured.settings(user, password)) as as_job:
        assert as_job.get_prefix(f"/efdl/{job}/nodes/").kvs  # its agent's record
        as_job.put(f"/efdl/{job}/probe", b"mine")
        for key in (f"/efdl/{other}/secret", fleet.keys.spec(job), fleet.keys.host(HOST)):
            with pytest.raises(StoreAuthError):
                as_job.get(key)
            with pytest.raises(StoreAuthError):
                as_job.put(key, b"overwritten")

    # A restarted daemon adopts it, uid, etcd user and directories included, and a stray
    # process of its uid (one a job could leave behind) is no reason to keep the uid.
    daemon.send_signal(signal.SIGKILL)
    daemon.wait(timeout=30)
    fleet.start(HOST)
    node_log = base / f"node-{HOST}.log"
    fleet.wait("the new daemon to adopt the agent", lambda: "adopted agent" in node_log.read_text())
    assert fleet.agents(HOST) == [row]
    sleep = shutil.which("sleep")  # not this Python: other users may not reach it here
    assert sleep is not None
    stray = subprocess.Popen([sleep, "300"], user=uid, group=uid, extra_groups=[])

    # It ends: its etcd user, its directories and its uid's processes go.
    (out / "release").touch()
    fleet.wait("the job to finish", lambda: fleet.status("probe").phase is Phase.FINISHED, 120)
    fleet.wait("its agent forgotten", lambda: not fleet.agents(HOST), 60)
    with pytest.raises(StoreAuthError):
        EtcdStore(secured.settings(user, password))
    assert not private.exists() and not tmp.exists()
    assert stray.wait(timeout=30) == -signal.SIGKILL  # killed when its job ended here
    assert uid not in sandbox.process_uids()
    kv = fleet.store.get(f"/efdl/{other}/secret")
    assert kv is not None and kv.value == b"not yours"
