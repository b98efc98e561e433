"""Commit and persist cost of the remote cache, against the raw write speed of the same place.

For each model size, a one-rank job (efdl.init_process_group, gloo) runs
``optimizer.step(); state.commit()`` with SGD+momentum (so model + optimizer state are twice
the parameter bytes) and the cache persisting as often as the writer is free. Per persisted
commit it records: how long ``commit()`` blocked the loop, how long the next
``optimizer.step()`` waited for the background copy (the step pre-hook), and how long the
snapshot took to be complete on storage (copy + write + manifest). The raw speed is a plain
``write`` + ``fsync`` of the same number of bytes into the same directory.

Usage: python -m benchmarks.cache [--sizes 10,100,500] [--snapshots 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import verdict


class Flat(torch.nn.Module):
    """``millions`` million parameters in tensors of 10M."""

    def __init__(self, millions: int) -> None:
        super().__init__()
        chunks = [10_000_000] * (millions // 10) + (
            [millions % 10 * 1_000_000] if millions % 10 else []
        )
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for n in chunks)


def raw_write(directory: Path, nbytes: int) -> float:
    """Seconds to write and fsync ``nbytes`` with plain file writes (64 MiB chunks)."""
    chunk = os.urandom(1 << 20) * 64
    path = directory / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n] if n < len(chunk) else chunk)
            left -= n
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def sha256_speed(nbytes: int = 256 << 20) -> float:
    """MB/s of hashlib's sha256 on one core (every snapshot byte is hashed once)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / 1e6 / (time.perf_counter() - t0)


def run(millions: int, snapshots: int, directory: Path) -> dict[str, float]:
    import efdl

    url = directory / f"cache-{millions}m"
    os.environ.update(
        EFDL_CACHE_URL=str(url),
        EFDL_CACHE_EVERY_STEPS="1",
        EFDL_CACHE_EVERY="0",
        EFDL_CACHE_KEEP="1",
    )
    model = Flat(millions)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt.step()  # momentum buffers exist from now on
    state = efdl.elastic_state(model, opt, snapshot_every=1_000_000)
    persister = state._persister
    assert persister is not None
    commits: list[float] = []
    fences: list[float] = []
    started = False
    while len(persister.durations) < snapshots:
        before = persister.blocked_s
        opt.step()  # waits for the background copy of the snapshot started just before, if any
        if started:
            fences.append(persister.blocked_s - before)
        thread = persister._thread
        t0 = time.perf_counter()
        state.commit()
        elapsed = time.perf_counter() - t0
        started = persister._thread is not thread
        if started:
            commits.append(elapsed)
    persister.flush(600)
    m = persister.store.manifest(persister.store.steps()[0])
    nbytes = sum(f.size for f in m.files.values())
    raw = statistics.median(raw_write(directory, nbytes) for _ in range(3))
    shutil.rmtree(url, ignore_errors=True)
    return {
        "bytes": nbytes,
        "commit": statistics.median(commits),
        "fence": statistics.median(fences),
        "write": statistics.median(persister.durations),
        "raw": raw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,500", help="model sizes, millions of params")
    parser.add_argument("--snapshots", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="efdl-cache-bench-", dir=args.dir))
    print(
        f"Remote cache on a local directory ({directory.parent}); median of {args.snapshots} "
        "snapshots per size. A one-rank job (`efdl.init_process_group`, gloo) runs "
        "`optimizer.step(); state.commit()` with SGD+momentum (model + optimizer state = 2x "
        "the parameter bytes), persisting as often as the writer is free. Per persisted "
        "commit: how long `commit()` blocked the loop, how long the next `optimizer.step()` "
        "waited for the background copy (its pre-hook), and how long the snapshot took to be "
        "complete on storage (copy to CPU + serialize + sha256 + write + fsync + manifest). "
        "Raw write: plain `write` + `fsync` of as many bytes into the same directory. The last "
        "column is hashlib's sha256 on one core: every snapshot byte is hashed once.\n"
    )
    sha = statistics.median(sha256_speed() for _ in range(3))
    print(
        "| params | snapshot MB | commit() blocks (ms) | next step waits (ms) | loop blocked / "
        "write time | persist MB/s | raw write MB/s | persist / raw | sha256 MB/s (1 core) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    import efdl

    efdl.init_process_group("gloo")
    blocked_share, speed_share = [], []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            r = run(size, args.snapshots, directory)
            blocked_share.append((r["commit"] + r["fence"]) / r["write"])
            speed_share.append(r["raw"] / r["write"])
            mb = r["bytes"] / 1e6
            blocked = r["commit"] + r["fence"]
            print(
                f"| {size}M | {mb:.0f} | {r['commit'] * 1000:.1f} | {r['fence'] * 1000:.1f} | "
                f"{blocked / r['write'] * 100:.2f}% | {mb / r['write']:.0f} | "
                f"{mb / r['raw']:.0f} | {r['raw'] / r['write'] * 100:.0f}% | {sha:.0f} |",
                flush=True,
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    worst_blocked, worst_speed = max(blocked_share), min(speed_share)
    print(
        f"\nGoals: the loop is blocked for at most {worst_blocked * 100:.1f}% of the write time "
        f"(goal < 5%: {verdict(worst_blocked < 0.05)}); persistence reaches at least "
        f"{worst_speed * 100:.0f}% of the raw write speed (goal 80%: "
        f"{verdict(worst_speed >= 0.8)})."
        + (
            f" The bound is sha256 ({sha:.0f} MB/s on one core here; a CPU with SHA "
            "instructions does 1.5-2 GB/s) while the writer competes with training for the "
            "cores; hashing already overlaps the writes. Per-chunk digests hashed in parallel "
            "would lift it."
            if worst_speed < 0.8
            else ""
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
