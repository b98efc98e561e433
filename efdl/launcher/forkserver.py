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
import ctypes
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

# OpenBLAS's setter, as numpy's wheels and others name it (threadpoolctl's list).
SET_BLAS_THREADS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
)
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


def _reseed() -> None:
    """Seed what a fresh interpreter seeds from the OS at its start, which every child would
    otherwise inherit from this server alike (each rank, each restart: the same dropout masks
    and augmentations): torch's default generator, numpy's global one. (Python's ``random``
    seeds itself again after a fork; ``hash()``'s secret is the server's, one per node: set
    ``PYTHONHASHSEED``, or ``--warm-workers 0``, where a script needs it per process.)"""
    import torch

    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _blas_threads(env: dict[str, str]) -> None:
    """Apply the worker's thread count to the OpenBLAS that numpy loaded here: it read the
    agent's environment at its load (torch's own count: efdl.launcher.warm.apply_thread_count)."""
    value = env.get("OPENBLAS_NUM_THREADS") or env.get("OMP_NUM_THREADS") or ""
    if not value.isdigit() or int(value) < 1:
        return
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    for path in paths:
        with contextlib.suppress(OSError):
            lib = ctypes.CDLL(path)
            for name in SET_BLAS_THREADS:
                setter = getattr(lib, name, None)
                if setter is not None:
                    setter(int(value))
                    break


def _shadowed(argv: list[str], imported: frozenset[str]) -> list[str]:
    """The modules this server imported beyond a cold start's that the script's own
    directory (``sys.path[0]`` of ``python script.py``; the working directory for ``-m``)
    would shadow: the script would import its own, as under ``python script.py``."""
    where = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    try:
        names = set(os.listdir(where))
    except OSError:
        return []
    return sorted(m for m in imported if f"{m}.py" in names or m in names)


def _child(
    order: dict[str, Any], fds: list[int], server: int, own: list[int], imported: frozenset[str]
) -> NoReturn:
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
    argv = list(order["argv"])
    shadowed = _shadowed(argv, imported)
    if shadowed:  # started cold in this same process: same pid, pipes and group
        os.write(
            2,
            f"efdl: {shadowed} beside the script shadow modules efdl's fork server "
            "had imported: this worker starts cold.\n".encode(),
        )
        os.execv(sys.executable, [sys.executable, "-m", "efdl.launcher.warm", warm.NOW, *argv])
    os.environ[WARM_ENV] = "1"
    _stdio(env)
    warm.set_name(os.path.basename(sys.executable))  # as a fresh worker's
    _reseed()
    warm.apply_thread_count()
    _blas_threads(env)
    warm.start(argv)
    raise SystemExit(0)


def _kill_all(children: set[int]) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def serve(sock: socket.socket, server: int, imported: frozenset[str]) -> None:
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
                _child(order, fds, server, [sock.fileno(), wake_r, wake_w], imported)
            with contextlib.suppress(OSError):  # the child does it too: whichever is first
                os.setpgid(pid, pid)  # (a stop sent at once reaches the group)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"id": order["id"], "pid": pid})


def main() -> None:
    fd = int(sys.argv[1])  # started with the agent's death signal (efdl._process)
    warm.set_name(warm.WARMING_NAME)  # told apart from a worker, and from one that is ready
    # What a cold worker has imported before its script's first line (torch, for the step
    # watch): beyond it, what the script's own directory must not shadow (see _shadowed).
    import torch.optim.optimizer  # noqa: F401

    from efdl.launcher import stepwatch  # noqa: F401

    cold = {name.partition(".")[0] for name in sys.modules}
    warm.import_torch()
    imported = frozenset({name.partition(".")[0] for name in sys.modules} - cold)
    sock = socket.socket(fileno=fd)
    gc.collect()
    gc.freeze()  # the children share these pages instead of copying them as the GC walks them
    warm.set_name(warm.WAITING_NAME)
    serve(sock, os.getpid(), imported)


if __name__ == "__main__":
    main()
