"""Reading a rank's lanes: :class:`RankReader` reads them ahead in threads, a window of each
lane at a time, into the blocks its steps take their rows from (efdl.data.blocks).

Each lane is read in its own order (efdl.data.order: even lanes forward, odd lanes backward),
a unit (a Parquet row group) that several of the process's lanes read is decoded once for
all of them, and in a DataLoader worker the rank's lanes are divided between its workers,
who give each other the windows they decode (efdl.data.exchange).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from efdl.data.blocks import Block, Pick
from efdl.data.exchange import Exchange
from efdl.data.order import EpochOrder, LaneShare
from efdl.data.shards import Source


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


class RankReader:
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
