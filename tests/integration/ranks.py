"""Ranks of a test as real processes: one per argument list, all waited for together; either
started each (:func:`run_ranks`) or forked from a server that imported torch once
(:class:`ForkServer`)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def run_ranks(
    script: Path,
    args: Sequence[Sequence[str]],
    env: Mapping[str, str] | None = None,
    timeout_s: float = 100,
) -> list[str]:
    """Run ``python script *a`` for each ``a`` in ``args`` at once; assert that every one
    exits 0 within ``timeout_s`` (the output of one that does not is in the failure) and
    return their outputs. A process still running at the end is killed by PID."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *a],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        for a in args
    ]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    return outputs


FORK_SERVER = Path(__file__).parent / "scripts" / "forkserver.py"


class ForkServer:
    """Ranks forked from one process that imported torch and efdl once (scripts/forkserver.py):
    each rank is a fresh process as with :func:`run_ranks`, for a fork instead of a Python
    start and a torch import. Use as a context manager (a module-scoped fixture); leaving it
    ends the server, and the server and every rank it forked are stopped by PID."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(FORK_SERVER), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.environ(),  # OpenMP reads it as torch is imported: in the server
        )
        self.pending = b""
        self.busy = False  # a batch was sent and its "rcs" not read (a test cut short)
        self.running: list[int] = []  # a batch's PIDs, until the server has reaped them

    @staticmethod
    def environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
        """A rank's environment: this process's, one intra-op thread unless it says how many
        (3 to 5 ranks at once on a small machine: idle OpenMP threads that spin only take
        CPU from the ranks), then ``env``."""
        return {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _send(self, message: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def _read(self, deadline: float) -> Any:
        """The server's next message; TimeoutError at ``deadline``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def _finish(self, deadline: float) -> list[int]:
        """The exit statuses of the batch in flight, once the server has reaped them all."""
        while True:
            message = self._read(deadline)
            if "rcs" in message:
                self.busy, self.running = False, []
                return list(message["rcs"])
            self.running = message["pids"]

    def run_ranks(
        self,
        script: Path,
        args: Sequence[Sequence[str]],
        env: Mapping[str, str] | None = None,
        timeout_s: float = 100,
    ) -> list[str]:
        """As :func:`run_ranks`: every rank must exit 0 within ``timeout_s``; their outputs."""
        deadline = time.monotonic() + timeout_s
        with tempfile.TemporaryDirectory(prefix="efdl-ranks-") as logs:
            paths = [str(Path(logs) / f"rank{i}.log") for i in range(len(args))]
            request = {
                "script": str(script),
                "args": [list(a) for a in args],
                "env": self.environ(env),
                "logs": paths,
            }
            if self.busy:  # an earlier test was cut short mid-batch: end that batch first
                self._send("kill")
                self._finish(time.monotonic() + 30)
            self.busy = True
            self._send(request)
            self.running = self._read(deadline)["pids"]
            late = False
            try:
                rcs = self._finish(deadline)
            except TimeoutError:
                late = True
                self._send("kill")
                rcs = self._finish(time.monotonic() + 30)
            outputs = [
                Path(p).read_bytes().decode(errors="replace") if Path(p).exists() else ""
                for p in paths
            ]
        tails = "\n".join(
            f"--- rank {i} (exit {rc}):\n{o[-3000:]}"
            for i, (rc, o) in enumerate(zip(rcs, outputs, strict=True))
        )
        assert not late, f"ranks still running after {timeout_s} s, killed:\n{tails}"
        assert all(rc == 0 for rc in rcs), f"a rank failed:\n{tails}"  # every rank: the cause
        return outputs

    def close(self) -> None:
        """End the server (it kills its running ranks first); if it does not, kill them and
        it by PID."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # end of input: the server kills its ranks and exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in self.running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
