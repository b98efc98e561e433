"""The order of an epoch over shards, and each rank's share of a step (pure).

The samples are the rows of shards (Parquet files, say), ``rows[i]`` in shard ``i``. An
epoch's order is a function of (seed, epoch) and two settings that must not change during a
job, ``lanes`` and ``window``:

1. The shards are shuffled, and their rows laid end to end (the stream).
2. The stream is cut into ``lanes`` contiguous lanes of nearly equal length (they differ by
   at most one row); a lane may begin or end inside a shard.
3. A lane is read from its first row to its last if its number is even, from its last to its
   first if odd (so two neighbouring lanes reach the rows where they meet at the same time,
   both at their start or both at their end, and a reader can decode the row group they share
   once for both). In that reading order, rows are shuffled in consecutive windows of
   ``window`` rows: the lane's row ``k`` is one of its rows ``window * (k // window)`` to
   ``window * (k // window + 1) - 1`` in reading order (a row moves less than ``window``
   places in its lane; rows of two windows keep their order).
4. The epoch interleaves the lanes: position ``p`` is row ``p // lanes`` of lane
   ``p % lanes``.

A step's global batch is the next N positions from the cursor (the samples committed steps
consumed), whatever N is. Rank ``r`` of ``world`` takes the positions of its lanes (lanes
``l`` with ``l * world // lanes == r``: contiguous, and the same lanes at every step), so it
reads only its lanes' part of the stream, in stream order, window by window. After a rescale,
the rest of the epoch is split the same way over the new world: every row of the epoch is
trained once, whatever the world did. What that costs: when ``world`` does not divide
``lanes`` the ranks' shares of a step differ by up to N / lanes rows (MosaicML streaming's
"canonical nodes" make the same trade), and a world larger than ``lanes`` has ranks share a
lane (each reads all of it, and takes its turn of the lane's rows).

Every rank gets a row of every step but the epoch's last exactly when ``world <= lanes * (N
// lanes)`` (:func:`check_world`): a step gives each lane ``N // lanes`` rows or one more,
and a rank takes rows of its own lanes only, so each of a lane's ranks needs one of them.
Past that bound some lane has more ranks than ``N // lanes``, and a step that gives it only
``N // lanes`` rows (with a fixed N, every lane gets such a step within ``lanes / gcd(N,
lanes)`` steps) leaves one of its ranks without a row; the stream refuses such a world
rather than repeat a row or give a rank an empty step.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from efdl.errors import EfdlError

_MASK = (1 << 63) - 1


class StreamShareError(EfdlError, ValueError):
    """A world the stream cannot split every step over without a rank going short: more
    ranks than the global batch, or than its lanes can give a row each (:func:`check_world`)."""


def _mix(*parts: int) -> int:
    """A seed from ``parts`` (splitmix64 steps): the same in every process, unlike hash()."""
    x = 0x9E3779B97F4A7C15
    for part in parts:
        x = (x ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & _MASK


@functools.lru_cache(maxsize=256)  # a reader walks a window's rows one by one
def _permutation(n: int, seed: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """A permutation of ``range(n)`` from ``seed`` (read-only: it is cached and shared)."""
    out = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class EpochOrder:
    """Epoch ``epoch``'s order over shards of ``rows`` rows each (see the module docstring).

    Raises:
        ValueError: no rows, a negative count, or ``lanes``/``window`` below 1.
    """

    rows: Sequence[int]
    seed: int
    epoch: int
    lanes: int
    window: int
    shuffle: bool = True  # False: shards in their given order, rows in stream order
    _shards: tuple[int, ...] = field(init=False, repr=False)  # the shuffled shard order
    _starts: list[int] = field(init=False, repr=False)  # stream index of each one's first row
    _place: list[int] = field(init=False, repr=False)  # each shard's place in the order

    def __post_init__(self) -> None:
        if any(r < 0 for r in self.rows) or not sum(self.rows):
            raise ValueError(
                f"The shards' row counts must be >= 0, with some rows (got {list(self.rows[:8])})."
            )
        if self.lanes < 1 or self.window < 1:
            raise ValueError(f"lanes ({self.lanes}) and window ({self.window}) must be >= 1.")
        shards = (
            tuple(_permutation(len(self.rows), _mix(self.seed, self.epoch)).tolist())
            if self.shuffle
            else tuple(range(len(self.rows)))
        )
        starts = list(itertools.accumulate((self.rows[s] for s in shards), initial=0))
        object.__setattr__(self, "_shards", shards)
        object.__setattr__(self, "_starts", starts)
        place = [0] * len(shards)
        for i, shard in enumerate(shards):
            place[shard] = i
        object.__setattr__(self, "_place", place)

    @property
    def total(self) -> int:
        """Rows in the epoch."""
        return self._starts[-1]

    def lane_length(self, lane: int) -> int:
        base, extra = divmod(self.total, self.lanes)
        return base + (lane < extra)

    def lane_start(self, lane: int) -> int:
        """The stream index of ``lane``'s first row."""
        base, extra = divmod(self.total, self.lanes)
        return lane * base + min(lane, extra)

    def windows(self, lane: int) -> int:
        """How many windows ``lane`` has (its last one may be short)."""
        return -(-self.lane_length(lane) // self.window)

    def window_order(self, lane: int, j: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """``lane``'s window ``j`` as offsets from its first row: the lane's row
        ``j * window + i`` is the window's row ``window_order(lane, j)[i]``."""
        first = j * self.window
        size = min(self.window, self.lane_length(lane) - first)
        if size <= 0:
            raise IndexError(f"lane {lane} has {self.windows(lane)} windows, not a window {j}.")
        if not self.shuffle:
            return np.arange(size, dtype=np.int64)
        return _permutation(size, _mix(self.seed, self.epoch, lane, first))

    @staticmethod
    def backward(lane: int) -> bool:
        """Whether ``lane`` is read from its last row to its first (odd lanes)."""
        return lane % 2 == 1

    def lane_index(self, lane: int, offset: int) -> int:
        """The stream index of the row ``offset`` places into ``lane``'s reading order."""
        if self.backward(lane):
            offset = self.lane_length(lane) - 1 - offset
        return self.lane_start(lane) + offset

    def lane_row(self, lane: int, k: int) -> int:
        """The stream index of ``lane``'s row ``k`` (its window shuffled)."""
        length = self.lane_length(lane)
        if not 0 <= k < length:
            raise IndexError(f"lane {lane} has {length} rows, not a row {k}.")
        first = k - k % self.window
        return self.lane_index(
            lane, first + int(self.window_order(lane, k // self.window)[k - first])
        )

    def segments(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Stream indices ``[start, stop)`` as (shard, first row, end row) pieces, in order."""
        out = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            end = min(stop, self._starts[i + 1])
            if end > start:
                out.append((self._shards[i], start - self._starts[i], end - self._starts[i]))
            start, i = end, i + 1
        return out

    def stream_start(self, shard: int) -> int:
        """The stream index of shard ``shard``'s first row."""
        return self._starts[self._place[shard]]

    def locate(self, stream_index: int) -> tuple[int, int]:
        """(shard, row in it) of a stream index."""
        i = bisect.bisect_right(self._starts, stream_index) - 1
        return self._shards[i], stream_index - self._starts[i]

    def at(self, position: int) -> tuple[int, int]:
        """(shard, row) at epoch position ``position``."""
        return self.locate(self.lane_row(position % self.lanes, position // self.lanes))


@dataclass(frozen=True)
class LaneShare:
    """What one rank reads: its ``lanes``, and, where ranks outnumber lanes, which of the
    ``group`` ranks sharing its one lane it is (``index``): it takes every ``group``-th of
    the lane's rows in each step, from the ``index``-th."""

    lanes: range
    index: int = 0
    group: int = 1


def lane_share(rank: int, world: int, lanes: int) -> LaneShare:
    """Rank ``rank`` of ``world``'s part of the ``lanes`` lanes.

    Up to ``lanes`` ranks: the contiguous lanes ``l`` with ``l * world // lanes == rank``, read
    by this rank alone. More ranks than lanes: rank ``r`` reads lane ``r * lanes // world``
    with the other ranks of that lane, each taking its turn of the lane's rows of a step (each
    of them reads the whole lane: a larger world costs reads, not correctness).

    Raises:
        ValueError: a rank outside the world.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}.")
    if world <= lanes:
        return LaneShare(range(-(-rank * lanes // world), -(-(rank + 1) * lanes // world)))
    lane = rank * lanes // world
    first, end = -(-lane * world // lanes), -(-(lane + 1) * world // lanes)
    return LaneShare(range(lane, lane + 1), rank - first, end - first)


def share(order: EpochOrder, cursor: int, n: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s positions of the global batch ``[cursor, cursor + n)`` (cut at the
    epoch's end), in position order."""
    mine = lane_share(rank, world, order.lanes)
    stop = min(cursor + n, order.total)
    out: list[int] = []
    for lane in mine.lanes:
        first = cursor + (lane - cursor) % order.lanes  # the lane's first position from cursor
        out.extend(range(first, stop, order.lanes)[mine.index :: mine.group])
    return sorted(out)


def most_ranks(lanes: int, n: int) -> int:
    """The largest world whose every rank gets a row of every step of ``n`` rows over
    ``lanes`` lanes (but the epoch's last): each lane gives a step ``n // lanes`` rows at
    least, one per rank reading it."""
    return lanes * (n // lanes)


def check_world(world: int, lanes: int, n: int) -> None:
    """Refuse a world that some step of ``n`` rows over ``lanes`` lanes would leave a rank
    without a row of, before the epoch's last step (see the module docstring).

    Raises:
        StreamShareError: ``world`` is above :func:`most_ranks`, with what would fit.
    """
    most = most_ranks(lanes, n)
    if world <= most:
        return
    if world > n:
        raise StreamShareError(
            f"A world of {world} ranks is larger than the global batch ({n}): every rank "
            f"needs a row of every step. Expected a global batch of at least "
            f"{lanes * -(-world // lanes)} (a multiple of lanes, {lanes}) or at most {most} "
            "ranks."
        )
    need = lanes * -(-world // lanes)
    raise StreamShareError(
        f"A world of {world} ranks cannot share steps of {n} rows (the global batch) over "
        f"{lanes} lanes without a rank going short: some steps give a lane only "
        f"{n // lanes} row(s) ({n} // {lanes}), and up to {-(-world // lanes)} ranks share a "
        f"lane, each reading its own lane only. Expected at most {most} ranks, a global "
        f"batch of at least {need} (lanes x ceil(world / lanes)), or lanes from {world} to "
        f"the batch (lanes change at an epoch's start)."
    )
