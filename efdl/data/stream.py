"""A streamed dataset whose epoch survives a change of world size.

:class:`ElasticStream` is an ``IterableDataset`` over shards (efdl.data.source). The epoch's
order is efdl.data.order's: a function of (seed, epoch) and the stream's ``lanes`` and
``window``. Each step's global batch is the next ``global_batch_size`` positions from the
cursor (the samples committed steps consumed); this rank yields the rows of its own lanes,
so it reads only those lanes' parts of the shards, in order, a window at a time, and after a
rescale starts reading its new lanes where the cursor is.

The position (epoch, cursor, and the order's settings) is the stream's ``state_dict()``:
given to ``efdl.elastic_state(..., sampler=stream)`` it moves with every sync and persists
with the remote cache, and the state advances it at each ``commit()``. In a plain torchrun
script, call ``stream.advance()`` after each step and checkpoint ``stream.state_dict()``.

The position lives in a small shared-memory tensor, so DataLoader worker processes (also
persistent ones) start each iteration from where the main process was when it began (see
``ElasticStream._start``); worker ``w`` of ``n`` yields the steps ``w, w + n, ...`` of the
iteration, which is the order DataLoader returns them in. The workers divide the rank's
lanes between them and give each other the windows they decode (efdl.data.exchange), so the
rank decodes each window once.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from efdl.data.exchange import Exchange, sweep, token
from efdl.data.order import EpochOrder, LaneShare, check_world, lane_share
from efdl.data.source import Block, DataSourceError, ParquetSource, Pick, Source

# The shared position's fields.
_EPOCH, _CURSOR, _RANK, _WORLD, _LANES, _WINDOW, _SEED, _SET = range(8)


class ElasticStream(IterableDataset[Any]):
    """Batches of this rank's share of each step, from a position that survives rescales.

    Give it to a DataLoader with ``batch_size=None`` (it yields whole batches), and to
    ``efdl.elastic_state(..., sampler=stream)``::

        stream = efdl.ElasticStream("s3://bucket/train/", global_batch_size=512)
        loader = DataLoader(stream, batch_size=None, num_workers=2, pin_memory=True)

    Args:
        source: Parquet files (a list, a directory or a glob; local or any fsspec URL), or
            a :class:`~efdl.data.source.Source` (``ReaderSource`` for other formats).
        global_batch_size: samples per step over all ranks (a rank's share is about
            ``global_batch_size / world``). At least ``lanes``; a world is served while it
            is at most ``lanes * (global_batch_size // lanes)`` (every rank a row of every
            step: a multiple of ``lanes`` serves up to the batch).
        lanes: how the stream is cut for reading (fixed for an epoch). A rank reads
            ``lanes / world`` lanes at once, each its own place in the shards; above
            ``lanes`` ranks, ranks share a lane (each reads all of it). Keep ``lanes`` at or
            above the largest world; more lanes per rank cost threads' time and memory.
            Shares are equal when ``world`` divides ``lanes`` and ``lanes`` divides
            ``global_batch_size``.
        window: rows shuffled together within a lane (a row moves less than ``window``
            places in its lane); a rank holds about four windows of each of its lanes
            (docs/data.md), more while the caller keeps batches (views of them).
        seed: the same on every rank; with the epoch, it fixes the order.
        shuffle: False: shards in their given order and rows in theirs.
        transform: makes a batch from this rank's rows (a pyarrow Table for Parquet, a list
            of samples for a ``ReaderSource``). Default: a dict of tensors per column
            (:func:`to_torch`) for Arrow, ``default_collate`` for lists.
        columns, storage_options: for Parquet sources given as URLs.
        threads: reader threads per process. Default: this process's share of the cores
            (the cores it may run on, over ``LOCAL_WORLD_SIZE``, and in a DataLoader worker
            over the rank's workers and its main process, which trains), 1 to 8. Each
            reads one lane at a time; Arrow decodes outside the GIL, but more threads than
            cores contend for them and for it.

    The shards' row counts are read here, once (each Parquet file's footer, 32 files at a
    time), so that DataLoader workers, which get the stream when they start (at every epoch,
    unless ``persistent_workers``), have them and do not read every footer again.

    Raises:
        ValueError: a batch smaller than ``lanes``, or settings below 1.
        DataSourceError: a shard that cannot be read (see the source), shards whose columns
            differ, or no rows at all.
        StreamShareError: (at :meth:`set_world`, or when an iteration begins) a world the
            steps cannot give every rank a row of (see ``global_batch_size``).
    """

    def __init__(
        self,
        source: Source[Any] | str | Sequence[str],
        global_batch_size: int,
        *,
        lanes: int = 16,
        window: int = 1024,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable[[Any], Any] | None = None,
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        threads: int | None = None,
    ) -> None:
        if not isinstance(source, Source):
            source = ParquetSource(source, columns, storage_options)
        chosen = {"lanes": lanes, "window": window, "threads": 1 if threads is None else threads}
        for name, value in chosen.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; expected a whole number >= 1.")
        if not isinstance(global_batch_size, int) or global_batch_size < lanes:
            raise ValueError(
                f"global_batch_size is {global_batch_size!r}; expected at least lanes ({lanes}): "
                "every lane gives every step a row. Lower lanes (the largest world size the "
                "stream serves) or raise the batch."
            )
        self.source = source
        self.global_batch_size = global_batch_size
        self.lanes, self.window, self.shuffle, self.threads = lanes, window, shuffle, threads
        self.transform = transform
        self._pos = torch.zeros(8, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._pos[_LANES], self._pos[_WINDOW], self._pos[_SEED] = lanes, window, seed
        # The position as a process-local copy: what a DataLoader worker process finds at
        # its start (fork copies it, spawn pickles it): the position the iteration starts
        # at, whatever the main process committed since.
        self._local = self._pos.clone()
        # A persistent worker's later iterations: (iteration, loader seed, position), written
        # by the first of the loader's workers to begin the iteration, read by the others.
        self._begun = 0  # iterations this process began as a DataLoader worker
        self._record = torch.zeros(2 + len(self._local), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._rows = source.rows()  # here: a worker gets them (see above)
        if not sum(self._rows):
            raise DataSourceError(f"The shards {list(source.names())[:4]} have no rows.")
        self._total = sum(self._rows)
        # Names the windows its DataLoader workers give each other (efdl.data.exchange),
        # removed with the stream (or when its process ends).
        self._token = token()
        weakref.finalize(self, _sweep_in, os.getpid(), self._token)

    # ---------------------------------------------------------------- the position

    @property
    def epoch(self) -> int:
        return int(self._pos[_EPOCH])

    @property
    def cursor(self) -> int:
        """Samples of this epoch consumed by committed steps."""
        return int(self._pos[_CURSOR])

    @property
    def seed(self) -> int:
        return int(self._pos[_SEED])

    def rows(self) -> list[int]:
        """Each shard's row count (read when the stream was made)."""
        return self._rows

    def total(self) -> int:
        """Rows in an epoch."""
        return self._total

    def order(self, position: list[int] | None = None) -> EpochOrder:
        """The current epoch's order (or ``position``'s)."""
        p = position if position is not None else self._pos.tolist()
        return EpochOrder(self.rows(), p[_SEED], p[_EPOCH], p[_LANES], p[_WINDOW], self.shuffle)

    def set_world(self, rank: int, world: int) -> None:
        """Rank ``rank`` of ``world`` from now on (efdl's elastic state calls it at every
        sync).

        Raises:
            ValueError: a rank outside the world.
            StreamShareError: a world some step would leave a rank without a row of: above
                ``lanes * (global_batch_size // lanes)`` (efdl.data.order.check_world).
        """
        lanes = int(self._pos[_LANES])
        lane_share(rank, world, lanes)  # refuses a rank outside the world
        check_world(world, lanes, self.global_batch_size)
        self._pos[_RANK], self._pos[_WORLD], self._pos[_SET] = rank, world, 1
        self._local.copy_(self._pos)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (from its beginning, if it is a new one, with this stream's own
        lanes and window again)."""
        if epoch != self.epoch:
            self._pos[_EPOCH], self._pos[_CURSOR] = epoch, 0
            self._pos[_LANES], self._pos[_WINDOW] = self.lanes, self.window
            self._local.copy_(self._pos)

    def advance(self) -> None:
        """One step was committed: move the cursor past its global batch."""
        self._pos[_CURSOR] = min(self.total(), self.cursor + self.global_batch_size)
        self._local.copy_(self._pos)

    def state_dict(self) -> dict[str, Any]:
        p = self._pos.tolist()
        return {
            "epoch": p[_EPOCH],
            "cursor": p[_CURSOR],
            "seed": p[_SEED],
            "lanes": p[_LANES],
            "window": p[_WINDOW],
            "rows": self.total(),
            "shards": len(self.rows()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a position. Its lanes and window hold until its epoch ends (the order of an
        epoch under way must not change).

        Raises:
            DataSourceError: the position is of another data set (other shard or row
                counts), or not a stream's position.
        """
        try:
            got = {k: int(state[k]) for k in ("epoch", "cursor", "seed", "lanes", "window")}
            rows, shards = int(state["rows"]), int(state["shards"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataSourceError(
                f"Not an ElasticStream position: {state!r} (expected epoch, cursor, seed, "
                "lanes, window, rows and shards)."
            ) from exc
        if (rows, shards) != (self.total(), len(self.rows())):
            raise DataSourceError(
                f"The position is of a data set of {shards} shards and {rows} rows; this stream "
                f"has {len(self.rows())} shards and {self.total()} rows. Resume with the "
                "same shards (or start a new epoch without loading the position)."
            )
        if got["lanes"] < 1 or got["window"] < 1 or not 0 <= got["cursor"] <= rows:
            raise DataSourceError(f"The position {state!r} is out of range.")
        for field, value in (
            (_EPOCH, got["epoch"]),
            (_CURSOR, got["cursor"]),
            (_SEED, got["seed"]),
            (_LANES, got["lanes"]),
            (_WINDOW, got["window"]),
        ):
            self._pos[field] = value
        self._local.copy_(self._pos)

    # ---------------------------------------------------------------- reading

    def _world(self, p: list[int]) -> tuple[int, int]:
        if p[_SET]:
            return p[_RANK], p[_WORLD]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def __len__(self) -> int:
        """Steps left in the epoch (every rank takes each of them)."""
        left = self.total() - self.cursor
        return -(-left // self.global_batch_size)

    def _start(self, info: Any) -> list[int]:
        """The position this iteration starts at: the main process's when the iteration
        began. A DataLoader worker may begin after the main process committed the steps of
        other workers' batches (a worker is late under load); the position then is not the
        iteration's start, and the worker would take the wrong steps."""
        if info is None:  # the main process: nothing is committed before its first batch
            return _ints(self._pos)
        self._begun += 1
        if self._begun == 1:  # a fresh worker: its copy is from the iteration's start
            return _ints(self._local)
        # A persistent worker: the first of the iteration's workers to begin comes before
        # worker 0's first batch, so before any commit; it records what it read.
        now = _ints(self._pos)  # read before the record: see below
        tag = [self._begun, (info.seed - info.id) % 2**62]  # the loader's base seed
        record = _ints(self._record)
        if record[:2] == tag:
            return record[2:]
        # No record of this iteration yet, so when `now` was read no worker had begun it,
        # hence no commit of it either. Write the position first: a reader that sees the
        # tag sees it. Two first workers write the same values.
        self._record[2:] = torch.tensor(now)
        self._record[:2] = torch.tensor(tag)
        return now

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        p = self._start(info)
        order = self.order(p)
        rank, world = self._world(p)
        check_world(world, order.lanes, self.global_batch_size)  # a world of torchrun's
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        threads = self.threads or _threads(workers if info is not None else 0)
        steps = range(p[_CURSOR], order.total, self.global_batch_size)
        exchange = None
        if info is not None and workers > 1:  # the iteration, and what its rows depend on
            # The position is in it: iterations that begin from different positions name
            # their windows' directories apart, also where DataLoader gives their workers the
            # same seed (a loader ``generator`` seeded alike each time).
            seeds = [(info.seed - worker) % 2**62, self._begun, p[_EPOCH], p[_CURSOR], p[_SEED]]
            name = "-".join(
                map(str, [*seeds, self.shuffle, order.lanes, order.window, rank, world])
            )
            exchange = Exchange(self.source, self._token, name, worker, workers)
        share = lane_share(rank, world, order.lanes)
        reader = _RankReader(
            self.source,
            order,
            share,
            threads,
            steps,
            self.global_batch_size,
            exchange,
            worker_process=info is not None,
        )
        try:
            for i in range(worker, len(steps), workers):
                picks = reader.picks(steps[i])
                if self.transform is None:
                    yield self.source.batch(picks)
                else:
                    yield self.transform(self.source.gather(picks))
            reader.finish()
        except GeneratorExit:
            # Left before its end: the loop was left, or the garbage collector finalizes an
            # iterator nobody holds, in whatever thread it runs and under whatever lock that
            # thread holds (threading's own, as a thread starts or ends or the interpreter
            # exits: joining threads there hangs). The readers are told to stop, not joined.
            reader.close(wait=False)
            raise
        except Exception as exc:
            reader.close(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            reader.close()


def _sweep_in(pid: int, token: str) -> None:
    """The stream's windows, removed by the process that made it (not a forked worker)."""
    if os.getpid() == pid:
        sweep(token)


def _ints(values: torch.Tensor) -> list[int]:
    return [int(v) for v in values.tolist()]


def _threads(workers: int) -> int:
    """This process's share of the cores it may run on: over the ranks on this node
    (``LOCAL_WORLD_SIZE``, as torchrun and efdl-run set it) and, in one of a rank's
    ``workers`` DataLoader workers (0: none), over them and the rank's main process. A
    worker's own thread gathers and passes batches, and the main process trains: counting
    it keeps each process's readers to its share of the cores (more contend for them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(8, (cores or 1) // (local * (workers + 1))))


@dataclass(frozen=True)
class _Part:
    """A lane's rows in one unit (row group): shard rows ``[a, b)`` of unit ``unit``, which
    spans shard rows ``[first, end)``; ``readers``: how many of the lanes this process reads
    (the rank's, or a DataLoader worker's group of them) read a part of that unit (2 or more:
    it is decoded once, whole, for all of them)."""

    shard: int
    unit: int
    first: int
    end: int
    a: int
    b: int
    readers: int


class _Units:
    """Units several of this process's lanes read parts of, decoded once: the first lane to
    need one reads it whole, the others take their parts of it; it is dropped when each has.
    Neighbouring lanes run in opposite directions (efdl.data.order), so they need the unit
    they meet in at the same time, and a unit is held for about one unit of progress."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], list[Any]] = {}  # key -> [future, takers left]

    def take(self, part: _Part, read: Callable[[], Any]) -> Any:
        key = (part.shard, part.unit)
        with self._lock:
            held = self._held.get(key)
            first = held is None
            if held is None:
                held = self._held[key] = [Future(), part.readers]
            future: Future[Any] = held[0]
            held[1] -= 1
            if not held[1]:
                del self._held[key]
        if first:
            try:
                future.set_result(read())
            except BaseException as exc:
                future.set_exception(exc)
                raise
        return future.result()


class _Lane:
    """One lane's reader: its part of the stream in reading order (efdl.data.order: even
    lanes forward, odd lanes backward), a window at a time."""

    def __init__(
        self,
        source: Source[Any],
        order: EpochOrder,
        lane: int,
        mine: Sequence[int],
        units: _Units,
    ) -> None:
        self.source, self.order, self.lane, self.units = source, order, lane, units
        self.lock = threading.Lock()
        self._next = -1  # the reading offset the pieces continue at (-1: no read open)
        self._pieces: Iterator[Any] = iter(())
        self._carry: Any = None  # the rest of the last piece
        self._parts = self._split(mine)

    def _split(self, mine: Sequence[int]) -> list[_Part]:
        """The lane's rows as parts of units, in stream order."""
        order = self.order
        lo, hi = order.lane_start(self.lane), _lane_end(order, self.lane)
        spans = [(order.lane_start(lane), _lane_end(order, lane)) for lane in mine]
        parts = []
        for shard, a, b in order.segments(lo, hi):
            base = order.stream_start(shard)
            first = 0
            for unit, n in enumerate(self.source.units(shard)):
                end = first + n
                if end > a and first < b:
                    # this process's lanes that read part of the unit (they are contiguous)
                    u0, u1 = base + first, base + end
                    readers = sum(1 for s0, s1 in spans if s0 < u1 and s1 > u0)
                    parts.append(
                        _Part(shard, unit, first, end, max(a, first), min(b, end), readers)
                    )
                first = end
        return parts

    def _read(self, part: _Part, a: int, b: int) -> Iterator[Any]:
        """Shard rows ``[a, b)`` of ``part``, as pieces in stream order."""
        src, piece = self.source, self.order.window
        if part.readers > 1 and (a, b) == (part.a, part.b) and (a, b) != (part.first, part.end):
            whole = self.units.take(
                part, lambda: _joined(src, src.read(part.shard, part.first, part.end, piece))
            )
            yield src.cut(whole, a - part.first, b - part.first)
        else:
            yield from src.read(part.shard, a, b, piece)

    def _open(self, k: int) -> None:
        """Read on from reading offset ``k`` (a seek: opens the shard at the unit that holds
        it, which is decoded from its start)."""
        start = self.order.lane_start(self.lane)
        if not self.order.backward(self.lane):
            at = start + k  # the stream index of offset k
            todo = [
                (p, max(p.a, at - self._base(p)), p.b)
                for p in self._parts
                if self._base(p) + p.b > at
            ]
            self._pieces = (x for p, a, b in todo for x in self._read(p, a, b))
        else:
            at = start + self.order.lane_length(self.lane) - k  # offsets k.. are indices < at
            todo = [
                (p, p.a, min(p.b, at - self._base(p)))
                for p in reversed(self._parts)
                if self._base(p) + p.a < at
            ]
            self._pieces = (_joined(self.source, self._read(p, a, b)) for p, a, b in todo)
        self._next, self._carry = k, None

    def _base(self, part: _Part) -> int:
        return self.order.stream_start(part.shard)

    def window(self, j: int) -> Any:
        """Window ``j``'s rows, in stream order (a backward lane's window is its reading
        order reversed: the block's index flips it, with no copy)."""
        with self.lock:
            first = j * self.order.window
            size = min(self.order.window, self.order.lane_length(self.lane) - first)
            if first != self._next:
                self._open(first)
            backward = self.order.backward(self.lane)
            src, got, pieces = self.source, 0, []
            while got < size:
                piece = self._carry if self._carry is not None else next(self._pieces)
                self._carry = None
                n = src.length(piece)
                if got + n > size:  # keep the rest: after this (forward), before it (backward)
                    need = size - got
                    if backward:
                        piece, self._carry = (
                            src.cut(piece, n - need, n),
                            src.cut(piece, 0, n - need),
                        )
                    else:
                        piece, self._carry = src.cut(piece, 0, need), src.cut(piece, need, n)
                    n = need
                pieces.append(piece)
                got += n
            self._next = first + size
            if backward:
                pieces.reverse()  # read from the end: each piece came before the last
            return src.join(pieces) if len(pieces) != 1 else pieces[0]


def _lane_end(order: EpochOrder, lane: int) -> int:
    return order.lane_start(lane) + order.lane_length(lane)


def _joined(source: Source[Any], pieces: Iterator[Any]) -> Any:
    got = list(pieces)
    return got[0] if len(got) == 1 else source.join(got)


class _RankReader:
    """This rank's lanes, read ahead in threads: block ``j`` holds window ``j`` of each of
    them (Source.block), each lane's reader thread putting its window in as it decodes it.
    A step's rows of a block are one range of it (rows ``(k - j * window) * lanes + l`` for
    the ``l``-th lane's row ``k``, the order of the epoch's positions).

    In DataLoader worker ``w`` of ``n`` (``exchange``), it reads the ``w``-th group of the
    rank's lanes and takes the others' windows from the workers that read them
    (efdl.data.exchange); each window it reads goes to the workers whose steps take rows of
    its block. Every worker reads its lanes through the iteration's last block, also where
    its own steps end sooner, so no worker waits for a window nobody reads.

    Args:
        steps: the iteration's steps (their cursors); worker ``w`` takes ``w, w + n, ...``.
        n: the global batch.
        worker_process: in a DataLoader worker: blocks keep the windows as read, and a
            step's rows are gathered from them into its batch (Source.block).
    """

    def __init__(
        self,
        source: Source[Any],
        order: EpochOrder,
        share: LaneShare,
        threads: int,
        steps: range,
        n: int,
        exchange: Exchange | None = None,
        worker_process: bool = False,
    ) -> None:
        self.source, self.order, self.share, self.mine = source, order, share, share.lanes
        self.worker_process = worker_process
        self.steps, self.n, self.exchange = steps, n, exchange
        self.worker, self.workers = (exchange.worker, exchange.workers) if exchange else (0, 1)
        count = len(share.lanes)
        # The worker that reads each lane: consecutive groups (neighbours share row groups).
        self.owner = {lane: i * self.workers // count for i, lane in enumerate(share.lanes)}
        own = [lane for lane in share.lanes if self.owner[lane] == self.worker]
        units = _Units()
        self.lanes = {lane: _Lane(source, order, lane, own, units) for lane in own}
        self._theirs = [lane for lane in share.lanes if lane not in self.lanes]
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(threads, len(own))), thread_name_prefix="efdl-stream-reader"
        )
        self._size = order.window * len(self.mine)  # block rows per block
        # Blocks asked for and not yet done with: the block, its own lanes' puts, and the
        # lanes whose windows are still to be taken from other workers.
        self._blocks: dict[int, tuple[Block, list[Future[None]], list[int]]] = {}
        # Blocks whose windows of this worker's lanes go to other workers only.
        self._given: dict[int, list[Future[None]]] = {}
        self._asked = self._span(steps[0])[0] // self._size - 1 if steps else -1
        # Blocks no step uses any more, whose memory may still be shared by batches (the
        # last one of a block lives on in the caller's loop while the next is made).
        self._retired: list[Block] = []
        self._takers: dict[int, set[int]] = {}  # block -> workers whose steps take its rows
        self._scanned = 0  # the steps whose blocks are in _takers
        self._finished = False  # every window others take is given (finish())
        self._closed = False

    def close(self, error: str = "", wait: bool = True) -> None:
        """Stop reading (``error``: why the iteration failed, for the other workers): reads
        not yet begun are dropped. ``wait``: until the reads under way end; else they end by
        themselves, after their window (for a finalizer, which must not wait on threads or
        on locks they hold)."""
        if self._closed:
            return
        self._closed = True
        if self.exchange is not None:  # first: a thread about to give stops
            self.exchange.close(self._finished, error, wait=wait)
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def finish(self) -> None:
        """This worker's steps are done: give its windows of the blocks left to the workers
        that take them (through the iteration's last step's last block)."""
        if self.exchange is None or not self.steps:
            return
        last = (self._span(self.steps[-1])[1] - 1) // self._size  # the last step's last block
        for j in range(self._asked + 1, last + 1):
            self._ask(j)
        self._asked = max(self._asked, last)
        for futures in [*self._given.values(), *(b[1] for b in self._blocks.values())]:
            for future in futures:
                future.result()
        self._finished = True

    def _place(self, block: Block, lane: int, j: int, piece: Any) -> None:
        """Lane ``lane``'s window ``j`` into ``block``."""
        order = self.order.window_order(lane, j)
        if self.order.backward(lane):  # its window is in stream order: flip it
            order = len(order) - 1 - order
        block.put(lane - self.mine.start, piece, order)

    def _put(self, block: Block | None, lane: int, j: int, takers: set[int]) -> None:
        """Read lane ``lane``'s window ``j`` (in a reader thread): give it to the other
        workers among ``takers``, and put it into ``block`` (this worker's, if it takes it)."""
        piece = self.lanes[lane].window(j)
        if self.exchange is not None:
            self.exchange.give(j, lane, piece, takers)
        if block is not None:
            self._place(block, lane, j, piece)

    def _takers_of(self, j: int) -> set[int]:
        """The workers whose steps take rows of block ``j`` (the steps' ranges of block rows
        only grow, so the steps are looked at once, in order)."""
        if self.workers == 1:
            return {0}
        while self._scanned < len(self.steps):
            r0, r1 = self._span(self.steps[self._scanned])
            if r0 >= (j + 1) * self._size:
                break
            for b in range(r0 // self._size, (r1 - 1) // self._size + 1):
                self._takers.setdefault(b, set()).add(self._scanned % self.workers)
            self._scanned += 1
        return self._takers.pop(j, set())

    def _ask(self, j: int) -> None:
        """Start reading block ``j`` (if it has rows, and is not read yet)."""
        if j in self._blocks or j in self._given:
            return
        lanes = [lane for lane in self.mine if j < self.order.windows(lane)]
        if not lanes:
            return
        takers = self._takers_of(j)
        if not takers:  # no step takes its rows (past the iteration's last)
            return
        own = [lane for lane in lanes if lane in self.lanes]
        if self.worker not in takers:
            self._given[j] = [self._pool.submit(self._put, None, lane, j, takers) for lane in own]
            return
        spare = next((b for b in self._retired if b.reusable()), None)
        if spare is not None:
            self._retired.remove(spare)
        block = self.source.block(len(self.mine), self.order.window, spare, self.worker_process)
        puts = [self._pool.submit(self._put, block, lane, j, takers) for lane in own]
        self._blocks[j] = (block, puts, [lane for lane in lanes if lane not in self.lanes])

    def _block(self, j: int) -> Block:
        self._ask(j)
        if j not in self._blocks:
            raise RuntimeError(f"Block {j} was read for other workers only; a step takes it.")
        block, puts, others = self._blocks[j]
        for put in puts:
            put.result()
        while others:
            assert self.exchange is not None  # only other workers read lanes not ours
            lane = others[0]
            self._place(block, lane, j, self.exchange.take(j, lane, self.owner[lane]))
            others.pop(0)
        return block

    def _done_before(self, j: int) -> None:
        """No step takes rows of blocks before ``j`` any more: the last two are kept, to be
        reused once no batch shares their memory, and the windows other workers gave are
        released (Exchange.release). A window this worker failed to give to
        others fails its step (the others would wait for it)."""
        for old in sorted(i for i in self._blocks if i < j):
            block, puts, _ = self._blocks.pop(old)
            if block.reuses and all(p.done() and p.exception() is None for p in puts):
                self._retired = [*self._retired, block][-2:]
            if self.exchange is not None:  # its batches are copies: others' windows are free
                for lane in self._theirs:
                    self.exchange.release(old, lane)
        for old in [i for i, gives in self._given.items() if all(g.done() for g in gives)]:
            for give in self._given.pop(old):
                give.result()

    def _span(self, cursor: int) -> tuple[int, int]:
        """The block rows ``[r0, r1)`` that hold this rank's rows of the global batch from
        ``cursor`` (a block row of the rank's l-th lane's row k: k * width + l, over all
        windows), every ``group``-th of them."""
        order, lanes = self.order, self.order.lanes
        index, group, first = self.share.index, self.share.group, self.mine.start
        width = len(self.mine)  # a block row's lanes
        stop = min(cursor + self.n, order.total)
        rows = []
        for lane in self.mine:
            k0 = (cursor + (lane - cursor) % lanes) // lanes + index
            k1 = (stop - lane + lanes - 1) // lanes
            if k0 < k1:
                last = k0 + (k1 - 1 - k0) // group * group
                rows.append((k0 * width + lane - first, last * width + lane - first))
        if rows:
            return min(r[0] for r in rows), max(r[1] for r in rows) + 1
        if stop < order.total:  # check_world keeps this from happening
            raise RuntimeError(
                f"The step at cursor {cursor} of {order.total} has no row for this rank's "
                f"lanes {list(self.mine)} (turn {index} of {group}); expected a row in every "
                "step but the epoch's last. Please report this."
            )
        # the epoch's last step left this rank nothing: repeat one row
        r0 = (order.lane_length(first) - 1) * width
        return r0, r0 + 1

    def picks(self, cursor: int) -> list[Pick]:
        """This rank's rows of the global batch from ``cursor``: the blocks they are in,
        and their ranges there."""
        r0, r1 = self._span(cursor)
        size, group = self._size, self.share.group
        self._done_before(r0 // size)
        # This step's blocks, then the next one, read ahead (and any before them).
        ahead = (r1 - 1) // size + 1
        for j in range(self._asked + 1, ahead + 1):
            self._ask(j)
        self._asked = max(self._asked, ahead)
        picks: list[Pick] = []
        at = r0
        while at < r1:
            j = at // size
            end = min(r1, (j + 1) * size)
            picks.append((self._block(j), at - j * size, end - j * size, group))
            at += group * -(-(end - at) // group)
        return picks
