"""efdl.ElasticStream over real Parquet files (and a reader function): the epoch's order
through rescales, DataLoader workers, reads that seek, positions, and clear errors."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from threading import Thread
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from efdl.data import exchange
from efdl.data.order import StreamShareError, most_ranks
from efdl.data.source import ArrowBlock, ArrowLanes, DataSourceError, ParquetSource, ReaderSource
from efdl.data.stream import ElasticStream
from efdl.errors import EfdlError
from tests.wait import wait_until

# Uneven files (one empty), row groups of 100: lanes begin and end inside both.
ROWS = (1000, 37, 0, 512, 999, 64, 2048, 5, 700)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("shards")
    first, files = 0, []
    for i, n in enumerate(ROWS):
        ids = pa.array(range(first, first + n), pa.int64())
        x = pa.array([[float(v)] * 3 for v in range(first, first + n)], pa.list_(pa.float32(), 3))
        path = folder / f"part-{i:03d}.parquet"
        pq.write_table(
            pa.table({"id": ids, "x": x, "s": ids.cast(pa.string())}), path, row_group_size=100
        )
        files.append(str(path))
        first += n
    return files


def stream(files: Any, batch: int = 128, **kw: Any) -> ElasticStream:
    kw = {"lanes": 16, "window": 50, "seed": 3, **kw}
    return ElasticStream(files, batch, **kw)


def ids(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["id"]]


def test_a_step_is_the_next_global_batch_of_the_order_split_over_the_ranks(
    shards: list[str],
) -> None:
    ref = stream(shards)
    order = ref.order()
    first_id = {s: sum(ROWS[:s]) for s in range(len(ROWS))}
    expected = [first_id[shard] + row for shard, row in (order.at(p) for p in range(order.total))]
    for world in (1, 3, 16, 40):  # 40: more ranks than lanes, which they share
        streams = [stream(shards) for _ in range(world)]
        for rank, s in enumerate(streams):
            s.set_world(rank, world)
        for step, batches in enumerate(zip(*streams, strict=True)):
            got = sorted(i for b in batches for i in ids(b))
            assert got == sorted(expected[step * 128 : (step + 1) * 128]), (world, step)


def test_each_row_once_per_epoch_through_random_rescales(shards: list[str]) -> None:
    rng = random.Random(5)
    for epoch in range(3):
        seen: Counter[int] = Counter()
        position: dict[str, Any] | None = None
        while position is None or position["cursor"] < sum(ROWS):
            world = rng.randint(1, 24)  # above 16: ranks share lanes
            streams = [stream(shards) for _ in range(world)]
            for rank, s in enumerate(streams):
                if position is not None:
                    s.load_state_dict(position)
                s.set_epoch(epoch)
                s.set_world(rank, world)
            for batches in zip(*streams, strict=False):
                for b in batches:
                    seen.update(ids(b))
                for s in streams:
                    s.advance()
                if rng.random() < 0.2:
                    break  # a rescale: the others pause here too
            position = streams[0].state_dict()
        assert sorted(seen) == list(range(sum(ROWS))) and max(seen.values()) == 1, epoch


def test_columns_become_tensors_and_strings_lists(shards: list[str]) -> None:
    """Also from DataLoader workers, whose tensors are gathered into shared memory."""
    batch = next(iter(stream(shards)))
    assert batch["id"].dtype == torch.int64 and batch["x"].shape == (128, 3)
    assert torch.equal(batch["x"][:, 0].long(), batch["id"])
    assert batch["s"] == [str(i) for i in ids(batch)]
    for got in DataLoader(stream(shards), batch_size=None, num_workers=2):
        assert got["id"].dtype == torch.int64 and got["x"].shape == (len(got["id"]), 3)
        assert torch.equal(got["x"], got["id"][:, None].float().expand(-1, 3))
        assert got["s"] == [str(i) for i in ids(got)]
    only = next(iter(stream(shards, columns=["id"])))
    assert list(only) == ["id"]


def test_a_kept_batch_keeps_its_rows_and_a_dropped_one_frees_its_memory(
    shards: list[str],
) -> None:
    """A batch is a view of the rank's block where its rows are one range of it: the block's
    memory is reused only once no batch shares it."""
    kept = [(b, ids(b), b["x"].clone()) for b in stream(shards, batch=64)]
    assert len(kept) > 20
    for batch, seen, x in kept:  # every block was read after these batches were made
        assert ids(batch) == seen and torch.equal(batch["x"], x)
    # Dropped (as a training loop does): blocks reuse the memory of blocks before them.
    spares: list[bool] = []
    make = ArrowBlock.__init__

    def counted(self: ArrowBlock, lanes: int, rows: int, spare: Any = None) -> None:
        spares.append(spare is not None)
        make(self, lanes, rows, spare)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ArrowBlock, "__init__", counted)
        for batch in stream(shards, batch=64):
            assert len(batch["x"])
    assert len(spares) > 5 and sum(spares) >= len(spares) - 3


def test_a_workers_block_gathers_any_rows_of_its_windows() -> None:
    """ArrowLanes (a DataLoader worker's block) gathers block rows ``start, start + step,
    ...`` (row ``i * lanes + l``: lane ``l``'s row ``i`` in its order) from windows of one
    or several chunks, for one lane or several, consecutive rows or every k-th."""
    rng = random.Random(0)
    checked = 0
    for _ in range(500):
        lanes, rows = rng.choice([1, 2, 3, 8]), rng.choice([5, 16, 50])
        block = ArrowLanes(lanes, rows)
        counts = [rows] + [rng.randint(1, rows) for _ in range(lanes - 1)]
        want = {}
        for lane, n in enumerate(counts):
            values = [lane * 100_000 + 10 * v for v in range(n)]
            cuts = sorted(rng.sample(range(1, n), min(rng.randint(0, 3), n - 1)))
            parts = [values[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
            piece = pa.Table.from_batches([pa.record_batch({"v": pa.array(p)}) for p in parts])
            order = rng.sample(range(n), n)
            block.put(lane, piece, np.array(order, dtype=np.int64))
            want.update({i * lanes + lane: values[o] for i, o in enumerate(order)})
        start, step = rng.randrange(max(want) + 1), rng.choice([1, 1, 2, 3])
        stop = start + step * rng.randint(1, 20)
        if not all(r in want for r in range(start, stop, step)):
            continue  # past a short lane's window: no step asks for those rows
        out = np.empty((len(range(start, stop, step)), 1), np.int64)
        assert block.gather(0, start, stop, step, out)
        assert out[:, 0].tolist() == [want[r] for r in range(start, stop, step)]
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("workers", [0, 2])
def test_nulls_in_some_windows_and_a_transform_of_the_rows(tmp_path: Path, workers: int) -> None:
    """A column with nulls in some shards comes as Python values in the steps that have
    them; a transform gets each step's rows as an Arrow table (in DataLoader workers too,
    whose blocks keep the windows as read)."""
    paths = []
    for i in range(4):
        ids_ = pa.array(range(i * 300, (i + 1) * 300), pa.int64())
        v = pa.array([None if i == 2 and j % 7 == 0 else j for j in range(i * 300, (i + 1) * 300)])
        paths.append(str(tmp_path / f"p{i}.parquet"))
        pq.write_table(pa.table({"id": ids_, "v": v}), paths[-1], row_group_size=64)
    seen, kinds = [], set()
    s = ElasticStream(paths, 32, lanes=4, window=16, seed=1)
    for batch in DataLoader(s, batch_size=None, num_workers=workers):
        kinds.add(type(batch["v"]))
        values = batch["v"].tolist() if torch.is_tensor(batch["v"]) else batch["v"]
        for i, v in zip(ids(batch), values, strict=True):
            assert v == (None if 600 <= i < 900 and i % 7 == 0 else i)
        seen += ids(batch)
    assert sorted(seen) == list(range(1200)) and kinds == {torch.Tensor, list}
    s = ElasticStream(paths, 32, lanes=4, window=16, seed=1, transform=lambda t: t)
    tables = list(DataLoader(s, batch_size=None, num_workers=workers))
    assert all(isinstance(t, pa.Table) for t in tables)  # kept: views of blocks, too
    rows = [r for t in tables for r in t.to_pylist()]
    assert sorted(r["id"] for r in rows) == list(range(1200))
    assert all(
        r["v"] == (None if 600 <= r["id"] < 900 and r["id"] % 7 == 0 else r["id"]) for r in rows
    )


def run_loader(s: ElasticStream, loader: DataLoader[Any], steps: int) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(ids(batch))
        s.advance()
        if len(out) == steps:
            break
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_dataloader_workers_yield_the_main_process_batches(shards: list[str]) -> None:
    """num_workers 2 (plain and persistent) and 3 (lanes split unevenly between them) yield
    what num_workers 0 does, from the same cursor, also after the cursor, the world and the
    epoch change between iterations."""
    results = []
    for workers, persistent in ((0, False), (2, False), (2, True), (3, False)):
        s = stream(shards)
        s.set_world(1, 3)
        loader: DataLoader[Any] = DataLoader(
            s, batch_size=None, num_workers=workers, persistent_workers=persistent
        )
        got = run_loader(s, loader, 7)
        s.set_world(0, 2)  # a rescale between iterations
        got += run_loader(s, loader, 5)
        s.set_epoch(1)
        got += run_loader(s, loader, 4)
        results.append(got)
    assert results[0] == results[1] == results[2] == results[3]
    assert len(results[0]) == 16


def test_dataloader_workers_do_not_read_the_footers_again(
    shards: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream reads every shard's footer when it is made; its DataLoader workers (fresh
    at every epoch) get them with it. A footer read after that fails the worker."""
    s = stream(shards)
    s.set_world(0, 2)

    def read_again(self: ParquetSource, shard: int) -> list[int]:
        raise AssertionError(f"footer of shard {shard} read again, in process {os.getpid()}")

    monkeypatch.setattr(ParquetSource, "_footer", read_again)
    loader: DataLoader[Any] = DataLoader(s, batch_size=None, num_workers=2)
    for epoch in range(2):
        s.set_epoch(epoch)
        got = sorted(i for batch in loader for i in ids(batch))
        assert len(got) == len(set(got)) and len(got) >= sum(ROWS) // 2


class LateWorker(ElasticStream):
    """A stream whose DataLoader worker 1 begins each iteration only once the main process
    has committed a step of it (from worker 0's batch): a worker late under load, made
    certain. ``release`` (shared): the cursor that lets worker 1 begin."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.release = torch.zeros(1, dtype=torch.int64).share_memory_()

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 1:
            wait_until(
                "the main process to commit worker 0's step",
                lambda: self.cursor >= int(self.release),
                60,
            )
        return super().__iter__()


def test_a_worker_that_begins_late_takes_its_own_steps(shards: list[str]) -> None:
    """Worker 1 begins each iteration after the main process committed worker 0's batch: it
    still yields the steps of its turn from the iteration's start, fresh workers and
    persistent ones (whose later iterations start at the main process's cursor of then).
    One lane per rank: worker 0 reads it, so it makes its batch without worker 1 (a worker
    that reads lanes gives the others their windows, so they cannot pass it)."""
    ref = stream(shards, lanes=2)
    ref.set_world(0, 2)
    want = run_loader(ref, DataLoader(ref, batch_size=None), 6)
    want += run_loader(ref, DataLoader(ref, batch_size=None), 6)
    for persistent in (False, True):
        s = LateWorker(shards, 128, lanes=2, window=50, seed=3)
        s.set_world(0, 2)
        loader: DataLoader[Any] = DataLoader(
            s, batch_size=None, num_workers=2, persistent_workers=persistent
        )
        got = []
        for _ in range(2):
            s.release[0] = s.cursor + s.global_batch_size  # after the iteration's first step
            got += run_loader(s, loader, 6)
        assert got == want, persistent


def test_a_rescale_reads_from_where_the_share_starts(tmp_path: Path) -> None:
    """A rank that starts mid-epoch opens its lanes at the row groups that hold the cursor:
    its first batch reads a small part of what reading its lanes from the start would."""
    rng = random.Random(1)
    for i in range(8):  # 8 files of 4000 rows, 200 random bytes each: 800 kB, 8 row groups
        payload = pa.array([rng.randbytes(200) for _ in range(4000)], pa.binary())
        table = pa.table(
            {"id": pa.array(range(i * 4000, (i + 1) * 4000), pa.int64()), "p": payload}
        )
        pq.write_table(table, tmp_path / f"{i}.parquet", row_group_size=500, compression="none")
    whole = ElasticStream(str(tmp_path), 256, lanes=4, window=64)
    whole.rows()
    footers = whole.source.bytes_read()
    for _ in whole:
        pass
    epoch_bytes = whole.source.bytes_read() - footers
    assert epoch_bytes > 6_400_000  # the data, read once
    s = ElasticStream(str(tmp_path), 256, lanes=4, window=64)
    s.load_state_dict({**s.state_dict(), "cursor": 16_000})  # half the epoch
    s.set_world(1, 2)
    footers = s.source.bytes_read()
    assert ids(next(iter(s)))
    # Two lanes, each its row group at the cursor and the next window's: about 4 row groups
    # (100 kB each) of the 64 there are.
    assert s.source.bytes_read() - footers < epoch_bytes / 8, (s.source.bytes_read(), epoch_bytes)


def read_jsonl(path: str, start: int) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= start:
                yield json.loads(line)


def test_any_format_through_a_reader_function_also_in_workers(tmp_path: Path) -> None:
    names, counts, first = [], [], 0
    for i, n in enumerate((40, 3, 77)):
        path = tmp_path / f"{i}.jsonl"
        path.write_text(
            "".join(json.dumps({"id": v, "y": v * 0.5}) + "\n" for v in range(first, first + n))
        )
        names.append(str(path))
        counts.append(n)
        first += n
    s = ElasticStream(ReaderSource(names, read_jsonl, counts), 24, lanes=4, window=10)
    loader: DataLoader[Any] = DataLoader(s, batch_size=None, num_workers=2)
    got = [int(i) for batch in loader for i in batch["id"]]
    assert sorted(got) == list(range(120))
    assert torch.is_tensor(next(iter(s))["y"])


def read_logged(path: str, start: int) -> Iterator[dict[str, Any]]:
    """read_jsonl, writing each sample's id to ``path.reads`` as it is read (by any
    process: small appends are whole)."""
    with open(path + ".reads", "a") as log:
        for sample in read_jsonl(path, start):
            log.write(f"{sample['id']}\n")
            log.flush()
            yield sample


def jsonl_shards(folder: Path, sizes: list[int]) -> tuple[list[str], list[int]]:
    names, first = [], 0
    for i, n in enumerate(sizes):
        path = folder / f"{i:03d}.jsonl"
        path.write_text("".join(json.dumps({"id": v}) + "\n" for v in range(first, first + n)))
        names.append(str(path))
        first += n
    return names, sizes


def reads(names: list[str]) -> int:
    """Samples read since the last call (the logs are emptied)."""
    total = 0
    for name in names:
        log = Path(name + ".reads")
        if log.exists():
            total += len(log.read_text().split())
            log.unlink()
    return total


def test_dataloader_workers_read_each_row_once_between_them(tmp_path: Path) -> None:
    """Two DataLoader workers read the rank's rows once between them (each reads its lanes
    and gives the other its windows), not once each; and leave no files behind."""
    names, counts = jsonl_shards(tmp_path, [25] * 40)  # 1000 rows
    s = ElasticStream(ReaderSource(names, read_logged, counts), 40, lanes=8, window=10)
    s.set_world(0, 2)
    alone = sorted(int(i) for batch in s for i in batch["id"])
    # Each of the rank's rows once, and a shard's rows before a lane's first, as a shard is
    # read from its start. (Lanes meeting in a shard share its read when their threads come
    # close enough in time: how many do depends on the machine's load, so no closer bound.)
    # Read once per worker, it would be twice the rows.
    once = range(len(alone), len(alone) + 8 * 25 + 1)
    assert reads(names) in once
    for persistent in (False, True):
        loader: DataLoader[Any] = DataLoader(
            s, batch_size=None, num_workers=2, persistent_workers=persistent
        )
        assert sorted(int(i) for batch in loader for i in batch["id"]) == alone
        assert reads(names) in once
        assert not list(exchange.base().glob(f"efdl-stream-{s._token}-*"))


def test_a_loop_that_ends_early_leaves_nothing_behind_its_stream(shards: list[str]) -> None:
    s = stream(shards)
    for persistent in (False, True):
        loader: DataLoader[Any] = DataLoader(
            s, batch_size=None, num_workers=2, persistent_workers=persistent
        )
        assert len(run_loader(s, loader, 3)) == 3
    token = s._token
    assert list(exchange.base().glob(f"efdl-stream-{token}-*"))  # windows not taken
    del s, loader
    gc.collect()
    assert not list(exchange.base().glob(f"efdl-stream-{token}-*"))


def test_an_iterator_the_gc_finalizes_does_not_join_its_readers(shards: list[str]) -> None:
    """As found: an iterator abandoned mid-read in a reference cycle was finalized by the
    garbage collector where a thread held threading's shutdown lock (the interpreter's exit
    joining threads, a thread starting or ending), and its close joined the reader threads,
    whose end takes that lock: the process hung. Here the collection runs in one thread
    while another holds the lock: a close that joins cannot return until it is let go. It
    now tells the readers to stop and returns; they end by themselves."""
    collect, collected = threading.Event(), threading.Event()

    def collector() -> None:
        collect.wait(30)
        gc.collect()
        collected.set()

    helper = threading.Thread(target=collector, daemon=True)
    helper.start()  # before the lock is held: a thread's start takes it
    automatic = gc.isenabled()
    gc.disable()  # the cycle goes at the collection below, not before
    try:
        it = iter(stream(shards, batch=64, threads=2))
        assert ids(next(it))
        readers = list(it.gi_frame.f_locals["reader"]._pool._threads)
        assert readers and all(t.is_alive() for t in readers)
        cycle: list[Any] = [it]
        cycle.append(cycle)
        del it, cycle
        with threading._shutdown_locks_lock:  # type: ignore[attr-defined]
            collect.set()
            finalized = collected.wait(5)
    finally:
        if automatic:
            gc.enable()
    helper.join(30)  # (a join held up by the lock goes on once it is let go)
    assert finalized, "the finalizer waited for threading's shutdown lock: it joined readers"
    wait_until(
        "the readers to end by themselves", lambda: not any(map(Thread.is_alive, readers)), 10
    )


def test_a_worker_that_fails_fails_the_loop_with_its_error(tmp_path: Path) -> None:
    """A shard shorter than its count: the worker that reads it fails, and the loop raises
    its error (not a wait for its windows in the other worker)."""
    names, counts = jsonl_shards(tmp_path, [25] * 40)
    counts = [*counts[:-1], 30]
    s = ElasticStream(ReaderSource(names, read_jsonl, counts), 40, lanes=8, window=10)
    with pytest.raises(DataSourceError, match="gave 25 samples"):
        list(DataLoader(s, batch_size=None, num_workers=2))


def test_the_last_step_gives_every_rank_a_row(tmp_path: Path) -> None:
    """The epoch's last global batch may miss a rank's lanes: that rank repeats one row of
    its own rather than take an empty step (a mean over none is NaN)."""
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"id": pa.array(range(100), pa.int64())}), path)
    streams = [ElasticStream(str(path), 32, lanes=8, window=8) for _ in range(4)]
    for rank, s in enumerate(streams):
        s.set_world(rank, 4)
    steps = [list(batches) for batches in zip(*streams, strict=True)]
    assert len(steps) == 4  # 100 rows: 3 steps of 32 and one of 4
    assert all(len(ids(b)) >= 1 for b in steps[-1])
    assert sum(len(ids(b)) for b in steps[-1]) <= 4 + 3


def count_up(shard: str, start: int) -> Iterator[int]:
    """A shard named "first:n" holds the ids first to first + n - 1."""
    first, n = map(int, shard.split(":"))
    return iter(range(first + start, first + n))


def id_stream(rows: tuple[int, ...], n: int, lanes: int) -> ElasticStream:
    names = [f"{sum(rows[:i])}:{r}" for i, r in enumerate(rows)]
    source = ReaderSource(names, count_up, list(rows))
    return ElasticStream(source, n, lanes=lanes, window=8, seed=1, transform=list)


def epoch_at(world: int, lanes: int, n: int, rows: tuple[int, ...]) -> list[list[list[int]]]:
    """An epoch at ``world`` ranks: each step's batches (ids), rank by rank."""
    streams = [id_stream(rows, n, lanes) for _ in range(world)]
    for rank, s in enumerate(streams):
        s.set_world(rank, world)
    return [list(batches) for batches in zip(*streams, strict=True)]


