"""A fork server for rank processes: it imports torch and efdl's worker library once, then
forks one child per rank a test asks for, so that a rank costs a fork instead of a Python
start and a torch import (about 2 s of CPU each). Each rank is still a process of its own,
with its own runtime, groups and memory, started afresh for the test.

Args: the PID of the process that started it (it dies with that process). Protocol: one JSON
value a line. In (stdin): {"script": path, "args": [[arg, ...], ...], "env": {...},
"logs": [path, ...]} runs ``script`` once per argument list, each child with exactly ``env``
as its environment and its stdout and stderr in its log; "kill" while a batch runs kills the
batch's children that are still running. Out (stdout): {"pids": [...]} once the batch's
children are forked, then {"rcs": [...]} once every one has exited and been reaped (-N:
killed by signal N). Only this server reaps its children, so while it has not answered "rcs"
their PIDs are theirs; it kills them with no race. End of input: it kills its running
children and exits. A child dies with this server (PR_SET_PDEATHSIG).
"""

import atexit
import ctypes
import gc
import json
import os
import runpy
import select
import signal
import sys
import traceback
from pathlib import Path

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PR_SET_PDEATHSIG = 1
MADV_POPULATE_READ = 22


def die_with_parent(parent: int) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


die_with_parent(int(sys.argv[1]))

# The heavy imports, paid once. Nothing here starts work, a group or the efdl runtime.
import torch  # noqa: E402
import torch.distributed  # noqa: E402
import torch.distributed.fsdp  # noqa: E402
import torch.distributed.tensor  # noqa: E402, F401

import efdl  # noqa: E402
import efdl.worker.cache  # noqa: E402
import efdl.worker.runtime  # noqa: E402
import efdl.worker.sampler  # noqa: E402
import efdl.worker.state  # noqa: E402, F401

gc.collect()
gc.freeze()  # the children share these pages instead of copying them as the GC walks them

wake_r, wake_w = os.pipe()
os.set_blocking(wake_r, False)
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes select
pending = b""


def read_line() -> bytes | None:
    """The next line of input (blocking), or None at its end."""
    global pending
    while b"\n" not in pending:
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    return line


def send(message: object) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def map_files() -> None:
    """Map every page of the files this process maps (torch's libraries, mostly) into its
    page tables. A fresh process maps the library pages it runs as it imports; a forked one
    inherits none of them (fork copies no page table of a file mapping) and would map them on
    first use, so that its resident memory (VmRSS, VmHWM, ru_maxrss, which the scripts read)
    would grow by library pages where a script runs code its own start did not: ~3 MB in the
    sync of scripts/sync_state.py, against a bound with 6 MB of slack. Mapped up front, what
    grows is what the rank allocates. Page-cache pages only: 0.1 s of CPU, no memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/") and fields[1].startswith("r"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            libc.madvise(start, end - start, MADV_POPULATE_READ)  # best effort


def child(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """Run ``script`` as ``python script *args`` would, then exit with its status."""
    die_with_parent(os.getppid())
    map_files()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r)
    os.close(wake_w)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    gc.unfreeze()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def batch(request: dict) -> bool:
    """Fork, report, reap; kill on request. False: the input ended (after killing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for args, log in zip(request["args"], request["logs"], strict=True):
        pid = os.fork()
        if pid == 0:
            child(request["script"], args, request["env"], log)
        pids.append(pid)
    send({"pids": pids})
    rcs: dict[int, int] = {}
    more = True
    watch = [0, wake_r]
    while True:
        for pid in pids:
            if pid not in rcs:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rcs[pid] = os.waitstatus_to_exitcode(status)
        if len(rcs) == len(pids):
            break
        ready, _, _ = select.select(watch, [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
        if 0 in ready:
            line = read_line()
            if line is None:
                more = False
                watch = [wake_r]
            if line is None or line.strip() == b'"kill"':
                for pid in pids:
                    if pid not in rcs:  # not reaped: the PID is still this child's
                        os.kill(pid, signal.SIGKILL)
    try:
        send({"rcs": [rcs[pid] for pid in pids]})
    except BrokenPipeError:
        return False
    return more


while True:
    line = read_line()
    if line is None or not batch(json.loads(line)):
        break
