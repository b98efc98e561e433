"""Streamed data: efdl.ElasticStream against a plain pyarrow reader, HF datasets and Mosaic.

A generated Parquet data set (``--gb``, default 2 GB: rows of a 512-token int32 sequence and
an id, 8192-row row groups, snappy) is read by 1, 2 and 4 ranks at once, each its own process
(a DataLoader with ``--workers`` worker processes, or none), from local disk and from the
local S3 stand-in (moto's server, on 127.0.0.1; ``--s3-gb`` of the files, default 1 GB: 8 files,
so that each of the plain reader's 8 workers at 4 ranks has one). Readers:

- plain: a DataLoader over an IterableDataset that reads its rank's files (and its worker's
  share of them) with ``pyarrow.ParquetFile.iter_batches``, in file order, no shuffle: the
  cheapest reader there is, and the goal's baseline.
- efdl: ``efdl.ElasticStream`` (its defaults: 16 lanes, 1024-row windows, shuffled), global
  batch = the per-rank batch times the world; efdl64: the same with 64 lanes (under 2 row
  groups per lane here, against 7-8 with 16: each lane decodes up to one row group before
  its first row, see docs/data.md).
- hf: ``datasets.load_dataset("parquet", streaming=True)``, ``split_dataset_by_node``, a
  DataLoader over ``with_format("torch")``, no shuffle; it reads ``--hf-rows`` per rank (it
  is slow), from its second batch (its first, with its start, before the clock).
- mosaic: MosaicML streaming's ``StreamingDataset`` over the same rows written once as MDS
  shards (uncompressed, 128 MB each; its own format: it reads no Parquet), no shuffle, local
  disk only; ``--mosaic DIR`` where ``benchmarks/mosaic/install.sh DIR`` installed it apart
  from this environment (it pins older numpy and transformers). It reads ``--hf-rows`` per
  rank too, as hf does.

Per configuration: samples/s and decoded MB/s over all ranks (from the moment every rank is
ready to the last rank's last batch), and the ranks' CPU time per row (their DataLoader
workers' included; not the S3 stand-in's), median of ``--repeat`` interleaved runs.

The rescale: ranks that were 2 become 3 at the middle of the epoch. A survivor's stream (its
footers already read) and a newcomer's (nothing read) are started at the cursor with the new
world; the time to their first batch and the bytes they read for it, against what a reader
without a seek re-reads (its files from their start to the position).

Usage: python -m benchmarks.data [--gb 2] [--s3-gb 1] [--repeat 3] [--dir D]
       [--worlds 1,2,4] [--readers plain,efdl,efdl64,hf,mosaic] [--workers 0] [--mosaic DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import spread, verdict
from tests.s3 import s3_stand_in

TOKENS = 512
GROUP_ROWS = 8192
BATCH = 256  # rows per rank per step
FILE_ROWS = 65_536  # 8 row groups, about 128 MB decoded


def generate(folder: Path, gb: float) -> list[str]:
    """Parquet files of about ``gb`` GB decoded (reused when already there)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = max(1, round(gb * 1e9 / (FILE_ROWS * TOKENS * 4)))
    marker = folder / f"done-{files}"
    paths = [str(folder / f"part-{i:04d}.parquet") for i in range(files)]
    if marker.exists():
        return paths
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, path in enumerate(paths):
        tokens = rng.integers(0, 50_257, size=FILE_ROWS * TOKENS, dtype=np.int32)
        ids = pa.array(np.arange(i * FILE_ROWS, (i + 1) * FILE_ROWS, dtype=np.int64))
        seq = pa.FixedSizeListArray.from_arrays(pa.array(tokens), TOKENS)
        pq.write_table(pa.table({"id": ids, "tokens": seq}), path, row_group_size=GROUP_ROWS)
    marker.touch()
    return paths


def write_mds(files: list[str], folder: Path) -> None:
    """The files' rows as MosaicML MDS shards in ``folder`` (in a process that imports
    streaming; reused when already there)."""
    import pyarrow.parquet as pq
    from streaming import MDSWriter

    marker = folder / f"done-{len(files)}"
    if marker.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    columns = {"id": "int64", "tokens": f"ndarray:int32:{TOKENS}"}
    with MDSWriter(out=str(folder), columns=columns, size_limit=1 << 27) as out:
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(GROUP_ROWS):
                ids = batch.column(0).to_numpy()
                tokens = batch.column(1).flatten().to_numpy().reshape(-1, TOKENS)
                for i, tokens_i in zip(ids.tolist(), tokens, strict=True):
                    out.write({"id": i, "tokens": tokens_i})
    marker.touch()