def assert_each_row_once(steps: list[list[list[int]]], total: int, world: int) -> None:
    """Every rank a row of every step; each id once, but for at most world - 1 repeats in
    the epoch's last step (docs/data.md, "The guarantee")."""
    assert all(len(batch) >= 1 for batches in steps for batch in batches)
    before = Counter(i for batches in steps[:-1] for batch in batches for i in batch)
    assert max(before.values()) == 1
    epoch = before + Counter(i for batch in steps[-1] for i in batch)
    assert set(epoch) == set(range(total))
    assert sum(epoch.values()) - total <= world - 1


@pytest.mark.parametrize(("world", "lanes", "n", "fits"), [(24, 16, 24, 32), (3, 2, 3, 4)])
def test_ranks_past_what_the_lanes_give_are_refused_rather_than_repeat_rows(
    world: int, lanes: int, n: int, fits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As found: 24 ranks over 16 lanes with a global batch of 24 trained 160 rows of a
    960-row epoch twice; 3 over 2 lanes with 3, one row 161 times. Such a world is refused
    where it is set (a rescale) and where an iteration begins (torchrun's world), naming
    what fits; the batch it names trains each row once."""
    rows = (500, 460)
    said = rf"world of {world} ranks cannot share steps of {n} rows .* {lanes} lanes"
    with pytest.raises(StreamShareError, match=rf"{said}.* at least {fits}"):
        id_stream(rows, n, lanes).set_world(world - 1, world)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(StreamShareError, match=said):
        next(iter(id_stream(rows, n, lanes)))
    assert_each_row_once(epoch_at(world, lanes, fits, rows), sum(rows), world)


def test_each_row_once_at_any_world_lanes_and_batch_the_stream_takes() -> None:
    """A sweep of small worlds, lanes and batches over real streams: a world within lanes *
    (batch // lanes) trains each row once (every rank a row of every step); one past it
    is refused."""
    rows = (40, 17, 30)
    for lanes in (1, 2, 3):
        for n in range(lanes, 2 * lanes + 3):
            for world in range(1, 6):
                if world > most_ranks(lanes, n):
                    with pytest.raises(StreamShareError):
                        id_stream(rows, n, lanes).set_world(0, world)
                    continue
                assert_each_row_once(epoch_at(world, lanes, n, rows), sum(rows), world)


def test_a_position_keeps_its_order_settings_until_its_epoch_ends(shards: list[str]) -> None:
    old = stream(shards, lanes=8, window=20)
    old.advance()
    s = stream(shards, lanes=16, window=50)
    s.load_state_dict(old.state_dict())
    assert (s.order().lanes, s.order().window, s.cursor) == (8, 20, 128)
    s.set_epoch(1)
    assert (s.order().lanes, s.order().window, s.cursor) == (16, 50, 0)


def test_bad_settings_positions_and_files_are_clear_errors(
    shards: list[str], tmp_path: Path
) -> None:
    with pytest.raises(
        ValueError, match="global_batch_size is 8; expected at least lanes \\(16\\)"
    ):
        stream(shards, batch=8)
    with pytest.raises(ValueError, match="window is 0; expected"):
        stream(shards, window=0)
    with pytest.raises(
        StreamShareError, match=r"world of 129 ranks is larger than the global batch \(128\)"
    ):
        stream(shards).set_world(0, 129)
    s = stream(shards)
    with pytest.raises(
        DataSourceError, match="9 shards and 6365 rows; this stream has 9 shards and 5365"
    ):
        s.load_state_dict({**s.state_dict(), "rows": 6365})
    with pytest.raises(DataSourceError, match="Not an ElasticStream position"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(DataSourceError, match="No Parquet files at"):
        ParquetSource(str(tmp_path / "none-*.parquet"))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataSourceError, match=r"bad\.parquet' is not a Parquet file"):
        stream([str(bad)])
    with pytest.raises(DataSourceError, match="has no column"):
        next(iter(stream(shards, columns=["nope"])))


def test_files_whose_columns_differ_are_refused_when_the_stream_is_made(tmp_path: Path) -> None:
    """A column of another type, one a file lacks, or nullability: refused with both files
    and the column named, when the footers are read (at the stream's making), not as
    pyarrow's ArrowInvalid naming no file mid-epoch, where a window spans the two files."""
    ids_ = pa.array(range(100), pa.int64())
    x_int = pa.table({"id": ids_, "x": pa.array(range(100), pa.int64())})
    cases = {
        "a double": (
            pa.table({"id": ids_, "x": pa.array(range(100), pa.float64())}),
            r"'x' as int64, '[^']*b\.parquet' has it as double",
        ),
        "no x": (pa.table({"id": ids_}), r"b\.parquet' has no column 'x', which '[^']*a\.parquet"),
        "not null": (
            pa.Table.from_arrays(
                [ids_, pa.array(range(100), pa.int64())],
                schema=pa.schema([pa.field("id", pa.int64()), pa.field("x", pa.int64(), False)]),
            ),
            r"'x' as int64, '[^']*b\.parquet' has it as int64 not null",
        ),
    }
    for name, (other, said) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        pq.write_table(x_int, folder / "a.parquet")
        pq.write_table(other, folder / "b.parquet")
        files = [str(folder / "a.parquet"), str(folder / "b.parquet")]
        with pytest.raises(DataSourceError, match=said) as made:
            ElasticStream(files, 16, lanes=1, window=64, shuffle=False)
        assert isinstance(made.value, EfdlError)
        # Counts given, no footer is read at the start: refused at the file's first read.
        source = ParquetSource(files, rows=[100, 100])
        with pytest.raises(DataSourceError, match=said):
            list(ElasticStream(source, 16, lanes=1, window=64, shuffle=False))
    alike = ElasticStream(  # the columns they share alike
        [str(tmp_path / "no-x" / "a.parquet"), str(tmp_path / "no-x" / "b.parquet")],
        16,
        lanes=1,
        window=64,
        columns=["id"],
    )
    assert sorted(i for batch in alike for i in ids(batch)) == sorted([*range(100)] * 2)


def test_parquet_on_s3(s3_bucket: str, tmp_path: Path) -> None:
    import fsspec  # type: ignore[import-untyped]

    fs = fsspec.filesystem("s3")
    for i, n in enumerate((300, 200)):
        path = tmp_path / f"{i}.parquet"
        pq.write_table(
            pa.table({"id": pa.array(range(i * 300, i * 300 + n), pa.int64())}),
            path,
            row_group_size=64,
        )
        fs.put(str(path), f"{s3_bucket}/train/{i}.parquet")
    streams = [ElasticStream(f"{s3_bucket}/train/", 32, lanes=4, window=16) for _ in range(2)]
    for rank, s in enumerate(streams):
        s.set_world(rank, 2)
    got = sorted(i for s in streams for b in s for i in ids(b))
    assert got == sorted([*range(300), *range(300, 500)])
    assert streams[0].source.bytes_read() > 0


def test_the_workers_pools_stay_small_over_a_long_epoch(
    shards: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker's pool of window files is reused as the takers release windows: over an
    epoch of hundreds of windows it holds a few per lane (were windows never released, it
    would hold every window the epoch gave)."""
    monkeypatch.setenv("EFDL_DATA_SHM", str(tmp_path))
    s = stream(shards, batch=32, lanes=4, window=10)
    given = sum(s.order().windows(lane) for lane in range(4))  # one taker each
    most, got = 0, []
    for batch in DataLoader(s, batch_size=None, num_workers=2):
        got += ids(batch)
        most = max(most, pool_files(tmp_path))
    assert sorted(got) == list(range(sum(ROWS)))
    assert given > 500 and 0 < most <= 10 * 4, (given, most)  # about 5 per lane here
    assert not list(tmp_path.iterdir())


def pool_files(root: Path) -> int:
    """The window files in the iteration directories under ``root`` (one may go meanwhile)."""
    count = 0
    for folder in root.glob("efdl-stream-*"):
        with contextlib.suppress(FileNotFoundError):
            count += sum(1 for f in os.scandir(folder) if f.name.startswith("pool."))
    return count


def test_readers_take_their_process_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 cores: a rank alone reads with 8 threads (the most), 4 ranks with 4 each; in
    DataLoader workers the rank's main process counts too (4 ranks of 2 workers: 1 each,
    not 2, which would put 3 busy threads per worker on 16 cores)."""
    from efdl.data import stream as stream_module

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    got = {}
    for local in (1, 2, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        got[local] = [stream_module._threads(workers) for workers in (0, 2, 7)]
    assert got == {1: [8, 5, 2], 2: [8, 2, 1], 4: [4, 1, 1]}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert stream_module._threads(0) == 8
