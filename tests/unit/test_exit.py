"""How efdl's processes start and end: the agent without torch; a leaving worker without the
interpreter's last full collections, and with everything else a normal exit does (the user's
finally blocks and exit handlers, files flushed, the exit code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, sys
from efdl._process import skip_final_gc

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        open(sys.argv[1] + ".cycle", "w").write("collected")

log = open(sys.argv[1] + ".log", "w")  # never closed: flushed at exit
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))
atexit.register(lambda: log.write(" at exit"))
Cycle()  # garbage only a reference cycle keeps
if sys.argv[2] == "skip":
    skip_final_gc()
try:
    log.write("written")
    raise SystemExit(int(sys.argv[3]))
finally:
    open(sys.argv[1] + ".finally", "w").write("ran")
"""


@pytest.mark.parametrize("mode", ["skip", "normal"])
def test_exit_keeps_cleanup_and_code(tmp_path: Path, mode: str) -> None:
    base = str(tmp_path / "p")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), base, mode, "3"], capture_output=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr.decode()
    assert Path(base + ".finally").read_text() == "ran"
    assert Path(base + ".atexit").read_text() == "ran"
    assert Path(base + ".log").read_text() == "written at exit"
    # What is skipped: the final collection that would have found the cycle.
    assert Path(base + ".cycle").exists() == (mode == "normal")


def test_the_agent_and_the_fleet_commands_start_without_torch() -> None:
    """efdl-run and efdl node import torch's c10d in the background once they are joining
    where the node has cores to spare (efdl.launcher.tcpstore.preload), else when the node
    first serves a store: importing it first (2-3 s of CPU here, seconds more on a busy host)
    would hold up every agent's registration, on every host of a fleet job."""
    code = (
        "import sys; import efdl.cli, efdl.fleet.daemon, efdl.launcher.agent; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    ("signum", "ended", "others", "code"),
    [
        (15, False, 0, 143),  # SIGTERM, standalone or the last node: unfinished, nobody on
        (2, False, 0, 130),  # Ctrl-C
        (15, False, 2, 0),  # a leave the job survives
        (15, True, 0, 0),  # the job had finished (or was stopped, or failed: said elsewhere)
        (10, False, 0, 138),  # SIGUSR1 (--signals-to-handle), SLURM's warning
    ],
)
def test_a_node_that_leaves_on_a_signal_exits_non_zero_only_if_nobody_carries_on(
    signum: int, ended: bool, others: int, code: int
) -> None:
    from efdl.launcher.agent import leave_code

    assert leave_code(signum, ended, others) == code
