"""Several processes run side by side, each stopped by PID however the wait ends."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from typing import Any


def run_together(
    commands: Sequence[Sequence[str]], timeout_s: float, **popen: Any
) -> list[subprocess.CompletedProcess[str]]:
    """Start ``commands`` in order, then wait for every one (``timeout_s`` for them all);
    any still running when the wait ends (a timeout, an error) is killed by PID. Their exit
    codes and outputs (text), in order; ``popen``: more of Popen's arguments (env, cwd)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for argv in commands:
            procs.append(
                subprocess.Popen(
                    list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
                )
            )
        deadline = time.monotonic() + timeout_s
        outs = [p.communicate(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]
