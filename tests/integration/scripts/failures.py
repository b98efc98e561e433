"""One rank of a real failure, classified (tests/integration/test_failures.py).

Usage: failures.py RANK MODE DIR. Rank 0 hosts the TCPStore (its port in DIR/port); each rank
writes what it classified as DIR/rank<N>.json. Modes: ``kill`` (rank 1 exits abruptly after a
collective; rank 0's next collective fails), ``timeout`` (rank 1 stays away from the next
collective until rank 0 has classified; the group's timeout is 2 s), ``store`` (rank 0, the
store's host, exits; rank 1's next store read fails), ``cut`` (efdl's breaker shuts rank 0's
connections down while it waits in a collective rank 1 stays away from).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from efdl.state.breaker import Breaker
from efdl.state.failure import classify

rank, mode, where = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
DEADLINE = time.monotonic() + 60


def wait_for(path: Path) -> None:
    while not path.exists():
        if time.monotonic() > DEADLINE:
            raise SystemExit(f"rank {rank}: no {path} within 60 s")
        time.sleep(0.05)


def verdict(exc: BaseException, cut: bool = False) -> None:
    out = {"type": type(exc).__name__, "message": str(exc)[:300], "verdict": classify(exc, cut)}
    tmp = where / f"rank{rank}.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(where / f"rank{rank}.json")


timeout = datetime.timedelta(seconds=2 if mode == "timeout" else 30)
if rank == 0:
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    (where / "port.tmp").write_text(str(store.port))
    (where / "port.tmp").rename(where / "port")
else:
    wait_for(where / "port")
    port = int((where / "port").read_text())
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
breaker = Breaker()
with breaker.recording(0):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # every connection is up
if mode == "store":
    if rank == 0:
        store.wait(["reading"])  # rank 1 reads on
        os._exit(0)  # the store's host goes: its connections close
    store.set("reading", "1")
    try:
        while time.monotonic() < DEADLINE:
            store.get("reading")
            time.sleep(0.05)
    except RuntimeError as exc:
        verdict(exc)
    os._exit(0)
if rank == 1:
    if mode == "kill":
        os._exit(0)  # abruptly: the kernel closes the connections
    wait_for(where / "rank0.json")  # away from the collective until rank 0 has classified
    os._exit(0)
if mode == "cut":
    threading.Timer(1.0, breaker.cut, kwargs={"below": 1}).start()
try:
    dist.all_reduce(t)
    raise SystemExit("rank 0: the collective did not fail")
except RuntimeError as exc:
    verdict(exc, cut=breaker.was_cut(0))
os._exit(0)