def _mosaic_env(env: dict[str, str], mosaic: str) -> dict[str, str]:
    """``env`` with ``mosaic`` (install.sh's folder) first on the Python path."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (mosaic, env.get("PYTHONPATH")) if p)}


# ---------------------------------------------------------------- one rank (a subprocess)


def _plain_dataset(files: list[str], rank: int, world: int, storage: dict[str, Any]) -> Any:
    import fsspec  # type: ignore[import-untyped]
    import pyarrow.parquet as pq
    from torch.utils.data import IterableDataset, get_worker_info

    from efdl.data.source import to_torch

    class Plain(IterableDataset[Any]):
        def __iter__(self) -> Any:
            info = get_worker_info()
            w, k = (info.id, info.num_workers) if info else (0, 1)
            for url in files[rank::world][w::k]:
                with fsspec.open(url, "rb", **storage) as f:
                    for batch in pq.ParquetFile(f).iter_batches(BATCH):
                        yield to_torch(batch)

    return Plain()


def _hf_dataset(files: list[str], rank: int, world: int, storage: dict[str, Any]) -> Any:
    import datasets
    from datasets.distributed import split_dataset_by_node

    ds = datasets.load_dataset(
        "parquet", data_files=files, streaming=True, split="train", storage_options=storage
    )
    return split_dataset_by_node(ds, rank, world).with_format("torch")


def rank_main(args: dict[str, Any]) -> None:
    """Read this rank's share; print rows, decoded bytes and the time span as JSON."""
    from torch.utils.data import DataLoader

    import efdl

    rank, world, files, storage = args["rank"], args["world"], args["files"], args["storage"]
    reader, workers = args["reader"], args["workers"]
    extra: dict[str, Any] = {"num_workers": workers}
    if reader.startswith("efdl"):
        lanes = int(reader[4:] or 16)  # "efdl": the default 16 lanes; "efdl64": 64
        stream = efdl.ElasticStream(files, BATCH * world, lanes=lanes, storage_options=storage)
        stream.set_world(rank, world)
        loader: Any = DataLoader(stream, batch_size=None, **extra)
    elif reader == "plain":
        loader = DataLoader(_plain_dataset(files, rank, world, storage), batch_size=None, **extra)
    elif reader.startswith("tar-"):  # WebDataset shards (benchmarks.data_tar)
        loader = tar_loader(reader, files, rank, world, storage, workers)
    elif reader == "mosaic":
        from streaming import StreamingDataset  # type: ignore[import-not-found]

        # rank and world from RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE
        mosaic = StreamingDataset(local=args["mds"], batch_size=BATCH, shuffle=False)
        loader = DataLoader(mosaic, batch_size=BATCH, **extra)
    else:
        loader = DataLoader(_hf_dataset(files, rank, world, storage), batch_size=BATCH, **extra)
    # What every reader sets up on its first rows, before the clock starts: the setup is
    # not the throughput. pyarrow imports pandas at its first to_numpy (0.5 s here); an S3
    # client loads botocore's service models at its first request (about 0.5 s of CPU; the
    # file system object, and with it the client, is fsspec's cached one the reader uses).
    import fsspec
    import pyarrow as pa

    pa.array([0]).to_numpy()
    if "://" in files[0]:
        fs, path = fsspec.core.url_to_fs(files[0], **storage)
        fs.info(path)
    batches = iter(loader)
    if args["cap"]:  # a reader measured over part of its rows: its start is not in them
        next(batches)
    Path(args["ready"]).touch()
    deadline = time.monotonic() + 300
    while not os.path.exists(args["go"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no go file {args['go']} within 300 s")
        time.sleep(0.005)
    start, cpu = time.time(), _cpu()
    rows = nbytes = 0
    cap = args["cap"] or float("inf")
    for batch in batches:
        n, size = _measure(batch)
        rows, nbytes = rows + n, nbytes + size
        if rows >= cap:
            break
    end = time.time()
    # A loop left early leaves its workers running: stop them (DataLoader's iterator does
    # as it goes), so that their CPU time counts (the children's is counted once they exit).
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    cpu = _cpu() - cpu
    print(json.dumps({"rows": rows, "bytes": nbytes, "start": start, "end": end, "cpu": cpu}))


def _measure(batch: dict[str, Any]) -> tuple[int, int]:
    """A batch's rows and bytes: tensors of Parquet columns, or a WebDataset batch's lists
    of field bytes (its ``__key__`` and ``__url__`` left out)."""
    if "__key__" in batch:
        fields = [v for k, v in batch.items() if not k.startswith("__")]
        return len(batch["__key__"]), sum(len(x) for values in fields for x in values)
    return len(batch["id"]), sum(v.numel() * v.element_size() for v in batch.values())


def _cpu() -> float:
    """CPU seconds of this process and its DataLoader workers (those that have exited)."""
    import resource

    own, workers = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def run_world(
    reader: str,
    world: int,
    files: list[str],
    storage: dict[str, Any],
    workers: int,
    env: Any,
    cap: int = 0,
    mds: str = "",
) -> dict[str, float]:
    """All ranks at once (each reading at most ``cap`` rows, 0: all); samples/s and MB/s.
    ``mds``: Mosaic's shards, for the reader "mosaic" (whose ``env`` has it on the path)."""
    from efdl._process import free_port

    tmp = Path(tempfile.mkdtemp(prefix="efdl-data-"))
    # the ranks of one node, as torchrun and efdl-run describe them (Mosaic makes its own
    # process group from them)
    node = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    try:
        procs = []
        for rank in range(world):
            args = {
                "rank": rank,
                "world": world,
                "files": files,
                "storage": storage,
                "reader": reader,
                "workers": workers,
                "cap": cap,
                "mds": mds,
                "ready": str(tmp / f"ready-{rank}"),
                "go": str(tmp / "go"),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.data", "--rank-main", json.dumps(args)],
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**env, **node, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                )
            )
        deadline = time.monotonic() + 300
        while not all((tmp / f"ready-{r}").exists() for r in range(world)):
            if time.monotonic() > deadline or any(p.poll() for p in procs):
                raise RuntimeError(f"{reader} x{world}: ranks not ready within 300 s")
            time.sleep(0.01)
        (tmp / "go").touch()
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode:
                raise RuntimeError(f"{reader} x{world}: a rank exited {p.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    span = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    rows = sum(o["rows"] for o in outs)
    return {
        "rows": rows,
        "sps": rows / span,
        "mbs": sum(o["bytes"] for o in outs) / span / 1e6,
        "us_row": sum(o["cpu"] for o in outs) / rows * 1e6,
    }


# ---------------------------------------------------------------- the rescale


def rescale(files: list[str], storage: dict[str, Any], lanes: int) -> dict[str, float]:
    """2 ranks -> 3 at mid-epoch: a survivor's and a newcomer's first batch."""
    import efdl

    out: dict[str, float] = {}
    survivor = efdl.ElasticStream(files, BATCH * 3, lanes=lanes, storage_options=storage)
    half = survivor.total() // 2 // (BATCH * 3) * (BATCH * 3)
    for name in ("survivor", "newcomer"):
        t0 = time.perf_counter()
        if name == "newcomer":  # made now: it reads the footers (the sync gives it the position)
            stream = efdl.ElasticStream(files, BATCH * 3, lanes=lanes, storage_options=storage)
            before = 0
        else:  # its footers were read with the first epoch
            stream, before = survivor, survivor.source.bytes_read()
        stream.load_state_dict({**stream.state_dict(), "cursor": half})
        stream.set_world(2, 3)
        it = iter(stream)
        batch = next(it)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_bytes"] = stream.source.bytes_read() - before
        out["batch_rows"] = len(batch["id"])
        del it
    # A reader without a seek re-reads its files from their start: on average half of the
    # epoch's bytes spread over the new world, for one rank.
    total = sum(_size(f, storage) for f in files)
    out["reread_bytes"] = total / 2 / 3
    return out


def _size(url: str, storage: dict[str, Any]) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage)
    return int(fs.size(path))


# ---------------------------------------------------------------- the S3 stand-in


def upload(files: list[str], gb: float, endpoint: str) -> list[str]:
    """The first ``gb`` GB of the files, put on the S3 stand-in at ``endpoint``; their URLs."""
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("efdl-bench")
    n = max(1, min(len(files), round(gb * 1e9 / (FILE_ROWS * TOKENS * 4))))
    urls = []
    for f in files[:n]:
        url = f"s3://efdl-bench/{Path(f).name}"
        fs.put(f, url)
        urls.append(url)
    return urls


# ---------------------------------------------------------------- the report


COUNTS = "counts.json"  # the tar shards' sample counts, beside them (benchmarks.data_tar)


def tar_loader(
    reader: str, files: list[str], rank: int, world: int, storage: dict[str, Any], workers: int
) -> Any:
    """The DataLoader of ``reader`` ("tar-plain", "tar-wds" or "tar-efdl") for one rank."""
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    import efdl
    from efdl.data.tar import TarSource, tar_samples

    if reader == "tar-efdl":
        counts = json.loads((Path(files[0]).parent / COUNTS).read_text())
        stream = efdl.ElasticStream(
            TarSource(files, rows=counts, storage_options=storage), BATCH * world
        )
        stream.set_world(rank, world)
        return DataLoader(stream, batch_size=None, num_workers=workers)
    if reader == "tar-wds":
        import webdataset as wds  # type: ignore[import-untyped]

        data = wds.WebDataset(
            files,
            shardshuffle=False,
            nodesplitter=wds.split_by_node,  # by RANK and WORLD_SIZE
            workersplitter=wds.split_by_worker,
            empty_check=False,
        )
        return DataLoader(data, batch_size=BATCH, num_workers=workers)

    class Plain(IterableDataset[Any]):
        def __iter__(self) -> Any:
            info = get_worker_info()
            w, k = (info.id, info.num_workers) if info else (0, 1)
            for url in files[rank::world][w::k]:
                yield from tar_samples(url, 0, storage)

    return DataLoader(Plain(), batch_size=BATCH, num_workers=workers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-main", help=argparse.SUPPRESS)
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument(
        "--s3-gb",
        type=float,
        default=1.0,
        help="GB of the files on the S3 stand-in (0: no S3 runs)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "efdl-bench-parquet"))
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--readers", default="plain,efdl,efdl64,hf")
    p.add_argument(
        "--hf-rows", type=int, default=50_000, help="rows per rank that hf reads (it is slow)"
    )
    p.add_argument("--workers", default="0", help="DataLoader worker counts, e.g. 0,2")
    p.add_argument("--places", default="local,s3", help="local disk, the S3 stand-in, or both")
    p.add_argument(
        "--mosaic",
        default=os.environ.get("EFDL_BENCH_MOSAIC", "/tmp/efdl-mosaic"),
        help="where benchmarks/mosaic/install.sh put MosaicML streaming (reader 'mosaic')",
    )
    p.add_argument("--write-mds", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_main:
        rank_main(json.loads(a.rank_main))
        return
    if a.write_mds:
        job = json.loads(a.write_mds)
        write_mds(job["files"], Path(job["folder"]))
        return
    readers = a.readers.split(",")
    wanted = a.places.split(",")
    known = re.compile(r"plain|efdl\d*|hf|mosaic")
    for name, values, expected in (
        (
            "--readers",
            [r for r in readers if not known.fullmatch(r)],
            "plain, efdl, efdlN, hf, mosaic",
        ),
        ("--places", [w for w in wanted if w not in ("local", "s3")], "local, s3"),
    ):
        if values:
            sys.exit(
                f"{name}: unknown {values[0]!r}; expected a comma-separated list of {expected}."
            )
    t0 = time.perf_counter()
    files = generate(Path(a.dir), a.gb)
    print(
        f"Generated in {time.perf_counter() - t0:.0f} s (or reused): {len(files)} files",
        file=sys.stderr,
    )
    on_disk = sum(os.path.getsize(f) for f in files)
    worlds = [int(w) for w in a.worlds.split(",")]
    worker_counts = [int(w) for w in a.workers.split(",")]
    places: list[tuple[str, list[str], dict[str, Any]]] = []
    if "local" in wanted:
        places.append(("local", files, {}))
    mds = ""
    if "mosaic" in readers:
        found = subprocess.run(
            [sys.executable, "-c", "import streaming"],
            env=_mosaic_env(dict(os.environ), a.mosaic),
            capture_output=True,
            text=True,
        )
        if found.returncode:
            last = (found.stderr.strip().splitlines() or ["?"])[-1]
            sys.exit(
                f"The reader 'mosaic' needs MosaicML streaming at --mosaic {a.mosaic!r}, which "
                f"does not import from there ({last}); expected the folder that "
                f"'bash benchmarks/mosaic/install.sh {a.mosaic}' makes."
            )
        mds = str(Path(a.dir) / "mds")
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.data",
                "--write-mds",
                json.dumps({"files": files, "folder": mds}),
            ],
            env=_mosaic_env(dict(os.environ), a.mosaic),
            check=True,
        )
        print(f"MDS written in {time.perf_counter() - t0:.0f} s (or reused)", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        if a.s3_gb > 0 and "s3" in wanted:
            s3_env = stack.enter_context(s3_stand_in())
            os.environ.update(s3_env)  # the ranks inherit it
            places.append(("s3", upload(files, a.s3_gb, s3_env["AWS_ENDPOINT_URL"]), {}))
        env = dict(os.environ)
        results: dict[tuple[str, str, int, int], list[dict[str, float]]] = {}
        for _ in range(a.repeat):
            for place, urls, storage in places:
                for workers in worker_counts:
                    for world in worlds:
                        for reader in readers:
                            key = (place, reader, world, workers)
                            if reader == "mosaic" and place != "local":
                                continue  # it downloads whole shards, then reads them locally
                            run_env = _mosaic_env(env, a.mosaic) if reader == "mosaic" else env
                            cap = a.hf_rows if reader in ("hf", "mosaic") else 0
                            try:
                                got = run_world(
                                    reader, world, urls, storage, workers, run_env, cap, mds
                                )
                            except RuntimeError as exc:
                                print(f"{key}: {exc}", file=sys.stderr)
                                continue
                            results.setdefault(key, []).append(got)
        resc = {
            (place, lanes): rescale(urls, storage, lanes)
            for place, urls, storage in places
            for lanes in (64, 16)
        }
    print(
        f"Data: {len(files)} Parquet files, {sum(FILE_ROWS for _ in files):,} rows of "
        f"{TOKENS} int32 tokens, {on_disk / 1e9:.2f} GB on disk (snappy), "
        f"{len(files) * FILE_ROWS * TOKENS * 4 / 1e9:.2f} GB decoded; S3 stand-in: the first "
        f"{next((len(u) for w, u, _ in places if w == 's3'), 0)} files. Per-rank "
        f"batch {BATCH}. Medians of "
        f"{a.repeat} interleaved runs (range).\n"
    )
    print("| where | workers | ranks | reader | samples/s | MB/s | CPU us/row | efdl / plain |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {}
    for place, _, _ in places:
        for workers in worker_counts:
            for world in worlds:
                plain = results.get((place, "plain", world, workers), [])
                base = statistics.median(r["sps"] for r in plain) if plain else None
                for reader in readers:
                    rs = results.get((place, reader, world, workers), [])
                    if reader == "mosaic" and place != "local":
                        continue
                    if not rs:
                        print(f"| {place} | {workers} | {world} | {reader} | failed | | | |")
                        continue
                    sps = [r["sps"] for r in rs]
                    ratio = ""
                    if reader != "plain" and base:
                        ratio = f"{statistics.median(sps) / base:.2f}"
                        ratios.setdefault(reader, []).append(statistics.median(sps) / base)
                    print(
                        f"| {place} | {workers} | {world} | {reader} | {spread(sps, 0)} | "
                        f"{spread([r['mbs'] for r in rs], 0)} | "
                        f"{spread([r['us_row'] for r in rs], 1)} | {ratio} |"
                    )
    print()
    for reader, rs in ratios.items():
        if reader.startswith("efdl"):
            print(
                f"Goal, {reader} at >= 95 % of the plain reader in every row: "
                f"{verdict(min(rs) >= 0.95)} (worst {min(rs):.2f})."
            )
    print("\nRescale at mid-epoch, 2 ranks -> 3 (rank 2 of 3), one run:\n")
    print(
        "| where | lanes | survivor: first batch | bytes read | newcomer: first batch "
        "(footers too) | bytes read | a reader without seek re-reads |"
    )
    print("|---|---|---|---|---|---|---|")
    for (place, lanes), r in resc.items():
        print(
            f"| {place} | {lanes} | {r['survivor_s'] * 1000:.0f} ms | "
            f"{r['survivor_bytes'] / 1e6:.1f} MB | {r['newcomer_s'] * 1000:.0f} ms | "
            f"{r['newcomer_bytes'] / 1e6:.1f} MB | {r['reread_bytes'] / 1e6:.0f} MB |"
        )


if __name__ == "__main__":
    main()
