"""How ``efdl node`` starts one agent of a job, kept apart from the other jobs, and what it
cleans up after it (efdl.fleet.daemon decides when; this module does it).

An agent is started without a shell (efdl.fleet.launch: an argv list, the job's command after
``--``), in a session of its own, under its job's uid where the daemon has a range of them
(efdl.fleet.sandbox; no supplementary groups), with a private directory (mode 0700, the
uid's) for its ``HOME``, exit code and etcd files, and a ``TMPDIR`` of its own. Where etcd
has authentication on, it gets an etcd user of its own whose role reaches its job's keys
alone (efdl.fleet.etcd_users), its password in a file of that directory; the daemon's own
etcd credentials never reach it: not in its environment (efdl.fleet.launch.DAEMON_ONLY), not
on its command line, not in a file its uid may read (checked at start), and a process of
another uid may not read the daemon's ``/proc/<pid>/environ``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import stat
import subprocess
import sys
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from efdl.config import EtcdClientConfig
from efdl.errors import ConfigError, StoreError
from efdl.fleet import sandbox
from efdl.fleet.etcd_users import AgentUsers, agent_user_prefix
from efdl.fleet.host_holds import agent_prefix
from efdl.fleet.launch import EtcdAccess, agent_argv, agent_env, wrapped
from efdl.fleet.records import JobSpec
from efdl.rendezvous.api import EtcdSettings
from efdl.rendezvous.records import JobKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Isolation:
    """How a host daemon keeps its jobs apart (``efdl node``'s flags).

    Attributes:
        uids: the uids set aside for jobs (``--job-uids``); None: every job runs as the
            daemon's own user.
        etcd_ca: the CA that signed etcd's certificates (the daemon's ``--etcd-ca``): each
            agent gets a copy.
        job_cert / job_key: the client certificate and key agents present to etcd where it
            asks for one (``--job-etcd-cert``, ``--job-etcd-key``), never the daemon's own.
            Its name (CN) must be no etcd user with any permission: etcd takes a
            certificate's CN for the user of a request that carries no password token.
        daemon_key: the daemon's own client key.
        daemon_secret_files: the daemon's password file and job token file. These and its
            key are refused at start if a job's uid could read them.
    """

    uids: sandbox.UidRange | None = None
    etcd_ca: Path | None = None
    job_cert: Path | None = None
    job_key: Path | None = None
    daemon_key: Path | None = None
    daemon_secret_files: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if (self.job_cert is None) != (self.job_key is None):
            raise ConfigError(
                f"--job-etcd-cert ({self.job_cert}) and --job-etcd-key ({self.job_key}) go "
                "together: the certificate the jobs' agents present to etcd, and its key."
            )
        for flag, path in (("--job-etcd-cert", self.job_cert), ("--job-etcd-key", self.job_key)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag} {str(path)!r} is not a file.")


def isolation_from_flags(
    job_uids: str | None,
    job_cert: Path | None,
    job_key: Path | None,
    daemon: EtcdClientConfig,
    settings: EtcdSettings,
) -> Isolation:
    """``efdl node``'s ``--job-uids``, ``--job-etcd-cert`` and ``--job-etcd-key``, with the
    daemon's own etcd settings (its CA, for the agents; its key, password file and job token
    file, which no job may read).

    Raises:
        ConfigError: a flag is bad, or missing (``--job-uids``, for a daemon run as root).
    """
    return Isolation(
        sandbox.job_uids(job_uids, os.geteuid()),
        settings.ca_file,
        job_cert,
        job_key,
        settings.key_file,
        tuple(p for p in (daemon.etcd_password_file, daemon.job_token_file) if p is not None),
    )


@dataclass(frozen=True, slots=True)
class AgentFiles:
    """What a daemon keeps of an agent it started, in its state file: where its log and exit
    code go, its private directory, its uid (None: the daemon's), its etcd user and its
    ``TMPDIR`` (under a uid of its own)."""

    log: str
    exit: str
    private_dir: str | None = None
    uid: int | None = None
    etcd_user: str | None = None
    tmp: str | None = None

    def row(self) -> dict[str, Any]:
        return {
            "log": self.log,
            "exit": self.exit,
            "dir": self.private_dir,
            "uid": self.uid,
            "etcd_user": self.etcd_user,
            "tmp": self.tmp,
        }

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> AgentFiles:
        """From a state file's row (an older daemon's rows have the log and exit only)."""
        uid = row.get("uid")
        return AgentFiles(
            str(row["log"]),
            str(row["exit"]),
            str(row["dir"]) if row.get("dir") else None,
            int(uid) if uid is not None else None,
            str(row["etcd_user"]) if row.get("etcd_user") else None,
            str(row["tmp"]) if row.get("tmp") else None,
        )


@dataclass(frozen=True, slots=True)
class Started:
    """An agent just started: its wrapper process and its files."""

    proc: subprocess.Popen[bytes]
    files: AgentFiles


class StartError(Exception):
    """An agent could not be started; ``lasting``: trying again will not help (its job fails
    on this host), else it is tried again at the next reconciliation."""

    def __init__(self, message: str, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting


class Spawner:
    """Starts a host's agents, each kept apart (this module's docstring), and cleans up after
    them.

    Args:
        host_id: the host (names its agents' etcd users).
        address: where peers reach it (its agents' ``--host``).
        endpoints: etcd's endpoints, as its agents are given them.
        state_dir: the daemon's state directory (logs, and the agents' private directories).
        isolation: the daemon's flags.
        users: etcd's user management (None: the store cannot; taken as authentication off).
    """

    def __init__(
        self,
        host_id: str,
        address: str,
        endpoints: str,
        state_dir: Path,
        isolation: Isolation,
        users: AgentUsers | None,
    ) -> None:
        self.host_id, self._address, self._endpoints = host_id, address, endpoints
        self._state, self._iso, self._users = state_dir, isolation, users
        self.logs, self.run_dir = state_dir / "logs", state_dir / "run"
        self._auth = False  # set by prepare()
        self.unreleased: set[str] = set()  # etcd users whose deletion failed: tried again

    # ---------------------------------------------------------------- at start

    def prepare(self) -> None:
        """Make the state directory, check that jobs can be kept apart as asked, and say in
        the log how they are.

        Raises:
            ConfigError: a job's uid could not run the daemon's Python or reach its private
                directory, or could read the daemon's credentials; etcd has authentication
                on and the daemon's user may not manage users.
            StoreError: etcd failed.
        """
        self.logs, self.run_dir = sandbox.prepare_state_dir(self._state)
        uids = self._iso.uids
        if uids is not None:
            sandbox.check_subordinate_ids(uids)
            sandbox.check_reachable(Path(sys.executable), "the daemon's Python")
            sandbox.check_reachable(self.run_dir, "their private directories under")
            for path in (self._iso.daemon_key, *self._iso.daemon_secret_files):
                if path is not None and _readable_by_others(path):
                    raise ConfigError(
                        f"This daemon's etcd credentials in {str(path)!r} may be read by every "
                        "user, the jobs' included; make the file mode 0600 (or its directory "
                        "0700)."
                    )
            log.info(
                "Host %s: each job runs as a uid of its own from %s, with no supplementary "
                "group (the GPUs' /dev/nvidia* files must be open to them: docs/deploy.md).",
                self.host_id, uids,
            )  # fmt: skip
        else:
            log.warning(
                "Host %s: every job runs as this daemon's own user (uid %d), not as a user of "
                "its own: a job can read and signal the other jobs' processes and files, and "
                "this daemon's (its environment, its etcd credential files). Run the daemon "
                "as root with --job-uids FIRST-LAST to keep jobs apart.",
                self.host_id, os.geteuid(),
            )  # fmt: skip
        users = self._users
        self._auth = users is not None and users.auth_enabled()
        if users is not None and self._auth:
            users.check_can_manage_users()
            log.info(
                "Host %s: etcd has authentication on: each agent gets an etcd user of its "
                "own, whose role reaches its job's keys (/efdl/<job>/) alone.",
                self.host_id,
            )
        else:
            log.warning(
                "Host %s: etcd has authentication off: every job's agents may read and write "
                "every key, the other jobs' and the fleet's records included (jobs are not "
                "isolated in etcd). Turn etcd's authentication on (docs/etcd.md) and give this "
                "daemon a user with the root role.",
                self.host_id,
            )
        if self._iso.job_cert is None and self._iso.daemon_key is not None:
            log.warning(
                "Host %s: this daemon presents a client certificate to etcd and no "
                "--job-etcd-cert was given: its agents present none (the daemon's own key "
                "never reaches a job), so an etcd that asks for one refuses them.",
                self.host_id,
            )

    def forget_orphans(self, known: Collection[AgentFiles]) -> None:
        """Delete the etcd users and private directories of this host's agents that no
        recorded agent has (a daemon that died between making and recording them). The
        ``TMPDIR``s are told by their owner's uid, from this daemon's range: a range is one
        daemon's alone."""
        users = {f.etcd_user for f in known}
        dirs = {f.private_dir for f in known}
        if self._auth and self._users is not None:
            try:
                for name in self._users.agent_users(agent_user_prefix(self.host_id)):
                    if name not in users:
                        log.info("Host %s: deleting etcd user %s of no agent.", self.host_id, name)
                        self._users.delete_agent_user(name)
            except StoreError as exc:  # they wait for the next start; the agents do not
                log.warning(
                    "Host %s: could not delete the etcd users of no agent: %s", self.host_id, exc
                )
        for d in self.run_dir.iterdir():
            if str(d) not in dirs:
                sandbox.remove_private_dir(d)
        if self._iso.uids is not None:  # those of no process too (an agent unrecorded runs)
            running = sandbox.process_uids()
            for d in sandbox.orphan_tmps(self._iso.uids, {f.tmp for f in known if f.tmp}):
                with contextlib.suppress(OSError):
                    if d.lstat().st_uid not in running:
                        sandbox.remove_private_dir(d)

    # ---------------------------------------------------------------- an agent

    def start(
        self, spec: JobSpec, gpus: tuple[int, ...], uid: int | None, log_path: Path
    ) -> Started:
        """Start an agent of ``spec`` on ``gpus`` as ``uid`` (None: the daemon's user).

        Raises:
            StartError: nothing was left behind (no directory, no etcd user).
            StoreError: etcd failed making the agent's user (nothing left behind either).
        """
        rid = uuid.uuid4().hex[:8]
        node_id = f"{agent_prefix(self.host_id)}{gpus[0]}-{rid[:4]}"
        private = self.run_dir / rid
        user = f"{agent_user_prefix(self.host_id)}{rid}" if self._auth else None
        files = AgentFiles(str(log_path), str(private / "exit"), str(private), uid, user)
        try:
            sandbox.make_private_dir(private, uid)
            if uid is not None:
                tmp = sandbox.make_private_tmp(uid)
                files = dataclasses.replace(files, tmp=str(tmp))
            access = self._access(private, uid, spec.job_id, user)
            argv = agent_argv(
                spec.job_id, spec.argv, spec.min_workers, spec.max_workers, spec.cache_url,
                gpus, node_id, self._address, access,
            )  # fmt: skip
            tmp_dir = Path(files.tmp) if files.tmp else None
            env = agent_env(os.environ, spec.env, private, tmp_dir, uid)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with open(fd, "ab") as out:
                try:
                    proc = subprocess.Popen(
                        wrapped(private / "exit", argv),
                        cwd=spec.workdir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        **_as_user(uid),
                    )
                except OSError as exc:  # its working directory, or its uid's access to it
                    as_uid = f" as uid {uid}" if uid is not None else ""
                    raise StartError(
                        f"cannot start its agent in {spec.workdir!r}{as_uid}: {exc}",
                        lasting=True,
                    ) from exc
        except BaseException as exc:
            self.finish(files, last_of_job=False)
            if isinstance(exc, OSError):
                raise StartError(
                    f"cannot prepare its agent's directory {str(private)!r}: {exc}", lasting=False
                ) from exc
            raise
        return Started(proc, files)

    def _access(self, private: Path, uid: int | None, job_id: str, user: str | None) -> EtcdAccess:
        """The agent's own etcd files in its private directory: copies of the CA and of the
        jobs' client certificate, and (authentication on) its user, made now, and its
        password."""
        copies: dict[str, Path | None] = {}
        for name, source in (
            ("etcd-ca.pem", self._iso.etcd_ca),
            ("etcd-cert.pem", self._iso.job_cert),
            ("etcd-key.pem", self._iso.job_key),
        ):
            copies[name] = None
            if source is not None:
                sandbox.write_private(private / name, source.read_bytes(), uid)
                copies[name] = private / name
        password_file = None
        if user is not None and self._users is not None:  # (a user is named with auth on)
            password = secrets.token_urlsafe(32)
            password_file = private / "etcd-password"
            sandbox.write_private(password_file, password.encode() + b"\n", uid)
            self._users.add_agent_user(user, password, JobKeys(job_id).prefix)
        return EtcdAccess(
            self._endpoints,
            copies["etcd-ca.pem"],
            copies["etcd-cert.pem"],
            copies["etcd-key.pem"],
            user,
            password_file,
        )

    def finish(self, files: AgentFiles, last_of_job: bool) -> None:
        """After an agent ended (or did not start): delete its etcd user (a failure is tried
        again, :meth:`retry_releases`), remove its private directory, and where it was its
        job's last agent here under a uid of its own, end what that uid left running."""
        if files.etcd_user is not None:
            self.unreleased.add(files.etcd_user)
            self.retry_releases()
        for d in (files.private_dir, files.tmp):
            if d is not None:
                sandbox.remove_private_dir(Path(d))
        if last_of_job and files.uid is not None:
            killed = sandbox.sweep(files.uid)
            if killed:
                log.info(
                    "Host %s: killed %d process(es) left running as uid %d by a job that "
                    "ended here.",
                    self.host_id, killed, files.uid,
                )  # fmt: skip

    def retry_releases(self) -> None:
        """Delete the etcd users of ended agents whose deletion failed before."""
        if self._users is None:
            self.unreleased.clear()
            return
        for name in sorted(self.unreleased):
            try:
                self._users.delete_agent_user(name)
            except Exception as exc:  # etcd away: the next reconciliation tries again
                log.warning(
                    "Host %s: could not delete etcd user %s yet: %s", self.host_id, name, exc
                )
                return
            self.unreleased.discard(name)

    def pick_uid(self, job_id: str, held: Mapping[int, str]) -> int | None:
        """The uid for a new agent of ``job_id``: the one its agents here hold, else a free
        one (efdl.fleet.sandbox.pick_uid); None where jobs share the daemon's user.

        Raises:
            StartError: every uid of the range is taken (tried again later).
        """
        uids = self._iso.uids
        if uids is None:
            return None
        for taken, job in held.items():
            if job == job_id:
                return taken
        running = sandbox.process_uids()
        uid = sandbox.pick_uid(
            job_id, uids, lambda u: u in held or u in running or sandbox.has_account(u)
        )
        if uid is None:
            raise StartError(
                f"every uid of --job-uids {uids} is taken (by the {len(held)} jobs here, by "
                "other processes or by accounts); widen the range",
                lasting=False,
            )
        return uid


def _as_user(uid: int | None) -> dict[str, Any]:
    """Popen's arguments that start a process as ``uid`` (gid the same, no other group)."""
    if uid is None:
        return {}
    return {"user": uid, "group": uid, "extra_groups": []}


def _readable_by_others(path: Path) -> bool:
    """Whether a user with no group of the file's may read ``path`` (every directory above it
    open to others, and the file readable by them)."""
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        sandbox.check_reachable(path.parent, "")
    except (OSError, ConfigError):
        return False
    return True
