"""Warm worker processes: an interpreter with torch already imported, waiting for its place.

Starting a worker costs a Python interpreter and ``import torch`` (1.5-3 s on a CPU host,
more on a GPU node with CUDA's libraries) before the script's own first line; every restart,
replacement and newcomer waited for it. The agent keeps processes started ahead of need
(``--warm-workers``); when it needs a worker, it hands one of them the worker's command line
and environment, and the script starts at once in that same process (same pid, same pipes):
``python script.py`` for plain and efdl-aware scripts alike.

What a warm process does not share with a fresh one: it imported torch under the agent's
environment, not the worker's. Nothing torch reads at import differs between the two except
the thread counts (``OMP_NUM_THREADS`` and friends), which are applied again at the hand-over
(``torch.set_num_threads``); CUDA is not initialised by the import, so ``CUDA_VISIBLE_DEVICES``
is read first at the script's first CUDA call, as in a fresh process.

Run as ``python -m efdl.launcher.warm``: it imports torch, then waits for one JSON line on its
standard input, ``{"argv": [...], "env": {...}}`` (argv as after ``python``: ``script args``
or ``-m module args``), and runs it as ``__main__``. End of input: it exits 0 unused.
A worker started cold runs as ``python -m efdl.launcher.warm --now script args``, in its own
environment at once: warm or cold, every Python worker's optimizer steps are watched for the
agent (efdl.launcher.stepwatch) before its script's first line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from efdl._process import spawn_worker
from efdl.protocol.env import SECRET_VARIABLES, WARM_ENV

log = logging.getLogger(__name__)

# How long after starting workers, and after the newest round, the warm pool is filled again:
# a warm process importing torch takes CPU from the workers' own start and rebuild.
REFILL_AFTER_S = 5.0

# The process names (/proc/PID/comm) of a warm process importing torch, and of one ready and
# waiting for its place.
WARMING_NAME = "efdl-warming"
WAITING_NAME = "efdl-warm"
NAMES = frozenset({WARMING_NAME, WAITING_NAME})
NOW = "--now"  # ``python -m efdl.launcher.warm --now script args``: a cold start


def _set_name(name: str) -> None:
    """Name this process as ps, top and /proc/PID/comm show it (Linux; 15 bytes)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name[:15])


def cold_command(args: Sequence[str]) -> list[str]:
    """The worker command ``args`` as a process of its own starts it: a Python script or
    module through this module at once (its steps watched, as a warm one's), anything else
    (``--no-python``) as it is."""
    command = warm_command(args)
    if command is None:
        return list(args)
    return [sys.executable, "-m", "efdl.launcher.warm", NOW, *command]


def warm_command(args: Sequence[str]) -> list[str] | None:
    """The part of a worker command a warm process runs (after ``python``), or None when the
    command is not this Python running a script or a module (``--no-python``)."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m":
        return list(args[1:]) if len(args) > 2 else None
    return None if args[1].startswith("-") else list(args[1:])


class WarmPool:
    """Warm processes for one agent: ``take()`` one ready to become a worker, ``fill()`` up
    to ``size``.

    Args:
        size: how many to keep (0: none; every worker starts cold).
        env: the environment they start with (the agent's).
    """

    def __init__(self, size: int, env: Mapping[str, str]) -> None:
        self.size = size
        self._env = dict(env)
        self._procs: list[subprocess.Popen[bytes]] = []

    def fill(self, count: int | None = None) -> list[int]:
        """Start warm processes until ``count`` (default: the pool's size) are waiting;
        returns the pids of those started."""
        want = self.size if count is None else count
        self._procs = [p for p in self._procs if p.poll() is None]
        started = []
        while len(self._procs) < want:
            proc = spawn_worker([sys.executable, "-m", __name__], self._env, subprocess.PIPE)
            self._procs.append(proc)
            started.append(proc.pid)
        return started

    def loaded(self) -> int:
        """How many have imported torch and wait (their name says so)."""
        return sum(1 for p in self._procs if p.poll() is None and _name(p.pid) == WAITING_NAME)

    def wait_loaded(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` of them are loaded, or ``timeout_s`` passed; whether they are.
        (Polled every 50 ms: a handful of /proc reads.)"""
        deadline = time.monotonic() + timeout_s
        while self.loaded() < count:
            if time.monotonic() > deadline or not any(p.poll() is None for p in self._procs):
                return False
            time.sleep(0.05)
        return True

    def take(self) -> subprocess.Popen[bytes] | None:
        """The oldest live warm process (the one furthest along its imports), or None."""
        while self._procs:
            proc = self._procs.pop(0)
            if proc.poll() is None:
                return proc
            log.warning("A warm worker process (pid %d) had ended (%s).", proc.pid, proc.returncode)
        return None

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """The worker command ``args`` with ``env``, started in a warm process; None when
        none is waiting or the command cannot start warm (see :func:`warm_command`)."""
        command = warm_command(args)
        proc = self.take() if command is not None else None
        if proc is not None and command is not None:
            _hand_over(proc, command, env)
        return proc

    def close(self) -> None:
        """Let the unused ones go, at once: they hold nothing but imported modules."""
        for proc in self._procs:
            _close_quietly(proc)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in self._procs:
            proc.wait()
        self._procs = []


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _hand_over(proc: subprocess.Popen[bytes], argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Hand a warm process its worker's command line and environment."""
    assert proc.stdin is not None
    with contextlib.suppress(OSError):  # it died meanwhile: its exit is reported as a worker's
        proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env)}).encode() + b"\n")
    _close_quietly(proc)


