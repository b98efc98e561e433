"""Breaks of issue 57: the health command's deadline (efdl.launcher.health.run_command), which
--health-check and --health-collective run under."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from efdl.launcher.health import run_command


@pytest.mark.timeout(60)
def test_a_hung_check_whose_child_left_the_process_group_still_ends_at_its_deadline(
    tmp_path: Path,
) -> None:
    # A health script that hangs after starting a helper in a session of its own (setsid;
    # as a daemonising tool does), the helper holding the script's stdout. At the deadline
    # the script's process group is killed, then communicate() waits for EOF on stdout,
    # which the helper holds: the agent's check (before joining: on its loop) blocks for as
    # long as the helper lives, and the helper is left running.
    pid_file = tmp_path / "helper.pid"
    cmd = f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 20' & sleep 100"
    t0 = time.monotonic()
    try:
        code, _ = run_command(cmd, 1.0)
        took = time.monotonic() - t0
    finally:
        if pid_file.exists():  # the helper, ended here by its pid
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert code is None
    assert took < 6, f"run_command took {took:.1f} s past a 1 s deadline"


@pytest.mark.timeout(60)
def test_a_check_that_passed_and_left_a_background_helper_is_not_a_timeout() -> None:
    # The script exits 0 at once, leaving a helper in the background (on its stdout, as a
    # `some-monitor &` line does): run_command waits for EOF, not for the script, so at the
    # deadline it kills the helper and reports the passing check as run past its timeout,
    # which quarantines a good node (judge_command: code None is a fault).
    code, _ = run_command("sleep 5 & exit 0", 1.0)
    assert code == 0
