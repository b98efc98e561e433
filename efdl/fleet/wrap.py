"""``python -m efdl.fleet.wrap EXIT_FILE PROGRAM [ARG...]``: run PROGRAM, then write its exit
code to EXIT_FILE, so that a host daemon that restarted since it started the program (and so
is not its parent) still learns how it ended. What a shell did for ``efdl node`` before
(``"$@"; echo $? > exit-file``), without a shell: the daemon starts this with an argv list,
and nothing in it is ever parsed by a shell or read as an option of this wrapper.

The arguments are positional, by place: the first is the exit file, the rest the program
and its arguments as given, a leading ``-`` included. The code written is the program's,
or 128 + N when a signal N ended it (a shell's convention), or 126/127 when it could not be
started. SIGTERM, SIGINT and SIGHUP that reach the wrapper are passed on to the program, so
either may be signalled. The file is written whole or not at all (a rename).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
USAGE = "usage: python -m efdl.fleet.wrap EXIT_FILE PROGRAM [ARG...]"


def record(exit_file: Path, code: int) -> None:
    """Write ``code`` to ``exit_file`` atomically (a reader sees it whole or not at all)."""
    tmp = exit_file.with_name(exit_file.name + ".tmp")
    tmp.write_text(f"{code}\n")
    os.replace(tmp, exit_file)


def run(exit_file: Path, command: list[str]) -> int:
    """Run ``command`` (no shell), passing on the signals in ``_FORWARDED``; write and return
    its exit code."""
    child: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(sig: int, _frame: FrameType | None) -> None:
        if child is None:
            pending.append(sig)  # before the program runs: it gets it once started
        else:
            child.send_signal(sig)

    for forwarded in _FORWARDED:
        signal.signal(forwarded, forward)
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"efdl.fleet.wrap: cannot start {command[0]!r}: {exc.strerror}.", file=sys.stderr)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
    else:
        for sig in pending:
            child.send_signal(sig)
        returned = child.wait()
        code = returned if returned >= 0 else 128 - returned
    record(exit_file, code)
    return code


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1] or not argv[2]:
        print(USAGE, file=sys.stderr)
        return 2
    return run(Path(argv[1]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
