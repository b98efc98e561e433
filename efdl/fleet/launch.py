"""How ``efdl node`` starts one agent of a job: its command line and its environment, from the
job's spec and what the daemon decided. Pure (efdl.fleet.daemon runs what this returns).

Nothing read from etcd reaches a shell, or an option parser as an option:

- the agent is ``python -m efdl.fleet.wrap EXIT_FILE python -c <efdl-run> <options> -- <the
  job's command>``, an argv list (no ``/bin/sh``); the wrapper takes its arguments by place;
- the daemon's options to efdl-run (etcd, job id, node id, GPUs, size, credentials) come
  before ``--``, the job's command after it, so a spec cannot give its agent another job id,
  etcd or user (click, as most parsers, lets a repeated option win);
- of efdl-run's options, only the two that say what the command is (``-m``: a module,
  ``--no-python``: a program) may lead a job's command, and are moved before ``--``; any
  other leading ``-`` is refused when the spec is made (:func:`split_command`). efdl-run's
  other settings reach a job's agent as ``EFDL_*`` variables of its environment, which the
  daemon's flags override.

The agent's environment is the daemon's, less what holds the daemon's own etcd settings and
credentials (:data:`DAEMON_ONLY`), with the job's variables on top.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from efdl.errors import ConfigError
from efdl.protocol.env import JOIN_TIMEOUT_ENV, SECRET_VARIABLES

# An efdl-run agent, and the wrapper that records its exit code (efdl.fleet.wrap). -P: the
# job's working directory (their cwd) is not put on sys.path, so efdl and what it imports come
# from where they are installed, never from a module of the job's that shares a name.
EFDL_RUN = (sys.executable, "-P", "-c", "from efdl.cli.run import run_main; run_main()")
WRAP = (sys.executable, "-P", "-m", "efdl.fleet.wrap")
# efdl-run's flags that say what a job's command is; the only options a spec may give.
COMMAND_FLAGS = frozenset({"-m", "--module", "--no-python", "--no_python"})
# The daemon's environment variables that never reach a job: its etcd settings and
# credentials (efdl.config: EFDL_ETCD, EFDL_ETCD_USER, EFDL_ETCD_PASSWORD[_FILE], _CA, _CERT,
# _KEY..., EFDL_JOB_TOKEN[_FILE], every one of SECRET_VARIABLES), its own options, and
# systemd's handles on the daemon's service (its notify socket, its credentials directory:
# LoadCredential=).
DAEMON_ONLY_PREFIXES = ("EFDL_ETCD", "EFDL_JOB_", "EFDL_CONFIG", "EFDL_FLEET")
DAEMON_ONLY = frozenset(
    {"NOTIFY_SOCKET", "CREDENTIALS_DIRECTORY", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"}
)
# How long a fleet job's agents wait below its min before they fail it (efdl-run
# --join-timeout, 600 s alone): in a fleet, a job without a cache that inference pushed below
# its min waits for the allocator to give it back (its status says so), as long as a waiting
# job may wait before it goes first (FleetPolicy.max_wait_s). A job's own EFDL_JOIN_TIMEOUT wins.
FLEET_JOIN_TIMEOUT_S = 12 * 3600.0


def split_command(job_id: str, argv: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A job's command as efdl-run's flags that shape it (``-m``, ``--no-python``) and the
    command itself (a script, module or program, and its arguments, passed on as they are).

    Raises:
        ConfigError: the command is empty, or starts with another option (which efdl-run
            would read as one of its own), naming it.
    """
    i = 0
    while i < len(argv) and argv[i] in COMMAND_FLAGS:
        i += 1
    flags, command = tuple(argv[:i]), tuple(argv[i:])
    if not command or not command[0]:
        raise ConfigError(
            f"Job {job_id!r} has no command; expected a script and its arguments "
            "(or -m and a module, or --no-python and a program)."
        )
    if command[0].startswith("-"):
        raise ConfigError(
            f"Job {job_id!r}: its command starts with the option {command[0][:64]!r}; expected "
            "a script, -m and a module, or --no-python and a program. efdl-run's other "
            "options go in the job's environment (--env EFDL_<OPTION>=...)."
        )
    return flags, command


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """How one agent reaches etcd: the endpoints, and files of its own (never the daemon's).

    Attributes:
        endpoints: ``host:port[,host:port...]``, as the daemon reaches etcd.
        ca_file: the CA that signed etcd's certificates (TLS).
        cert_file / key_file: the client certificate the agent presents (where etcd asks
            for one): the one the operator gave for jobs (``--job-etcd-cert``).
        user / password_file: the agent's own etcd user, limited to its job's keys, and the
            file (mode 0600, the job's) that holds its password.
    """

    endpoints: str
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password_file: Path | None = None

    def flags(self) -> list[str]:
        """efdl-run's options for these (no password: a file's name only)."""
        out = ["--etcd", self.endpoints]
        for flag, value in (
            ("--etcd-ca", self.ca_file),
            ("--etcd-cert", self.cert_file),
            ("--etcd-key", self.key_file),
            ("--etcd-user", self.user),
            ("--etcd-password-file", self.password_file),
        ):
            if value is not None:
                out += [flag, str(value)]
        return out


def agent_argv(
    job_id: str,
    argv: Sequence[str],
    min_workers: int,
    max_workers: int,
    cache_url: str,
    gpus: Sequence[int],
    node_id: str,
    address: str,
    access: EtcdAccess,
) -> list[str]:
    """efdl-run's command line for one agent of a job (without the wrapper)."""
    flags, command = split_command(job_id, argv)
    out = [
        *EFDL_RUN,
        *access.flags(),
        "--job-id", job_id,
        "--node-id", node_id,
        "--host", address,
        "--min", str(min_workers),
        "--max", str(max_workers),
        "--gpus", ",".join(map(str, gpus)),
        "--nproc-per-node", "gpu",
    ]  # fmt: skip
    if cache_url:
        out += ["--cache-url", cache_url]
    return [*out, *flags, "--", *command]


def wrapped(exit_file: Path, command: Sequence[str]) -> list[str]:
    """``command`` under efdl.fleet.wrap, which writes its exit code to ``exit_file``."""
    return [*WRAP, str(exit_file), *command]


def daemon_only(name: str) -> bool:
    """Whether the daemon's environment variable ``name`` stays with the daemon."""
    return name in DAEMON_ONLY or name in SECRET_VARIABLES or name.startswith(DAEMON_ONLY_PREFIXES)


def agent_env(
    daemon_env: Mapping[str, str],
    job_env: Sequence[tuple[str, str]],
    private_dir: Path,
    tmp_dir: Path | None,
    uid: int | None,
) -> dict[str, str]:
    """An agent's environment: the daemon's less :func:`daemon_only`; under a uid of its own
    (``uid``), ``HOME`` its private directory, ``TMPDIR`` ``tmp_dir`` and ``USER``/``LOGNAME``
    a name for the uid (which has no account: without them, tools that ask who they are would
    take the daemon's name, or fail); then the job's own variables, which may set any of
    these. Its join timeout is :data:`FLEET_JOIN_TIMEOUT_S` unless the job sets its own."""
    env = {k: v for k, v in daemon_env.items() if not daemon_only(k)}
    env[JOIN_TIMEOUT_ENV] = f"{FLEET_JOIN_TIMEOUT_S:g}"
    if uid is not None:
        env.update(HOME=str(private_dir), USER=f"efdl-job-{uid}", LOGNAME=f"efdl-job-{uid}")
    if tmp_dir is not None:
        env["TMPDIR"] = str(tmp_dir)
    env.update(job_env)
    return env