def _close_quietly(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()


def _run(argv: list[str]) -> None:
    """Run ``argv`` (``script args`` or ``-m module args``) as ``python`` would, its optimizer
    steps watched for the agent (efdl.launcher.stepwatch)."""
    import runpy

    from efdl.launcher import stepwatch

    stepwatch.install()

    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()  # as python -m does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as python script.py does
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    if sys.argv[1:2] == [NOW]:  # a cold start: the worker's own environment, at once
        _start(sys.argv[2:])
        return
    _set_name(WARMING_NAME)  # told apart from a worker, and from one that is ready
    import torch
    import torch.distributed

    with contextlib.suppress(Exception):  # only an optimisation: what the first
        import torch._dynamo  # optimizer.step() imports lazily (over a second here)
    _set_name(WAITING_NAME)
    line = sys.stdin.buffer.readline()
    if not line:
        return  # the agent let it go unused
    order = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a worker's stdin, as the agent gives a cold one
    os.close(devnull)
    os.environ.clear()
    os.environ.update(order["env"])
    os.environ[WARM_ENV] = "1"
    _set_name(os.path.basename(sys.executable))  # as a fresh worker's
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # libgomp read the agent's at import
        torch.set_num_threads(int(threads))
    _start(list(order["argv"]))


def _start(argv: list[str]) -> None:
    """Run the worker's command line; an exception is printed as python prints it."""
    try:
        _run(argv)
    except Exception as exc:  # printed as python would, from the script's frames on
        # (SystemExit is no Exception: the script's exit code stands)
        import runpy
        import traceback

        ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or ""), "<frozen runpy>"}
        tb = exc.__traceback__
        while tb is not None and _where(tb.tb_frame.f_code.co_filename) in ours:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def _where(filename: str) -> str:
    return filename if filename.startswith("<") else os.path.abspath(filename)


if __name__ == "__main__":
    main()


def default_warm(slots: int, gpus: bool, cpus: int) -> int:
    """How many warm processes a node keeps unless told: see :func:`warm_pool`."""
    return slots if gpus or cpus >= 4 * slots else 0


def warm_pool(size: int | None, args: Sequence[str], slots: int, gpus: bool, cpus: int) -> WarmPool:
    """The node's warm worker processes, the first ``slots`` started now: the first workers'
    interpreters import torch while the agent starts and joins. ``--warm-workers``; by
    default one per slot on a GPU node or one with at least 4 cores per slot, none on a CPU
    node with fewer: each refill imports torch on a core the workers train on there."""
    size = default_warm(slots, gpus, cpus) if size is None else size
    # Never the agent's secrets: a warm process's /proc/<pid>/environ is what it started with.
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    pool = WarmPool(size if warm_command(args) else 0, env)
    pool.fill(slots if pool.size else 0)
    return pool


class RefillTimer:
    """When an agent fills its warm pool again: :data:`REFILL_AFTER_S` after its workers
    start, and after the newest round; as soon as the next workers start once a worker
    failed, for a second round is likely near (a dead node's lease expiring after its peers'
    failures).

    Args:
        pool: the agent's warm pool.
        tag: says the job, node and generation, for the log.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        pool: WarmPool,
        tag: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._tag = tag
        self._clock = clock
        self.due: float | None = None  # when (monotonic) to fill the pool; None: not now
        self._soon = False

    def soon(self) -> None:
        """A worker failed: fill the pool as soon as the next workers start."""
        self._soon = True

    def started(self) -> None:
        """Workers started, taking warm processes: replace them once the workers are past
        their own start (their imports and the warm ones' would share the node's cores)."""
        self.due = self._clock() + (0.0 if self._soon else REFILL_AFTER_S)
        self._soon = False

    def round_came(self) -> None:
        """A new round: its rebuild or restart goes first (imports would slow it)."""
        if self.due is not None and not self._soon:
            self.due = max(self.due, self._clock() + REFILL_AFTER_S)

    def fill(self) -> None:
        """The time has come: fill the pool."""
        self.due = None
        started = self._pool.fill()
        if started:
            log.info(
                "%s: started %d warm worker process(es) (pids %s).",
                self._tag(),
                len(started),
                started,
            )
