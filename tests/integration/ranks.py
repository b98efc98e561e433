"""Ranks of a test as real processes: one per argument list, all waited for together."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


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
