"""Blocks: a rank's windows of its lanes, in the order its steps take their rows, and the
batches gathered from them.

A :class:`Block` holds window ``j`` of each of a rank's lanes (efdl.data.stream reads them
in); a step's rows of it are one range (:data:`Pick`). Arrow pieces go into an
:class:`ArrowBlock` (numpy columns a batch may view without a copy) or, in a DataLoader
worker, an :class:`ArrowLanes` (the windows as read, gathered once into the batch); samples
of a reader function go into a :class:`ListBlock`. :func:`gather_table`,
:func:`gather_tensors` and :func:`to_torch` make a step's batch of Arrow rows.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from efdl.errors import DataSourceError

# A step's rows of one block: its rows ``start, start + step, ...`` before ``stop``. A
# source's picks are of the blocks it makes (ArrowPick, ListPick).
Pick = tuple["Block", int, int, int]
ArrowPick = tuple["_ArrowWindows", int, int, int]
ListPick = tuple["ListBlock", int, int, int]


class Block:
    """Window ``j`` of each of a rank's ``lanes`` lanes, its rows in the order the steps take
    them: row ``i * lanes + l`` is the ``l``-th lane's row ``i`` of the window in reading
    order, shuffled (efdl.data.order). The epoch's positions interleave the lanes the same
    way, so a rank's rows of a step are one range of rows of a block (two where the step
    crosses a window's end). Each lane's reader thread puts its window in, right after
    decoding it, while its rows are still in the CPU's cache."""

    def __init__(self, lanes: int, rows: int) -> None:
        self.lanes, self.rows = lanes, rows  # rows: of the longest window

    def put(self, lane: int, piece: Any, order: Any) -> None:
        """The ``lane``-th lane's window ``piece``, its row ``order[i]`` at the lane's row
        ``i`` (``order``: int64 numpy)."""
        raise NotImplementedError

    reuses = False  # whether a later block may take its memory (see reusable)

    def reusable(self) -> bool:
        """Whether no batch still shares this block's memory."""
        return False


class _ArrowWindows(Block):
    """A block of Arrow pieces: the columns its first piece has (every later one must have
    them too), each lane's row count, and its rows of one column as Arrow (:meth:`joined`).
    A step's rows of a column of fixed width come from :meth:`view` (no copy) or
    :meth:`gather`."""

    def __init__(self, lanes: int, rows: int) -> None:
        super().__init__(lanes, rows)
        self._lock = threading.Lock()  # the first put sets the columns, as its piece has
        self.schema: Any = None
        self.counts = [0] * lanes  # each lane's rows
        self._joined: dict[int, tuple[Any, Any]] = {}  # see joined()

    def _columns(self, piece: Any) -> None:
        """Take the first piece's columns (then :meth:`_first`), or check a later one's."""
        with self._lock:
            if self.schema is None:
                self.schema = piece.schema
                self._first(piece)
        if not piece.schema.equals(self.schema, check_metadata=False):
            raise DataSourceError(
                f"Two windows of one step have different columns: {piece.schema} and "
                f"{self.schema}; expected every shard to have the same columns."
            )

    def _first(self, piece: Any) -> None:
        """What the block sets up from its first piece (under the lock)."""

    def joined(self, c: int) -> tuple[Any, Any]:
        """Column ``c``'s rows, lane after lane, as one Arrow array (made once, for the
        steps' takes), and where each lane's rows begin in it."""
        import numpy as np
        import pyarrow as pa

        if c not in self._joined:
            kind = self.schema.field(c).type
            lanes = [self.lane_rows(c, lane) for lane in range(self.lanes)]
            starts = np.cumsum([0] + [len(rows) for rows in lanes])
            chunks = [ch for rows in lanes for ch in rows.chunks]
            self._joined[c] = (pa.chunked_array(chunks, kind).combine_chunks(), starts)
        return self._joined[c]

    def lane_rows(self, c: int, lane: int) -> Any:
        """The ``lane``-th lane's rows of column ``c``, in its order, as an Arrow chunked
        array."""
        raise NotImplementedError

    def view(self, c: int, start: int, stop: int, step: int) -> Any:
        """Column ``c``'s block rows ``start, start + step, ...`` before ``stop`` as a 2-D
        numpy view of the block, or None where it has none."""
        return None

    def gather(self, c: int, start: int, stop: int, step: int, out: Any) -> bool:
        """The same rows copied into the numpy rows ``out`` (False, nothing gathered: the
        block holds some of the column's rows in Arrow)."""
        raise NotImplementedError


