"""Warm workers: forked from an interpreter that has imported torch, instead of started cold.

Starting a worker costs a Python interpreter and ``import torch`` (1.5-3 s of CPU on a CPU
host, more on a GPU node with CUDA's libraries) before the script's own first line; every
restart, replacement and newcomer waited for it, and every worker of a node paid it again.
The agent starts one fork server per node (efdl.launcher.forkserver) while it starts and
joins (``--warm-workers``); it imports torch once, and each worker is a child forked from
it: ``python script.py`` for plain and efdl-aware scripts alike, in a process of its own that
starts at once and shares the imported pages with its siblings.

What a forked worker does not share with a fresh one: it imported torch under the agent's
environment, not the worker's. Nothing torch reads at import differs between the two except
the thread counts (``OMP_NUM_THREADS`` and friends), which are applied again in the child
(``torch.set_num_threads``); CUDA is not initialised by the import, so
``CUDA_VISIBLE_DEVICES`` is read first at the script's first CUDA call, as in a fresh process.
A worker whose interpreter settings (``PYTHON*`` variables) differ from the server's starts
cold (:func:`forkable`).

A worker started cold runs as ``python -m efdl.launcher.warm --now script args``: warm or
cold, every Python worker's optimizer steps are watched for the agent
(efdl.launcher.stepwatch) before its script's first line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from efdl._process import die_with_parent
from efdl.protocol.env import SECRET_VARIABLES

log = logging.getLogger(__name__)

# How long after starting workers, and after the newest round, a fork server that ended is
# started again: its import takes CPU from the workers' own start and rebuild.
REFILL_AFTER_S = 5.0
ANSWER_S = (
    10.0  # how long the fork server may take to fork a worker and say its pid (ms, as a rule)
)
REPORT_S = 2.0  # how long a worker's end may go unreported by the server before /proc is read
LOAD_S = 60.0  # how long a worker's start waits for the fork server's import before going cold

# The process names (/proc/PID/comm) of the fork server importing torch, and of one ready.
WARMING_NAME = "efdl-warming"
WAITING_NAME = "efdl-warm"
NAMES = frozenset({WARMING_NAME, WAITING_NAME})
NOW = "--now"  # ``python -m efdl.launcher.warm --now script args``: a cold start
# The environment variables a forked child applies itself (efdl.launcher.forkserver); any
# other PYTHON* variable is read by an interpreter's start only.
APPLIED = frozenset({"PYTHONUNBUFFERED", "PYTHONIOENCODING"})


def set_name(name: str) -> None:
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


def forkable(env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """Whether a worker with environment ``env`` may be forked from a server started with
    ``server_env``: the ``PYTHON*`` variables an interpreter reads at its start agree."""

    def settings(e: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items() if k.startswith("PYTHON") and k not in APPLIED}

    return settings(env) == settings(server_env)


class ForkedProcess:
    """A worker forked by the fork server, seen as :class:`subprocess.Popen` shows a child:
    its pid, its output pipes, its exit code once the server reaped it. Its end is seen
    through a pidfd too: a server that is stopped (SIGSTOP, stuck) reaps nothing and says
    nothing, and the exit code is then read from the process's /proc entry (a zombie's)."""

    def __init__(self, pid: int, args: Sequence[str], stdout: IO[bytes], stderr: IO[bytes]):
        self.pid = pid
        self.args = list(args)
        self.stdin: IO[bytes] | None = None
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfds
            self._pidfd = os.pidfd_open(pid)
            weakref.finalize(self, os.close, self._pidfd)

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._pidfd is None:
                self._ended.wait(left)
                continue
            try:
                done, _, _ = select.select([self._pidfd], [], [], left)
            except (OSError, ValueError):
                done = []
                self._ended.wait(0.1)
            if done and not self._ended.wait(REPORT_S):  # the server did not say: stopped
                self.ended(_zombie_code(self.pid))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped: the pid is still this worker's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _zombie_code(pid: int) -> int:
    """The exit code of process ``pid`` that ended and is not reaped (/proc/PID/stat's
    exit_code, Linux 3.5+); -SIGKILL where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return os.waitstatus_to_exitcode(int(fields[49]))
    except (OSError, IndexError, ValueError):
        return -signal.SIGKILL


