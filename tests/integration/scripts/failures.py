"""One rank of a real failure, classified (tests/integration/test_failures.py).

Usage: failures.py RANK MODE DIR. The two ranks meet on a FileStore in DIR (the gloo group's
rendezvous, and the test's own signals: blocking waits with a deadline, no sockets for the
breaker to cut); each writes what it classified as DIR/rank<N>.json. Modes: ``kill`` (rank 1
exits abruptly after a collective; rank 0's next collective fails), ``timeout`` (rank 1 stays
away from the next collective until rank 0 has classified; the group's timeout is 2 s),
``store`` (rank 0 hosts a TCPStore and exits; rank 1's wait on it fails), ``cut`` (efdl's
breaker shuts rank 0's connections down while it waits in a collective rank 1 stays away from).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from efdl.worker.breaker import Breaker
from efdl.worker.failure import classify

rank, mode, where = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
WAIT = datetime.timedelta(seconds=60)
signals = dist.FileStore(str(where / "store"), 2)
signals.set_timeout(WAIT)


def verdict(exc: BaseException, cut: bool = False) -> None:
    out = {
        "type": type(exc).__name__,
        "message": str(exc)[:300],
        "cut": cut,
        "verdict": classify(exc, cut),
    }
    (where / f"rank{rank}.json").write_text(json.dumps(out))
    signals.set("classified", "1")


timeout = datetime.timedelta(seconds=2 if mode == "timeout" else 30)
breaker = Breaker()
with breaker.recording(0):
    dist.init_process_group("gloo", store=signals, rank=rank, world_size=2, timeout=timeout)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # every connection is up
if mode == "store":
    if rank == 0:
        host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=WAIT, wait_for_workers=False)
        signals.set("port", str(host.port))
        signals.wait(["reading"])  # rank 1 waits on the TCPStore
        os._exit(0)  # the store's host goes: its connections close
    client = dist.TCPStore("127.0.0.1", int(signals.get("port")), 2, False, timeout=WAIT)
    client.set("up", "1")
    signals.set("reading", "1")
    try:
        client.wait(["never"])  # ends when the host's connection does (or after WAIT)
    except RuntimeError as exc:
        verdict(exc)
    os._exit(0)
if rank == 1:
    if mode == "kill":
        os._exit(0)  # abruptly: the kernel closes the connections
    signals.wait(["classified"])  # away from the collective until rank 0 has classified
    os._exit(0)
if mode == "cut":
    threading.Timer(1.0, breaker.cut, kwargs={"below": 1}).start()
try:
    dist.all_reduce(t)
    raise SystemExit("rank 0: the collective did not fail")
except RuntimeError as exc:
    verdict(exc, cut=breaker.was_cut(0))
os._exit(0)