class ArrowBlock(_ArrowWindows):
    """Arrow pieces: a 2-D numpy array per column of fixed width (numbers, and lists of one
    length of numbers), in ``spare``'s buffers where they fit and no batch still shares
    them; a batch's rows of it are a view of it where the step's rows are one range (no
    copy). A lane's window whose column has nulls, and columns of other types (strings,
    lists of varying length), keep the lane's rows as an Arrow array, taken in order."""

    reuses = True

    def __init__(self, lanes: int, rows: int, spare: Block | None = None) -> None:
        super().__init__(lanes, rows)
        self._spare = spare if isinstance(spare, ArrowBlock) else None
        self.columns: list[Any] = []  # per column: the rows (numpy), or None
        self.arrow: list[list[Any]] = []  # per column and lane: its rows in Arrow, or None
        self._buffers: list[Any] = []  # what the arrays are views of, for a later reuse
        self._baseline: list[int] = []  # their reference counts with no batch sharing them

    def _first(self, piece: Any) -> None:
        """The columns' arrays, as the first lane's piece has them."""
        import numpy as np

        old: list[Any] = []
        if self._spare is not None:  # take its buffers: only this block refers to them now
            old, self._spare._buffers, self._spare.columns = self._spare._buffers, [], []
            self._spare = None
        n = self.rows * self.lanes
        for c, field in enumerate(piece.schema):
            self.arrow.append([None] * self.lanes)
            kind = _numpy_kind(field.type)
            if kind is None:
                self.columns.append(None)
                self._buffers.append(None)
                continue
            dtype, width = kind
            buffer = old[c] if c < len(old) else None
            if (
                buffer is None
                or buffer.dtype != dtype
                or buffer.shape[1] != width
                or len(buffer) < n
            ):
                buffer = np.empty((n, width), dtype=dtype)
            self.columns.append(buffer[:n])
            self._buffers.append(buffer)
        # Counted here, where nothing but this block refers to the buffers.
        self._baseline = _references(self._buffers)

    def put(self, lane: int, piece: Any, order: Any) -> None:
        import numpy as np

        self._columns(piece)
        # Each row to its place: the piece's row ``order[i]`` to row ``i * lanes + lane``.
        places = np.empty(len(order), dtype=np.int64)
        places[order] = np.arange(len(order), dtype=np.int64) * self.lanes + lane
        for c, col in enumerate(piece.columns):
            column = self.columns[c]
            views = [_rows(chunk) for chunk in col.chunks] if column is not None else []
            if column is None or any(v is None for v in views):
                self.arrow[c][lane] = col.take(order)
                continue
            at = 0
            for view in views:
                column[places[at : at + len(view)]] = view
                at += len(view)
        self.counts[lane] = len(order)

    def lane_rows(self, c: int, lane: int) -> Any:
        import pyarrow as pa

        kind = self.schema.field(c).type
        held = self.arrow[c][lane]
        if held is not None:
            return held
        column = self.columns[c]
        if column is None:  # no window of this lane in the block
            return pa.chunked_array([], kind)
        flat = pa.array(column[lane :: self.lanes][: self.counts[lane]].reshape(-1))
        if pa.types.is_fixed_size_list(kind):
            flat = pa.FixedSizeListArray.from_arrays(flat, type=kind)
        return pa.chunked_array([flat], kind)

    def view(self, c: int, start: int, stop: int, step: int) -> Any:
        rows = self._rows(c, start, stop, step)
        return rows if rows is not None and rows.flags.c_contiguous else None

    def gather(self, c: int, start: int, stop: int, step: int, out: Any) -> bool:
        rows = self._rows(c, start, stop, step)
        if rows is None:
            return False
        out[...] = rows
        return True

    def _rows(self, c: int, start: int, stop: int, step: int) -> Any:
        column = self.columns[c]
        if column is None or any(a is not None for a in self.arrow[c]):
            return None
        return column[start:stop:step]

    def reusable(self) -> bool:
        now = _references(self._buffers)
        return all(n <= base for n, base in zip(now, self._baseline, strict=True))


