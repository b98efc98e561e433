"""The node's fork server: one interpreter that imports torch once, then forks each worker.

Run as ``python -m efdl.launcher.forkserver FD`` by the agent (efdl.launcher.warm's
:class:`~efdl.launcher.warm.WarmPool`): ``FD`` is its end of a ``SOCK_SEQPACKET`` socket pair,
it dies with the agent. One JSON message a packet.

- Out, once its imports are done: ``{"ready": true}``.
- In: ``{"id": N, "argv": [...], "env": {...}}`` with two file descriptors (``SCM_RIGHTS``):
  the worker's stdout and stderr. It forks a child that runs ``argv`` (``script args`` or
  ``-m module args``, as after ``python``) with exactly ``env`` as its environment, and
  answers ``{"id": N, "pid": PID}``.
- Out, when a child ends (reaped here): ``{"pid": PID, "code": CODE}`` (-N: signal N).
- End of input (the agent closed its end, or died): it SIGKILLs its children's process groups,
  reaps them and exits.

A child is a worker as a fresh ``python script.py`` would be: its own process group (the agent
stops it with its children), stdin from /dev/null, the pipes it was given as stdout and
stderr, the worker's environment, ``sys.argv``, ``sys.path[0]`` and ``__main__`` as python
sets them, its exit status the script's; it gets SIGKILL when this server dies (and this
server when the agent dies). It inherits what the import made, nothing it did not: no CUDA
context (the import does not initialise CUDA), no thread (this server has one), no open file
but the import's own. A fresh interpreter's start reads a few environment variables that a
fork cannot read again; the agent starts a worker whose ``PYTHON*`` variables differ from
this server's cold (:func:`efdl.launcher.warm.forkable`), and the child applies
``PYTHONUNBUFFERED``, ``PYTHONIOENCODING`` and the thread counts (``OMP_NUM_THREADS``) itself.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import select
import signal
import socket
import sys
from typing import Any, NoReturn

from efdl._process import die_with
from efdl.launcher import warm
from efdl.protocol.env import WARM_ENV

MAX_ORDER = 1 << 20  # bytes of one order (an environment of a few kB, as a rule)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the agent is gone: its end of input follows
        sock.send(json.dumps(message).encode())


def _stdio(env: dict[str, str]) -> None:
    """New ``sys.stdout`` and ``sys.stderr`` on fds 1 and 2, made as a fresh interpreter with
    this environment makes them (its buffering and encoding)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding, _, errors = env.get("PYTHONIOENCODING", "").partition(":")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=encoding or old.encoding,
            errors=errors or ("backslashreplace" if fd == 2 else old.errors),
            line_buffering=fd == 2 and not unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _child(order: dict[str, Any], fds: list[int], server: int, own: list[int]) -> NoReturn:
    """Become the worker: set the process up as a fresh one, run the script, and end as the
    interpreter ends (SystemExit unwinds to the top: exit handlers, finalisation)."""
    die_with(server)
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in own:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    env = dict(order["env"])
    os.environ.clear()
    os.environ.update(env)
    os.environ[WARM_ENV] = "1"
    _stdio(env)
    warm.set_name(os.path.basename(sys.executable))  # as a fresh worker's
    warm.apply_thread_count()
    warm.start(list(order["argv"]))
    raise SystemExit(0)


def _kill_all(children: set[int]) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def serve(sock: socket.socket, server: int) -> None:
    """Fork a worker per order, report each one's exit; return at the end of input. In a
    child it does not return: the child's SystemExit unwinds through it."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes select
    children: set[int] = set()
    _send(sock, {"ready": True})
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 4096):
                    pass
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(sock, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock.fileno() in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_ORDER, 2)
            except OSError:
                data, fds = b"", []
            if not data:
                _kill_all(children)
                return
            order = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(order, fds, server, [sock.fileno(), wake_r, wake_w])
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"id": order["id"], "pid": pid})


def main() -> None:
    fd = int(sys.argv[1])  # started with the agent's death signal (efdl._process)
    warm.set_name(warm.WARMING_NAME)  # told apart from a worker, and from one that is ready
    warm.import_torch()
    sock = socket.socket(fileno=fd)
    gc.collect()
    gc.freeze()  # the children share these pages instead of copying them as the GC walks them
    warm.set_name(warm.WAITING_NAME)
    serve(sock, os.getpid())


if __name__ == "__main__":
    main()
