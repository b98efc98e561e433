"""The worker processes of one node for one round: start, log, watch, stop.

Each worker runs in its own process group (so its children are stopped with it) and gets
SIGKILL if the agent dies (``PR_SET_PDEATHSIG``), so no worker outlives a SIGKILLed agent.
Exits are reported through a queue by one waiting thread per worker: nothing polls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from efdl import logs as logs_format
from efdl._process import reap, spawn_worker
from efdl.launcher import warm
from efdl.output import STDERR, STDOUT, STREAM_NAMES, LogSpec

log = logging.getLogger(__name__)

_console_lock = threading.Lock()
_filtered_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """A worker process ended (``generation`` tells which group it belonged to)."""

    generation: int
    local_rank: int
    rank: int
    pid: int
    code: int


def _pump(
    stream: IO[bytes],
    render: Callable[[bytes], bytes],
    console: IO[bytes] | None,
    file: IO[bytes] | None,
    seen: Callable[[bytes], None] | None = None,
) -> None:
    """Copy lines from a worker pipe to the console (as ``render`` makes them) and/or a file,
    until EOF; ``seen`` gets each line too."""
    try:
        for line in iter(stream.readline, b""):
            if seen is not None:
                seen(line)
            if file is not None:
                file.write(line)
                file.flush()
            if console is not None:
                shown = render(line)
                with _console_lock:
                    console.write(shown)
                    console.flush()
    except (OSError, ValueError):
        pass
    finally:
        stream.close()
        if file is not None:
            file.close()


class Worker:
    """One worker process and the threads that pump its output and wait for its exit."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        local_rank: int,
        rank: int,
        generation: int,
        logs: LogSpec,
        events: queue.Queue[object],
        gpu_slot: int | None = None,
        pool: warm.WarmPool | None = None,
    ) -> None:
        self.local_rank, self.rank, self.generation = local_rank, rank, generation
        self.gpu_slot = gpu_slot  # which of the node's GPUs it holds for its whole life
        self.error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
        self.error_file.parent.mkdir(parents=True, exist_ok=True)
        self.error_file.unlink(missing_ok=True)
        started = pool.start(args, env) if pool is not None else None
        self.warm = started is not None
        self.proc = started or spawn_worker(warm.cold_command(args), env, subprocess.DEVNULL)
        self.pid = self.proc.pid
        self.last_error_line = ""  # its last non-blank stderr line: a traceback's exception
        self._threads = []
        for bit, pipe, console in (
            (STDOUT, self.proc.stdout, sys.stdout.buffer),
            (STDERR, self.proc.stderr, sys.stderr.buffer),
        ):
            assert pipe is not None
            name = STREAM_NAMES[bit]
            file = None
            if logs.log_dir is not None:
                path = logs.log_dir / f"gen{generation}" / f"rank{rank}.{name}"
                path.parent.mkdir(parents=True, exist_ok=True)
                file = open(path, "ab")  # noqa: SIM115 (closed by the pump)
            to_console = console if logs.to_console(local_rank, bit) else None
            render = self._render(name, logs.labelled(local_rank, bit))
            t = threading.Thread(
                target=_pump,
                args=(pipe, render, to_console, file, self._watcher(bit, logs)),
                name=f"efdl-log-r{rank}-{bit}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)
        waiter = threading.Thread(target=self._wait, args=(events,), daemon=True)
        waiter.start()

    def _render(self, stream: str, label: bool) -> Callable[[bytes], bytes]:
        def render(line: bytes) -> bytes:
            return logs_format.worker_line(self.rank, stream, line, label)

        return render

    def _watcher(self, bit: int, logs: LogSpec) -> Callable[[bytes], None] | None:
        """What looks at each line of stream ``bit``: stderr's last line is kept (a crash's
        exception), lines matching ``--duplicate-*-filters`` are copied to their file."""
        path = logs.filtered_file(bit)
        keys = tuple(k.encode() for k in logs.duplicate.get(bit, ()))
        error = bit == STDERR

        def seen(line: bytes) -> None:
            if error:
                self._saw_error(line)
            if path is not None and any(k in line for k in keys):
                with _filtered_lock, open(path, "ab") as out:
                    out.write(line)

        return seen if error or path is not None else None

    def _saw_error(self, line: bytes) -> None:
        text = logs_format.without_torch_prefix(line).decode(errors="replace").strip()
        if text:
            self.last_error_line = text

    def _wait(self, events: queue.Queue[object]) -> None:
        code = self.proc.wait()
        for t in self._threads:
            t.join(timeout=5)  # the last lines before the exit are printed before it is reported
        events.put(WorkerExit(self.generation, self.local_rank, self.rank, self.pid, code))

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def error_summary(self) -> str:
        """The error the worker recorded (torch's ``@record`` error file), else the last line
        it wrote to stderr (an uncaught exception's ``Type: message``), or ''."""
        try:
            data = json.loads(self.error_file.read_text())
        except (OSError, ValueError):
            return self.last_error_line
        message = data.get("message", data)
        if isinstance(message, dict):
            text = str(message.get("message", ""))
            stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
            return (text + ("\n" + stack if stack else "")).strip()
        return str(message)


class WorkerGroup:
    """The workers of this node in one generation."""

    def __init__(self, generation: int, workers: list[Worker]) -> None:
        self.generation = generation
        self.workers = workers
        self.exited: dict[int, int] = {}  # local rank -> exit code

    def spawn(
        self,
        args: Sequence[str],
        envs: Mapping[int, Mapping[str, str]],
        generation: int,
        logs: LogSpec,
        events: queue.Queue[object],
        gpu_slots: Mapping[int, int | None] | None = None,
        pool: warm.WarmPool | None = None,
    ) -> list[int]:
        """Start workers for these local ranks (local rank -> environment), each on its GPU
        slot (local rank -> slot; none on a CPU host), in warm processes from ``pool`` while
        it has them. Returns their pids."""
        slots = gpu_slots or {}
        new = [
            Worker(
                args,
                env,
                local_rank,
                int(env["RANK"]),
                generation,
                logs,
                events,
                slots.get(local_rank),
                pool,
            )
            for local_rank, env in envs.items()
        ]
        self.workers.extend(new)
        for w in new:
            self.exited.pop(w.local_rank, None)
        log.info(
            "Generation %d: started workers %s (pids %s%s).",
            generation,
            [w.rank for w in new],
            [w.pid for w in new],
            f"; {sum(w.warm for w in new)} of them warm" if any(w.warm for w in new) else "",
        )
        return [w.pid for w in new]

    def remove(self, pid: int) -> None:
        self.workers = [w for w in self.workers if w.pid != pid]

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every worker to exit by itself."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return

    def gpu_slots(self) -> set[int]:
        """The GPU slots its running workers hold."""
        return {w.gpu_slot for w in self.running() if w.gpu_slot is not None}

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def stop(self, grace_s: float, sig: int = signal.SIGTERM) -> None:
        """Signal every worker's process group, wait up to ``grace_s``, then SIGKILL them."""
        alive = self.running()
        for w in alive:
            w.signal_group(sig)
            w.signal_group(signal.SIGCONT)  # one stopped by the fence takes the signal now
        deadline = time.monotonic() + grace_s
        for w in alive:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "Worker rank %d (pid %d) ignored signal %d for %.0f s; killing it.",
                    w.rank,
                    w.pid,
                    sig,
                    grace_s,
                )
                w.signal_group(signal.SIGKILL)
                reap(w.proc, f"Worker rank {w.rank}")
        for w in self.workers:  # children the workers left behind in their groups
            w.signal_group(signal.SIGKILL)

    def kill(self) -> None:
        self.stop(0.0, signal.SIGKILL)
