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
rank decodes each window once; efdl.data.lanes reads them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from efdl.data.exchange import Exchange, sweep, token
from efdl.data.lanes import RankReader
from efdl.data.order import EpochOrder, check_world, lane_share
from efdl.data.parquet import ParquetSource
from efdl.data.shards import Source
from efdl.errors import DataSourceError

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
        reader = RankReader(
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
