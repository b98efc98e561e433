"""What operating features cost an agent: recording an event (the caller's side, and the writes
to a real etcd behind it), and serving a metrics scrape.

Usage: python -m benchmarks.operating [--events 9000]
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
import uuid

from efdl.history import read_events
from efdl.launcher.metrics import Metrics
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.records import EventKind


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=9000)  # under the queue bound (10000)
    args = parser.parse_args()
    n = args.events
    node = "ip-10-0-12-34.eu-west-1.compute.internal"
    with EmbeddedEtcd() as etcd, EtcdStore(etcd.settings()) as store:
        job = f"bench-{uuid.uuid4().hex[:6]}"
        log = EventLog(store, job, node)
        calls = []
        t_all = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            text = f"persisted 1234.5 MB to s3://bucket/{job}"
            log.record(EventKind.PERSIST, 7, text, world_size=512, step=i, seconds=3.2)
            calls.append(time.perf_counter() - t0)
        queued = time.perf_counter() - t_all
        log.close(timeout_s=600)
        written = time.perf_counter() - t_all
        kept, _ = read_events(store, job)
        size = sum(len(e.to_json()) for e in kept)
    m = Metrics(job, node)
    port = m.serve("127.0.0.1", 0)
    for i in range(100):
        m.progress(i)
        m.stood_still.observe(0.1 * i)
        m.etcd_request.observe(0.002)
    scrapes = []
    body = b""
    for _ in range(200):
        t0 = time.perf_counter()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        scrapes.append(time.perf_counter() - t0)
    m.close()
    calls.sort()
    print(f"{n} events recorded by one agent into a real etcd (one member, on this machine):\n")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| record(), the caller's side, median | {statistics.median(calls) * 1e6:.1f} us |")
    print(f"| record(), the caller's side, p99 | {calls[int(0.99 * n)] * 1e6:.1f} us |")
    print(f"| all {n} queued | {queued:.2f} s |")
    print(f"| all written to etcd (one put each, trimmed every 64) | {written:.1f} s |")
    print(f"| writes per second | {n / written:.0f} |")
    print(f"| events kept (bound) | {len(kept)} |")
    print(f"| bytes kept in etcd | {size / 1e3:.0f} kB ({size / max(1, len(kept)):.0f} B each) |")
    print(f"| /metrics scrape, median of 200 | {statistics.median(scrapes) * 1e3:.2f} ms |")
    print(f"| /metrics body | {len(body) / 1e3:.1f} kB |")


if __name__ == "__main__":
    main()