class ArrowLanes(_ArrowWindows):
    """Arrow pieces kept as the lanes' windows, not copied into a block: a DataLoader
    worker's. Its batch is copied once anyway (into shared memory, to reach the main
    process), so a step's rows are gathered from the windows straight into the batch
    (:func:`gather_tensors`): one copy, as a reader that does not shuffle makes."""

    def __init__(self, lanes: int, rows: int) -> None:
        super().__init__(lanes, rows)
        self.pieces: list[Any] = [None] * lanes
        self.orders: list[Any] = [None] * lanes
        # Per lane and column: where the piece's chunks start, and each chunk's rows as
        # numpy (None: the column is not of fixed width, or has nulls, in this window).
        self.views: list[list[tuple[Any, list[Any]] | None]] = [[] for _ in range(lanes)]

    def put(self, lane: int, piece: Any, order: Any) -> None:
        import numpy as np

        self._columns(piece)
        views: list[tuple[Any, list[Any]] | None] = []
        for c, field in enumerate(piece.schema):
            chunks = piece.column(c).chunks
            rows = [_rows(chunk) for chunk in chunks] if _numpy_kind(field.type) else [None]
            if chunks and all(r is not None for r in rows):
                views.append((np.cumsum([0, *(len(chunk) for chunk in chunks)]), rows))
            else:
                views.append(None)
        self.pieces[lane], self.orders[lane], self.counts[lane] = piece, order, len(order)
        self.views[lane] = views

    def lane_rows(self, c: int, lane: int) -> Any:
        import pyarrow as pa

        if self.pieces[lane] is None:  # no window of this lane in the block
            return pa.chunked_array([], self.schema.field(c).type)
        return self.pieces[lane].column(c).take(self.orders[lane])

    def gather(self, c: int, start: int, stop: int, step: int, out: Any) -> bool:
        import numpy as np

        todo = []
        for lane, where, rows in self._shares(start, stop, step):
            held = self.views[lane][c]
            if held is None:
                return False
            todo.append((where, self.orders[lane][rows], held))
        for where, src, (starts, chunks) in todo:
            if len(chunks) == 1:
                out[where] = chunks[0][src]
                continue
            which = np.searchsorted(starts, src, side="right") - 1
            dst = out[where] if isinstance(where, slice) else None  # a view: write through it
            for k, chunk in enumerate(chunks):
                mine = which == k
                if mine.any():
                    part = chunk[src[mine] - starts[k]]
                    if dst is None:
                        out[where[mine]] = part
                    else:
                        dst[mine] = part
        return True

    def _shares(self, start: int, stop: int, step: int) -> list[tuple[int, Any, Any]]:
        """Each lane's part of the block rows ``start, start + step, ...`` before ``stop``
        (block row ``i * lanes + l`` is lane ``l``'s row ``i``): the lane, where its rows go
        among them, and which of its rows (slices where they are evenly spaced: one lane,
        or consecutive rows)."""
        import numpy as np

        lanes = self.lanes
        if lanes == 1:
            return [(0, slice(None), slice(start, stop, step))]
        if step == 1:
            shares = []
            for lane in range(lanes):
                first = start + (lane - start) % lanes
                if first < stop:
                    rows = slice(first // lanes, (stop - 1 - lane) // lanes + 1)
                    shares.append((lane, slice(first - start, None, lanes), rows))
            return shares
        at = np.arange(start, stop, step)
        lane_of, row = at % lanes, at // lanes
        picked = [(lane, np.flatnonzero(lane_of == lane)) for lane in range(lanes)]
        return [(lane, where, row[where]) for lane, where in picked if len(where)]


class ListBlock(Block):
    """A block of samples (see :class:`Block`): a list."""

    def __init__(self, lanes: int, rows: int) -> None:
        super().__init__(lanes, rows)
        self.samples: list[Any] = [None] * (rows * lanes)

    def put(self, lane: int, piece: Any, order: Any) -> None:
        n = len(order)  # each lane its own rows of the list
        self.samples[lane : lane + n * self.lanes : self.lanes] = [piece[i] for i in order.tolist()]


def _references(buffers: list[Any]) -> list[int]:
    """Each buffer's reference count (0 for None), counted the same way at every call, so
    that two calls' counts compare: a batch that shares a buffer adds one."""
    return [0 if b is None else sys.getrefcount(b) for b in buffers]


def _numpy_kind(kind: Any) -> tuple[Any, int] | None:
    """(numpy dtype, values per row) of an Arrow type of fixed width, or None."""
    import pyarrow.types as pt

    if pt.is_integer(kind) or pt.is_floating(kind):
        return kind.to_pandas_dtype(), 1
    if pt.is_fixed_size_list(kind) and (
        pt.is_integer(kind.value_type) or pt.is_floating(kind.value_type)
    ):
        return kind.value_type.to_pandas_dtype(), kind.list_size
    return None


def gather_table(picks: list[ArrowPick]) -> Any:
    """The picks' rows in one table."""
    import pyarrow as pa

    schema = picks[0][0].schema
    columns = []
    for c, field in enumerate(schema):
        rows = _numpy_rows(picks, c)
        if rows is None:
            columns.append(_arrow_rows(picks, c))
            continue
        flat = pa.array(rows.reshape(-1))
        if pa.types.is_fixed_size_list(field.type):
            flat = pa.FixedSizeListArray.from_arrays(flat, type=field.type)
        columns.append(flat)
    return pa.Table.from_arrays(columns, schema=schema)


def gather_tensors(picks: list[ArrowPick]) -> dict[str, Any]:
    """:func:`gather_table`'s rows as :func:`to_torch` gives them, the fixed-width columns'
    tensors made straight from the block's rows (no Arrow in between). In a DataLoader
    worker, rows not in one view are gathered into shared memory, where DataLoader's own
    collate puts a worker's batch (no copy on the way to the main process)."""
    import pyarrow as pa
    import torch
    from torch.utils.data import get_worker_info

    schema = picks[0][0].schema
    make = _shared_rows if get_worker_info() is not None else None
    out: dict[str, Any] = {}
    for c, field in enumerate(schema):
        rows = _numpy_rows(picks, c, make)
        if rows is None:
            out.update(to_torch(pa.table({field.name: _arrow_rows(picks, c)})))
            continue
        if not isinstance(rows, torch.Tensor):  # else gathered into shared memory
            rows = torch.from_numpy(rows)
        out[field.name] = rows if pa.types.is_fixed_size_list(field.type) else rows.reshape(-1)
    return out


def _shared_rows(rows: int, kind: tuple[Any, int]) -> tuple[Any, Any]:
    """A tensor of ``rows`` rows of ``kind`` (dtype, width) in shared memory, as DataLoader's
    workers make their batches (no copy on the way to the main process), and its numpy."""
    import numpy as np
    import torch

    dtype = torch.from_numpy(np.empty(0, kind[0])).dtype
    storage = torch.UntypedStorage._new_shared(rows * kind[1] * dtype.itemsize)  # type: ignore[no-untyped-call]
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, (rows, kind[1]), (kind[1], 1))
    return tensor, tensor.numpy()


