"""Process helpers shared by the embedded etcd and the launcher."""

from __future__ import annotations

import _io
import atexit
import contextlib
import ctypes
import gc
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
from typing import Any, NoReturn, Protocol

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
        die_with(parent, sig)

    return preexec


def die_with(parent: int, sig: int = signal.SIGKILL) -> None:
    """Make this process get ``sig`` when its parent (``parent``, its pid) dies (Linux); exit
    at once if it has died already."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def skip_final_gc() -> None:
    """Let this process end without the interpreter's last garbage collections.

    A process that imported torch spends about a second ending after its last line (Python
    3.11, idle 2-core host; seconds when the cores are oversubscribed): nearly all of it in
    the full collections the interpreter runs while it tears its modules down, each walking
    every object alive (about 300,000 after torch, torch.distributed and an optimizer). For a
    worker that leaves its GPU for someone else, that second is the GPU's.

    So, at exit: the exit handlers registered since this module was imported (by efdl's
    worker API on first use: the user's, as a rule) run, then every open file is flushed and
    the heap frozen (``gc.freeze``: the objects alive move where no collection looks), then
    the handlers from before (logging's, multiprocessing's, ``weakref.finalize``'s) run as
    always. The user's ``finally`` blocks have run; what module teardown frees by reference
    count is still freed. Left to the operating system: objects that only a reference cycle
    keeps (a module's globals are such, through their functions), whose ``__del__``
    Python's exit never promised to run; their files' data is flushed here.
    """
    global _skip_final_gc
    _skip_final_gc = True


_skip_final_gc = False


def exit_left() -> NoReturn:
    """End this worker, which left its job as the agent asked: exit 0, without the final
    collections (:func:`skip_final_gc`), after the ``finally`` blocks the exit unwinds."""
    skip_final_gc()
    raise SystemExit(0)


def _at_exit() -> None:
    if not _skip_final_gc:
        return
    for obj in gc.get_objects():  # files and their buffers are tracked (about 20 ms)
        if issubclass(type(obj), _io._IOBase):  # the C base: no __class__ lookups
            with contextlib.suppress(Exception):  # closed, detached, a broken pipe
                obj.flush()
    gc.freeze()


atexit.register(_at_exit)  # at import: after the handlers of what was imported before efdl


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


class Child(Protocol):
    """A child process as the agent handles it: a :class:`subprocess.Popen`, or a worker
    forked by the node's fork server (efdl.launcher.warm.ForkedProcess)."""

    pid: int
    returncode: int | Any

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def reap(proc: Child, what: str, timeout_s: float = REAP_S) -> int | None:
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
