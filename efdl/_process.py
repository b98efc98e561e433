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


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get ``sig`` when its parent dies (Linux).

    This is what keeps workers and the embedded etcd from outliving a SIGKILLed agent.
    """

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
