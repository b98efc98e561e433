"""WebDataset tar shards: efdl.ElasticStream over efdl.data.TarSource against WebDataset.

A generated WebDataset set (``--gb``, default 1 GB: 8 shards of 8192 samples, each a
16 KB ``.jpg`` of random bytes, as incompressible as a JPEG, and a small ``.json`` label) is
read from local disk by 1 and 2 ranks at once, each its own process (a DataLoader with
``--workers`` worker processes, or none), as benchmarks.data runs its readers. Readers:

- plain: a DataLoader over an IterableDataset that reads its rank's shards (and its worker's
  share of them) in order with ``efdl.data.tar.tar_samples``, no shuffle: the baseline.
- wds: ``webdataset.WebDataset`` (1.0), its shards split by node and by worker, no shuffle.
- efdl: ``efdl.ElasticStream(efdl.data.TarSource(...))`` with its defaults (16 lanes,
  1024-sample windows, shuffled); the shards' sample counts given, as an index has them.

Each reader yields a batch of the rank's 256 samples as a dict of lists of the fields'
bytes; no decoding (the fields are what a ``transform`` would decode). Per configuration:
samples/s and MB/s over all ranks, CPU per sample (the workers' included), medians of
``--repeat`` interleaved runs.

Usage: python -m benchmarks.data_tar [--gb 1] [--repeat 3] [--worlds 1,2] [--workers 0,2]
       [--readers plain,wds,efdl] [--dir D]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks.data import BATCH, COUNTS, run_world
from benchmarks.report import spread, verdict

SHARD_SAMPLES = 8192
IMAGE_BYTES = 16_384


def generate(folder: Path, gb: float) -> list[str]:
    """The shards (made once; reused while their count file is there)."""
    shards = max(1, round(gb * 1e9 / (SHARD_SAMPLES * IMAGE_BYTES)))
    names = [str(folder / f"shard-{k:04d}.tar") for k in range(shards)]
    counts = folder / COUNTS
    if counts.exists() and json.loads(counts.read_text()) == [SHARD_SAMPLES] * shards:
        return names
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        with tarfile.open(name, "w") as tar:
            for i in range(k * SHARD_SAMPLES, (k + 1) * SHARD_SAMPLES):
                for field, data in (
                    ("jpg", os.urandom(IMAGE_BYTES)),
                    ("json", json.dumps({"id": i, "label": i % 1000}).encode()),
                ):
                    info = tarfile.TarInfo(f"train/{i:08d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    counts.write_text(json.dumps([SHARD_SAMPLES] * shards))
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "efdl-bench-tar"))
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--workers", default="0,2", help="DataLoader worker counts")
    p.add_argument("--readers", default="plain,wds,efdl")
    a = p.parse_args()
    readers = a.readers.split(",")
    unknown = [r for r in readers if r not in ("plain", "wds", "efdl")]
    if unknown:
        sys.exit(
            f"--readers: unknown {unknown[0]!r}; expected a comma-separated list of "
            "plain, wds, efdl."
        )
    if "wds" in readers:
        try:
            import webdataset  # type: ignore[import-untyped]  # noqa: F401
        except ImportError:
            sys.exit("The reader 'wds' needs webdataset: pip install webdataset.")
    files = generate(Path(a.dir), a.gb)
    on_disk = sum(os.path.getsize(f) for f in files)
    worlds = [int(w) for w in a.worlds.split(",")]
    worker_counts = [int(w) for w in a.workers.split(",")]
    env = dict(os.environ)
    results: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    for _ in range(a.repeat):
        for workers in worker_counts:
            for world in worlds:
                for reader in readers:
                    got = run_world(f"tar-{reader}", world, files, {}, workers, env)
                    results.setdefault((reader, world, workers), []).append(got)
    print(
        f"Data: {len(files)} WebDataset shards of {SHARD_SAMPLES} samples (a {IMAGE_BYTES} B "
        f"jpg and a json each), {on_disk / 1e9:.2f} GB on local disk. Per-rank batch {BATCH}. "
        f"Medians of {a.repeat} interleaved runs (range).\n"
    )
    print("| workers | ranks | reader | samples/s | MB/s | CPU us/sample | / plain | / wds |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 1e9
    for workers in worker_counts:
        for world in worlds:
            base = {
                r: statistics.median(x["sps"] for x in results[(r, world, workers)])
                for r in ("plain", "wds")
                if (r, world, workers) in results
            }
            for reader in readers:
                rs = results[(reader, world, workers)]
                sps = statistics.median(r["sps"] for r in rs)
                ratios = [
                    f"{sps / base[r]:.2f}" if r in base and r != reader else ""
                    for r in ("plain", "wds")
                ]
                if reader == "efdl" and "plain" in base:
                    worst = min(worst, sps / base["plain"])
                print(
                    f"| {workers} | {world} | {reader} | {spread([r['sps'] for r in rs], 0)} | "
                    f"{spread([r['mbs'] for r in rs], 0)} | "
                    f"{spread([r['us_row'] for r in rs], 1)} | {ratios[0]} | {ratios[1]} |"
                )
    if worst < 1e9:
        print(
            f"\nefdl at >= 95 % of the plain reader in every row: {verdict(worst >= 0.95)} "
            f"(worst {worst:.2f})."
        )


if __name__ == "__main__":
    main()
