"""Process helpers shared by the embedded etcd and the launcher."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: the child of a multi-threaded parent must not dlopen.
_prctl = (
    ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None
)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get ``sig`` when its parent dies (Linux).

    This is what keeps workers and the embedded etcd from outliving a SIGKILLed agent. The
    signal comes when the *thread* that started the child ends, so start children from a
    thread that lives as long as the agent (its main thread).
    """
    parent = os.getpid()

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

    return preexec


def spawn_worker(
    args: Sequence[str], env: Mapping[str, str], stdin: int
) -> subprocess.Popen[bytes]:
    """A worker process: in a process group of its own (stopped with its children), its
    output piped to the agent, SIGKILLed if the agent dies. Call from the agent's main thread
    (see :func:`die_with_parent`)."""
    return subprocess.Popen(
        list(args),
        env=dict(env),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,
        preexec_fn=die_with_parent(),
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the caller must handle a lost race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# How long a SIGKILLed process may take to go: one stuck in the kernel (a GPU driver call, a
# hung NFS read) cannot be killed until that call returns, and nothing waits on it for ever.
REAP_S = 30.0


def reap(proc: subprocess.Popen[Any], what: str, timeout_s: float = REAP_S) -> int | None:
    """Wait up to ``timeout_s`` for a SIGKILLed ``proc`` to go; its exit code, or None (logged)
    if it is still there (in uninterruptible sleep): the caller goes on without it."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.error(
            "%s (pid %d) is still there %.0f s after SIGKILL (stuck in the kernel, e.g. in a GPU "
            "driver call); going on without waiting for it.",
            what,
            proc.pid,
            timeout_s,
        )
        return None


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM ``proc``, wait up to ``grace_s``, then SIGKILL; returns its exit code (None if
    it did not go within :data:`REAP_S` of the SIGKILL either)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return reap(proc, f"Process {proc.args!r}"[:200])


# Private directories (an agent's sockets and error files, an embedded etcd's data) are
# made in the temp directory with an owner mark; a process that is SIGKILLed cannot remove
# its own, so the next efdl process on the host removes those whose owner is gone.
TEMP_PREFIX = "efdl-"
_OWNER = ".owner"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def private_dir(prefix: str) -> Path:
    """A new directory ``<tmp>/efdl-<prefix>...`` marked as this process's."""
    path = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX + prefix))
    (path / _OWNER).write_text(f"{os.getpid()} {_pid_namespace()}\n")
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_private_dirs() -> list[Path]:
    """Remove the private directories whose owner process has ended (it was killed). Only
    this user's, marked from this PID namespace (a PID from another is not comparable). A
    directory whose PID now names another process is kept (it is cheap; removing a live
    one is not). Returns those removed."""
    removed = []
    namespace, uid = _pid_namespace(), os.getuid()
    for path in Path(tempfile.gettempdir()).glob(TEMP_PREFIX + "*"):
        with contextlib.suppress(OSError, ValueError):
            if path.stat().st_uid != uid:
                continue
            pid, ns = (path / _OWNER).read_text().split()
            if ns == namespace and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed
