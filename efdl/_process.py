"""Process helpers shared by the embedded etcd and the launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the caller must handle a lost race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM ``proc``, wait up to ``grace_s``, then SIGKILL; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