def _numpy_rows(
    picks: list[ArrowPick], c: int, make: Callable[[int, tuple[Any, int]], Any] | None = None
) -> Any:
    """Column ``c``'s rows of the picks as 2-D numpy: a view of the block where it has one
    (the block is then not reused while the view lives), else gathered into what
    ``make(rows, kind)`` makes (the result, and its numpy rows), or into a new array. None:
    a block holds some of the column's rows in Arrow, or the column is not of fixed width."""
    import numpy as np

    kind = _numpy_kind(picks[0][0].schema.field(c).type)
    if kind is None:
        return None
    if len(picks) == 1:
        view = picks[0][0].view(c, *picks[0][1:])
        if view is not None:
            return view
    rows = sum(len(range(start, stop, step)) for _, start, stop, step in picks)
    if make is None:
        result = out = np.empty((rows, kind[1]), kind[0])
    else:
        result, out = make(rows, kind)
    at = 0
    for block, start, stop, step in picks:
        n = len(range(start, stop, step))
        if not block.gather(c, start, stop, step, out[at : at + n]):
            return None
        at += n
    return result


def _arrow_rows(picks: list[ArrowPick], c: int) -> Any:
    """Column ``c``'s rows of the picks as one Arrow array."""
    import numpy as np
    import pyarrow as pa

    kind = picks[0][0].schema.field(c).type
    chunks = []
    for block, start, stop, step in picks:
        joined, starts = block.joined(c)
        at = np.arange(start, stop, step)  # row i * lanes + l is lane l's row i
        chunks.append(joined.take(starts[at % block.lanes] + at // block.lanes))
    return pa.chunked_array(chunks, kind)


def _rows(chunk: Any) -> Any:
    """A fixed-width chunk's rows as a 2-D numpy view (no copy), or None if it has none."""
    import pyarrow.types as pt

    if chunk.null_count:
        return None
    kind = chunk.type
    if pt.is_integer(kind) or pt.is_floating(kind):
        return chunk.to_numpy().reshape(-1, 1)
    if pt.is_fixed_size_list(kind) and (
        pt.is_integer(kind.value_type) or pt.is_floating(kind.value_type)
    ):
        values = chunk.flatten()  # the chunk's own rows (flatten minds its offset)
        if values.null_count:
            return None
        return values.to_numpy().reshape(-1, kind.list_size)
    return None


def to_torch(table: Any) -> dict[str, Any]:
    """A pyarrow Table as a dict: numeric and boolean columns as tensors (copies of the
    rows, which the tensors own), lists of numbers of one length as 2-D tensors, anything
    else as a Python list."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.types as pt
    import torch

    def tensor(values: Any) -> Any:
        return torch.from_numpy(values.to_numpy(zero_copy_only=False, writable=True))

    out: dict[str, Any] = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        kind = arr.type
        if (
            pt.is_integer(kind) or pt.is_floating(kind) or pt.is_boolean(kind)
        ) and not arr.null_count:
            out[name] = tensor(arr)
            continue
        if (pt.is_list(kind) or pt.is_large_list(kind) or pt.is_fixed_size_list(kind)) and (
            pt.is_integer(kind.value_type) or pt.is_floating(kind.value_type)
        ):
            lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
            if len(lengths) and not arr.null_count and (lengths == lengths[0]).all():
                flat = tensor(pc.list_flatten(arr))
                out[name] = flat.reshape(len(arr), int(lengths[0]))
                continue
        out[name] = arr.to_pylist()
    return out
