"""The job's etcd that one of its nodes serves (torchrun's static launch, ``--serve-etcd``):
who may reach it, and where its data lives.

Whoever reaches a job's etcd can stop the job, revoke its leases, or join it as a node and be
sent the model's state at the next sync. So an etcd served where other hosts reach it needs
the job's token: etcd's auth is turned on with it (user ``root``) before the server listens
there, and every node and ``efdl`` command authenticates with it. Without a token, only a
loopback address is served.

Its data lives in ``<state dir>/etcd/<job>-<port>`` (mode 0700), not in a temporary
directory, so that the node, restarted, serves the job's records again rather than an empty
etcd; the directory goes when the job ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from efdl.errors import ConfigError, EfdlError
from efdl.protocol.env import JOB_TOKEN_ENV, JOB_TOKEN_USER
from efdl.rendezvous.api import Endpoint
from efdl.rendezvous.embedded import AuthState, EmbeddedEtcd, auth_state, require_auth
from efdl.rendezvous.plaintext import is_loopback

log = logging.getLogger(__name__)

PRIVATE_MODE = 0o700


def default_state_dir(env: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME/efdl``, else ``~/.local/state/efdl`` (the XDG base directory spec)."""
    base = env.get("XDG_STATE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "state"
    return root / "efdl"


def job_directory(state_dir: Path, job_id: str, port: int) -> Path:
    """Where the etcd of job ``job_id`` served on ``port`` keeps its data and log. The port is
    part of it: jobs that name no id (torchrun's ``none``) on other ports are other jobs."""
    return state_dir / "etcd" / f"{job_id}-{port}"


def private_directory(path: Path, fix_mode: bool = True) -> Path:
    """``path`` as a directory of this user's, made with mode 0700 if missing (and set to it
    when ``fix_mode``).

    Raises:
        ConfigError: it is not a directory (a link, a file), or it belongs to another user.
    """
    try:
        with contextlib.suppress(FileExistsError):  # a file there: said below
            path.mkdir(mode=PRIVATE_MODE, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise ConfigError(f"Cannot make the directory {str(path)!r}: {exc.strerror}.") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{str(path)!r} is not a directory (a link or a file); expected one.")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"The directory {str(path)!r} belongs to user {info.st_uid}, not to this one "
            f"({os.geteuid()}); give a state directory of your own (--state-dir)."
        )
    if fix_mode and stat.S_IMODE(info.st_mode) != PRIVATE_MODE:
        path.chmod(PRIVATE_MODE)
    return path


def make_job_directory(state_dir: Path, job_id: str, port: int) -> Path:
    """The job's directory (see :func:`job_directory`), made private: mode 0700, as is each
    directory efdl makes on the way; an existing state directory keeps its mode."""
    for parent in reversed(state_dir.parents):
        if not parent.exists():
            private_directory(parent, fix_mode=False)
    private_directory(state_dir, fix_mode=False)
    private_directory(state_dir / "etcd")
    return private_directory(job_directory(state_dir, job_id, port))


def resolve(host: str, port: int) -> tuple[str, ...]:
    """The IP addresses ``host`` stands for (empty if it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return ()
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


def refusal(target: str, addresses: Sequence[str], token: bool, serving: bool) -> str | None:
    """Why the job's etcd at ``target`` (which resolves to ``addresses``) must not be served,
    or joined, as asked; None when it may. Without a token only loopback addresses may be:
    other hosts could reach the etcd and take the job over. Pure.

    Args:
        target: ``host:port`` as given.
        addresses: what its host resolves to (none: it does not resolve).
        token: a job token was given.
        serving: this node would serve it (else it would join through it).
    """
    if token:
        return None
    exposed = [a for a in addresses if not is_loopback(a)] if addresses else [target]
    if not exposed:
        return None
    where = ", ".join(exposed)
    how = (
        f"Give every node of the job the same secret in {JOB_TOKEN_ENV} (or a file named by "
        "--job-token-file), e.g. made with `openssl rand -hex 32`"
    )
    if serving:
        return (
            f"Cannot serve the job's etcd at {target} without a job token: {where} can be "
            "reached from other hosts, and whoever reaches the job's etcd can stop the job, "
            f"join it as a node and be sent its model state. {how}; or, for a job on this "
            "host alone, serve it on 127.0.0.1."
        )
    return (
        f"Cannot join the job's etcd at {target} without a job token: {where} is not a "
        "loopback address, and the node that serves the job's etcd there refuses to without "
        f"one. {how}."
    )


class ServedEtcd:
    """The job's etcd, served by this node at ``target`` with its data in ``directory``.

    Args:
        target: where the nodes reach it (``--etcd``'s first endpoint, or the master address).
        ip: the address it listens on (``target``'s host, resolved).
        directory: its data and log (see :func:`make_job_directory`).
        token: the job's token: etcd's auth is on with it; None: off (loopback only).
    """

    def __init__(self, target: Endpoint, ip: str, directory: Path, token: str | None) -> None:
        self.target = target
        self.directory = directory
        self._token = token
        self._server = EmbeddedEtcd(
            data_dir=directory / "data",
            log_file=directory / "etcd.log",
            host=ip,
            client_port=target.port,
            durable=True,
        )
        self.job_ended = False  # set when the job has ended: its data is removed at stop

    def start(self) -> ServedEtcd:
        """Turn auth on in its data (with a token), then serve it.

        Raises:
            ConfigError: the data was served with another token, or with one and none is
                given now; etcd did not start (the address is not this host's, the port is
                taken).
        """
        data = self.directory / "data"
        kept = data.is_dir()
        try:
            if self._token is not None:
                require_auth(data, JOB_TOKEN_USER, self._token)
            self._server.start()
        except EfdlError as exc:
            raise ConfigError(
                f"Cannot serve the job's etcd at {self.target.target} (--serve-etcd, or "
                "--node-rank 0 of a static launch; is it an address of this host, and the port "
                f"free? its data: {self.directory}): {exc}"
            ) from None
        if self._token is None:
            self._refuse_closed_data()
        log.info(
            "Serving the job's etcd at %s (its nodes' rendezvous; %s, %s in %s).",
            self.target.target,
            "auth on with the job token" if self._token else "no auth: loopback only",
            "its data kept from before" if kept else "new data",
            self.directory,
        )
        return self

    def _refuse_closed_data(self) -> None:
        """Data served with a token before and none now: say so, not "no user was given"."""
        channel = grpc.insecure_channel(self._server.endpoint.target)
        try:
            state = auth_state(channel, JOB_TOKEN_USER, None)
        except EfdlError:
            return  # the agent's own client says what is wrong
        finally:
            channel.close()
        if state is AuthState.CLOSED:
            self._server.stop(remove_data=False)
            raise ConfigError(
                f"The job's etcd data in {self.directory} was served with a job token, and "
                f"none was given now: give this node the job's token ({JOB_TOKEN_ENV} or "
                "--job-token-file), or remove that directory to start the job's etcd afresh."
            )

    def stop(self) -> None:
        """Stop serving; remove the data if the job has ended (else a restart serves it)."""
        self._server.stop(remove_data=False)
        if self.job_ended:
            shutil.rmtree(self.directory, ignore_errors=True)
            log.info("The job has ended: removed its etcd data in %s.", self.directory)
        else:
            log.info("Kept the job's etcd data in %s for a restart of this node.", self.directory)