class _Server:
    """One fork server process and the thread that reads what it says."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "efdl.launcher.forkserver", str(theirs.fileno())],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            process_group=0,
            preexec_fn=die_with_parent(),
        )
        theirs.close()
        self.ready = threading.Event()
        self.gone = threading.Event()
        self._lock = threading.Lock()
        self._answers: dict[int, int] = {}
        self._abandoned: set[int] = set()  # orders given up on: what they fork is killed
        self.stuck = False  # an order went unanswered: no more orders (see fork)
        self._answered = threading.Condition(self._lock)
        self._forked: dict[int, ForkedProcess] = {}
        self._orders = 0
        threading.Thread(target=self._read, name="efdl-forkserver", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            message: dict[str, Any] = json.loads(data)
            if message.get("ready"):
                self.ready.set()
            elif "id" in message:
                order, pid = int(message["id"]), int(message["pid"])
                with self._lock:
                    late = order in self._abandoned
                    if not late:
                        self._answers[order] = pid
                        self._answered.notify_all()
                if late:  # its worker was started cold meanwhile: not two of one rank
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                        os.kill(pid, signal.SIGKILL)
            else:
                with self._lock:
                    proc = self._forked.pop(int(message["pid"]), None)
                if proc is not None:
                    proc.ended(int(message["code"]))
        # The server is gone, and its children with it (their death signal): SIGKILL.
        with self._lock:
            self.gone.set()
            self._answered.notify_all()
            left, self._forked = list(self._forked.values()), {}
        for proc in left:
            proc.ended(-signal.SIGKILL)
        self.ready.clear()

    def fork(
        self, argv: Sequence[str], args: Sequence[str], env: Mapping[str, str]
    ) -> ForkedProcess | None:
        """A worker forked to run ``argv``; None if the server could not (it is gone)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with self._lock:
            self._orders += 1
            order = self._orders
        try:
            message = json.dumps({"id": order, "argv": list(argv), "env": dict(env)}).encode()
            socket.send_fds(self.sock, [message], [out_w, err_w])
        except OSError as e:
            log.warning("The fork server (pid %d) took no order: %s.", self.proc.pid, e)
            for fd in (out_r, err_r):
                os.close(fd)
            return None
        finally:
            os.close(out_w)
            os.close(err_w)
        deadline = time.monotonic() + ANSWER_S
        with self._lock:
            while order not in self._answers and not self.gone.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._answered.wait(left)
            pid = self._answers.pop(order, None)
            if pid is None:
                self._abandoned.add(order)
                self.stuck = not self.gone.is_set()
            else:
                proc = ForkedProcess(pid, args, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
                self._forked[pid] = proc
                return proc
        for fd in (out_r, err_r):
            os.close(fd)
        if self.stuck:
            log.warning(
                "The fork server (pid %d) forked no worker within %.0f s (stopped? stuck in the "
                "kernel?); this node's workers start cold from now on.",
                self.proc.pid,
                ANSWER_S,
            )
        return None

    def close(self) -> None:
        """End of input: the server kills what it forked and exits (this waits for it)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=ANSWER_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


class WarmPool:
    """Where an agent's workers start warm: ``start()`` forks one from the node's fork
    server, ``fill()`` starts the server (again, if it ended).

    Args:
        size: 0: every worker starts cold; else workers start warm.
        env: the environment the server starts with (the agent's).
    """

    def __init__(self, size: int, env: Mapping[str, str]) -> None:
        self.size = size
        self._env = dict(env)
        self._server: _Server | None = None

    def fill(self, count: int | None = None) -> list[int]:
        """Start the fork server unless it runs (or ``count`` is 0); the pids started."""
        want = self.size if count is None else count
        if not want or (self._server is not None and not self._server.gone.is_set()):
            return []
        if self._server is not None:
            self._server.close()
        self._server = _Server(self._env)
        return [self._server.proc.pid]

    def wait_loaded(self, timeout_s: float) -> bool:
        """Wait until the fork server is loaded, or ``timeout_s`` passed; whether it is."""
        server = self._server
        if server is None:
            return False
        deadline = time.monotonic() + timeout_s
        while not server.ready.wait(0.1):
            if time.monotonic() > deadline or server.gone.is_set():
                return False
        return True

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ForkedProcess | None:
        """The worker command ``args`` with ``env``, forked from the fork server; None when
        there is none, or the command cannot start warm (see :func:`warm_command` and
        :func:`forkable`). A server still importing is waited for (a cold start would import
        beside it), at most :data:`LOAD_S`."""
        command = warm_command(args)
        server = self._server
        if command is None or server is None or server.stuck or not forkable(env, server.env):
            return None
        if not self.wait_loaded(LOAD_S):
            log.warning("The fork server (pid %d) is not ready; starting cold.", server.proc.pid)
            return None
        return server.fork(command, args, env)

    def close(self) -> None:
        """Let the fork server go (it kills any worker it forked that still runs)."""
        if self._server is not None:
            self._server.close()
            self._server = None


def import_torch() -> None:
    """What a warm interpreter imports ahead of need. torch._dynamo (which the first
    ``optimizer.step()`` imports lazily: over a second here) makes torch's compile cache
    directory in the temp directory at its import; one that it made here and left empty is
    removed, as a worker that never steps an optimizer would not have made it (torch makes
    it again when it writes there)."""
    import tempfile

    import torch
    import torch.distributed

    temp = tempfile.gettempdir()
    before = set(os.listdir(temp))
    with contextlib.suppress(Exception):  # only an optimisation
        import torch._dynamo  # noqa: F401
    for name in set(os.listdir(temp)) - before:
        if name.startswith("torchinductor_"):
            with contextlib.suppress(OSError):  # not empty after all: torch's
                os.rmdir(os.path.join(temp, name))
    # efdl's worker library, which an efdl-aware script imports (70 ms); nothing in it starts
    # work, a group or the efdl runtime at import.
    import efdl.worker.cache
    import efdl.worker.runtime
    import efdl.worker.sampler
    import efdl.worker.state  # noqa: F401


def apply_thread_count() -> None:
    """Apply the worker's ``OMP_NUM_THREADS`` (libgomp read the agent's at the import)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


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
        start(sys.argv[2:])
        return
    raise SystemExit(f"usage: python -m {__name__} {NOW} script [args] | -m module [args]")


def start(argv: list[str]) -> None:
    """Run the worker's command line; an exception is printed as python prints it."""
    try:
        _run(argv)
    except Exception as exc:  # printed as python would, from the script's frames on
        # (SystemExit is no Exception: the script's exit code stands)
        import runpy
        import traceback

        ours = {
            os.path.abspath(__file__),
            os.path.abspath(runpy.__file__ or ""),
            "<frozen runpy>",
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py"),
        }
        tb = exc.__traceback__
        while tb is not None and _where(tb.tb_frame.f_code.co_filename) in ours:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def _where(filename: str) -> str:
    return filename if filename.startswith("<") else os.path.abspath(filename)


if __name__ == "__main__":
    main()


def cores_to_spare(slots: int, gpus: bool, cpus: int) -> bool:
    """Whether a node has cores for work beside its workers' (an import of torch ahead of
    need: the fork server's, the agent's preload): a GPU node, or a CPU node with at least 4
    cores per worker slot. Not a CPU node with fewer, where that work shares the cores the
    first workers start and train on, and costs more than it saves."""
    return gpus or cpus >= 4 * slots


def default_warm(slots: int, gpus: bool, cpus: int) -> int:
    """Whether a node forks its workers unless told (1) or starts them cold (0): where it has
    :func:`cores_to_spare`."""
    return 1 if cores_to_spare(slots, gpus, cpus) else 0


def warm_pool(size: int | None, args: Sequence[str], slots: int, gpus: bool, cpus: int) -> WarmPool:
    """The node's fork server, started now: it imports torch while the agent starts and
    joins. ``--warm-workers``: 0 starts every worker cold, any other number forks them; by
    default :func:`default_warm`. Only for this Python running a script or a module."""
    size = default_warm(slots, gpus, cpus) if size is None else size
    # Never the agent's secrets: the server's /proc/<pid>/environ is what it started with.
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    pool = WarmPool(size if warm_command(args) else 0, env)
    pool.fill()
    return pool


class RefillTimer:
    """When an agent starts its fork server again if it ended (killed, out of memory):
    :data:`REFILL_AFTER_S` after its workers start, and after the newest round; as soon as
    the next workers start once a worker failed, for a second round is likely near (a dead
    node's lease expiring after its peers' failures).

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
        """Workers started: look at the server once the workers are past their own start (a
        new server's import would share the node's cores with them)."""
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
                "%s: the fork server had ended; started it again (pid %d).",
                self._tag(),
                started[0],
            )
