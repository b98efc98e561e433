"""Where a stream's rows come from: shards, their row counts, and reads from a row onward.

A :class:`Source` names its shards, counts their rows, and reads a shard's rows ``[start,
stop)`` as pieces; it also owns the pieces' type (how to measure, cut, join and reorder
them), so the stream (efdl.data.stream) never looks inside a row. Two kinds:

- :class:`ParquetSource`: Parquet files at local paths or any fsspec URL (``s3://``...).
  Row counts come from the files' footers; a read opens the file, reads only the row groups
  that hold the rows asked for (only the columns asked for), and counts the bytes it read.
- :class:`ReaderSource`: any format, through a function ``read(shard, start)`` that yields
  the shard's samples from row ``start`` on (WebDataset tars, JSON lines, ...).
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar, cast

import fsspec  # type: ignore[import-untyped]
from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]

from efdl.errors import EfdlError

C = TypeVar("C")  # a source's piece of rows: a pyarrow Table, or a list of samples


class DataSourceError(EfdlError, ValueError):
    """A shard that cannot be read as the stream needs it (missing, not Parquet, a column
    it lacks, columns unlike the other shards', fewer rows than counted)."""


class Source(Generic[C]):
    """Shards of rows, and the operations on a piece of them."""

    def names(self) -> Sequence[str]:
        """The shards, in their given order (for messages and checks)."""
        raise NotImplementedError

    def rows(self) -> list[int]:
        """Each shard's row count."""
        raise NotImplementedError

    def read(self, shard: int, start: int, stop: int, piece: int) -> Iterator[C]:
        """Rows ``[start, stop)`` of shard ``shard``, in order, as pieces of about ``piece``
        rows (the reader reads ahead of what it was asked for by about one piece)."""
        raise NotImplementedError

    def bytes_read(self) -> int:
        """Bytes this process has read from storage through this source (0: not counted)."""
        return 0

    def units(self, shard: int) -> list[int]:
        """The row counts of the shard's units, the pieces it is decoded in (Parquet: its
        row groups; otherwise the whole shard). A reader that needs a row decodes its unit
        from the unit's start."""
        return [self.rows()[shard]]

    # The pieces: Arrow tables by default (lists in ReaderSource).
    def length(self, piece: C) -> int:
        return len(piece)  # type: ignore[arg-type]

    def cut(self, piece: C, start: int, stop: int) -> C:
        return piece.slice(start, stop - start)  # type: ignore[attr-defined, no-any-return]

    def join(self, pieces: list[C]) -> C:
        import pyarrow as pa

        return pa.concat_tables(pieces)  # type: ignore[no-any-return]

    def dump(self, piece: C, room: Callable[[int], Any]) -> None:
        """Write ``piece`` into ``room(n)`` (a writable buffer of at least ``n`` bytes, ``n``
        the piece's size), for :meth:`load` in another process."""
        import pyarrow as pa

        table: Any = piece
        size = pa.MockOutputStream()
        with pa.ipc.new_stream(size, table.schema) as out:
            out.write_table(table)
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(room(size.size())))
        with pa.ipc.new_stream(sink, table.schema) as out:
            out.write_table(table)

    def load(self, buffer: Any) -> C:
        """The piece :meth:`dump` wrote into ``buffer`` (which may go on past it); Arrow's
        rows are read in place, not copied, and keep the buffer alive."""
        import pyarrow as pa

        return pa.ipc.open_stream(pa.py_buffer(buffer)).read_all()  # type: ignore[no-any-return]

    def block(self, lanes: int, rows: int, spare: Any = None, worker: bool = False) -> Block:
        """An empty block for a window of up to ``rows`` rows of each of ``lanes`` lanes (see
        :class:`Block`); ``spare``: a block no step uses, whose buffers may be reused;
        ``worker``: for a DataLoader worker, whose batches are copied to the main process."""
        return ArrowLanes(lanes, rows) if worker else ArrowBlock(lanes, rows, spare)

    def gather(self, picks: list[Pick]) -> C:
        """One piece of the picks' rows, pick after pick."""
        return gather_table(cast("list[ArrowPick]", picks))  # type: ignore[no-any-return]

    def batch(self, picks: list[Pick]) -> Any:
        """The rows of the picks as a batch, where the stream has no transform of the
        user's. Arrow: a dict of tensors per column, as :func:`to_torch` makes them."""
        return gather_tensors(cast("list[ArrowPick]", picks))


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


class _Counted:
    """A file object that counts the bytes read through it (into its source's counter)."""

    def __init__(self, f: Any, count: Callable[[int], None]) -> None:
        self._f, self._count = f, count
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        self._count(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._f.seek(offset, whence))

    def tell(self) -> int:
        return int(self._f.tell())

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self._f.close()

    @property
    def size(self) -> int:
        return int(self._f.size)


class ParquetSource(Source[Any]):
    """Parquet files (paths or fsspec URLs; a directory or glob expands to its ``.parquet``
    files, sorted), read by row group.

    Args:
        urls: the files, or one directory or glob.
        columns: the columns to read (None: all).
        storage_options: passed to fsspec (``{"endpoint_url": ...}`` for an S3 stand-in).
        rows: each file's row count, if known (skips reading every footer at the start).

    Raises:
        DataSourceError: no files, or (at ``rows()``, which reads the footers) a file that is
            not Parquet, or whose columns (those read) differ from an earlier file's in name,
            order, type or nullability (found at its first read where ``rows`` was given).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        rows: Sequence[int] | None = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.columns = list(columns) if columns is not None else None
        self._urls = expand(urls, self.storage_options)
        if rows is not None and len(rows) != len(self._urls):
            raise DataSourceError(
                f"rows has {len(rows)} counts for {len(self._urls)} Parquet files; expected one "
                "count per file, in the files' order."
            )
        self._rows = list(rows) if rows is not None else None
        self._footers: dict[int, Any] = {}  # each shard's metadata, once read (no re-read)
        self._fields: dict[int, list[Any]] = {}  # each shard's columns read, from its footer
        # The columns every shard must have alike: the first shard's with rows (of those
        # checked: every one at rows(), else in the order they are first read).
        self._columns: tuple[int, list[Any]] | None = None
        # Each shard's details (size, ETag) where fsspec's buffered files fetch them: from the
        # first open, then given to the others (s3fs sent a HEAD request per open).
        self._details: dict[int, dict[str, Any]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers get a copy, lock aside
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def names(self) -> Sequence[str]:
        return self._urls

    def rows(self) -> list[int]:
        if self._rows is None:
            with ThreadPoolExecutor(max_workers=min(32, len(self._urls))) as pool:
                metas = list(pool.map(self._footer, range(len(self._urls))))
            rows = [sum(groups) for groups in metas]
            for shard, n in enumerate(rows):  # in order: the first file with rows is the model
                fields = self._fields.pop(shard, None)
                if n and fields is not None:
                    self._alike(shard, fields)
            self._rows = rows
        return self._rows

    def bytes_read(self) -> int:
        return self._bytes

    def units(self, shard: int) -> list[int]:
        meta = self._footers.get(shard)
        if meta is None:
            return self._footer(shard)
        return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    def _count(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    def _open(self, shard: int, check: bool = True) -> Any:
        """The shard as a ParquetFile (``check``: its columns must be the other shards')."""
        import pyarrow.parquet as pq

        url = self._urls[shard]
        try:
            fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
            # No read-ahead cache: pyarrow asks for the byte ranges it needs (coalesced, see
            # below), and s3fs's default read-ahead fetched up to 50 MB beyond each.
            f = self._open_file(fs, path, shard)
        except (OSError, ValueError) as exc:
            raise DataSourceError(f"Cannot open the Parquet file {url!r}: {exc}") from exc
        try:
            # Read a row group at a time (see read), its column chunks in one coalesced
            # request each (pre-buffering: few, large reads, as object stores want).
            pf = pq.ParquetFile(
                _Counted(f, self._count), metadata=self._footers.get(shard), pre_buffer=True
            )
        except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) and others
            f.close()
            raise DataSourceError(
                f"{url!r} is not a Parquet file pyarrow can read ({exc}); expected Parquet."
            ) from exc
        missing = [c for c in self.columns or () if c not in pf.schema_arrow.names]
        if missing:  # pyarrow would leave them out without a word
            pf.close()
            raise DataSourceError(
                f"{url!r} has no column {missing[0]!r}; its columns are {pf.schema_arrow.names}."
            )
        if check:
            try:
                self._alike(shard, self._read_fields(pf.schema_arrow))
            except DataSourceError:
                pf.close()
                raise
        return pf

    def _read_fields(self, schema: Any) -> list[Any]:
        """The Arrow fields a read of a file of ``schema`` gives, in their order."""
        if self.columns is None:
            return list(schema)
        return [schema.field(name) for name in self.columns]

    def _alike(self, shard: int, fields: list[Any]) -> None:
        """Refuse a shard whose columns (those read) are not the model's: a window that
        spans two shards joins their rows, which pyarrow refuses mid-epoch naming no file."""
        with self._lock:
            if self._columns is None:
                self._columns = (shard, fields)
                return
            model, expected = self._columns
        if shard == model:
            return
        why = _unlike(self._urls[model], expected, self._urls[shard], fields)
        if why:
            raise DataSourceError(
                f"The Parquet files' columns differ: {why}. Expected every file to have the "
                "same columns, in the same order, of the same types (give columns= to read "
                "only columns they share alike)."
            )

    def _open_file(self, fs: Any, path: str, shard: int) -> Any:
        """The shard's file, opened with the details its first open fetched, if any."""
        known = self._details.get(shard)
        if known is None:
            f = fs.open(path, "rb", cache_type="none")
            if isinstance(f, AbstractBufferedFile):
                self._details[shard] = f.details
            return f
        try:
            f = fs.open(path, "rb", cache_type="none", size=known["size"])
        except TypeError:  # a file system whose files take no size
            f = fs.open(path, "rb", cache_type="none")
        f.details = known
        return f

    def _footer(self, shard: int) -> list[int]:
        pf = self._open(shard, check=False)  # rows() checks the columns, in shard order
        try:
            groups = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            fields = self._read_fields(pf.schema_arrow)
            with self._lock:
                self._footers[shard] = pf.metadata
                self._fields[shard] = fields
        finally:
            pf.close()
        return groups

    def read(self, shard: int, start: int, stop: int, piece: int) -> Iterator[Any]:
        pf = self._open(shard)
        try:
            groups = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            first, skip, wanted = 0, start, []
            for g, n in enumerate(groups):  # the row groups that hold [start, stop)
                if first + n > start and first < stop:
                    wanted.append(g)
                elif first + n <= start:
                    skip -= n
                first += n
            if first < stop:
                raise DataSourceError(
                    f"{self._urls[shard]!r} has {first} rows; the stream counted at least "
                    f"{stop} (was it rewritten during the job?)."
                )
            left = stop - start
            # One row group per call: given several, pyarrow pre-buffers them all at once.
            batches = (
                batch
                for g in wanted
                for batch in pf.iter_batches(piece, [g], self.columns, use_threads=False)
            )
            for batch in batches:
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                part = batch.slice(skip, left)
                skip, left = 0, left - part.num_rows
                yield _table(part)
                if not left:
                    return
        finally:
            pf.close()


def _unlike(first: str, a: list[Any], other: str, b: list[Any]) -> str:
    """How the columns ``b`` of the file ``other`` differ from ``a``, those of ``first``
    ("" where they are alike): a column one lacks, their order, or a column's type."""
    names_a, names_b = [f.name for f in a], [f.name for f in b]
    for name in names_a:
        if name not in names_b:
            return f"{other!r} has no column {name!r}, which {first!r} has"
    for name in names_b:
        if name not in names_a:
            return f"{other!r} has a column {name!r}, which {first!r} has not"
    if names_a != names_b:
        return f"{first!r} has the columns {names_a}, {other!r} has them as {names_b}"
    for fa, fb in zip(a, b, strict=True):
        if not fa.type.equals(fb.type) or fa.nullable != fb.nullable:
            return (
                f"{first!r} has the column {fa.name!r} as {_kind(fa)}, {other!r} has it as "
                f"{_kind(fb)}"
            )
    return ""


def _kind(field: Any) -> str:
    return f"{field.type}" + ("" if field.nullable else " not null")


class _DataOnly(pickle.Unpickler):
    """Unpickles only what a pickle's own opcodes build (dicts, lists, tuples, sets, strings,
    bytes, numbers, booleans, None): a class or function it names is refused, so that no
    code of the pickle's choosing runs (reductions need one)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"The window names {module}.{name}; expected plain data only (dicts, lists, "
            "strings, bytes, numbers): nothing that runs code when loaded."
        )


class _View:
    """A buffer read as a file, without a copy of the whole (for an Unpickler)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._at = view, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(len(self._view), self._at + n)
        out = bytes(self._view[self._at : end])
        self._at = end
        return out

    def readinto(self, into: Any) -> int:
        target = memoryview(into).cast("B")
        n = min(len(target), len(self._view) - self._at)
        target[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def readline(self) -> bytes:
        end = bytes(self._view[self._at :]).find(b"\n")  # (protocol 0 only)
        return self.read(-1 if end < 0 else end + 1)


def load_data(buffer: Any) -> Any:
    """What ``pickle.dumps`` made of plain data (see :class:`_DataOnly`), from ``buffer``
    (what follows the pickle is ignored), running no code.

    Raises:
        DataSourceError: the pickle names a class or function.
    """
    try:
        return _DataOnly(_View(memoryview(buffer).cast("B"))).load()
    except pickle.UnpicklingError as exc:
        raise DataSourceError(f"A window of samples was refused: {exc}") from exc


def _table(batch: Any) -> Any:
    import pyarrow as pa

    return pa.Table.from_batches([batch])


def expand(
    urls: str | Sequence[str],
    storage_options: dict[str, Any],
    suffix: str = ".parquet",
    kind: str = "Parquet",
) -> list[str]:
    """A list of files from a list, a directory (its ``suffix`` files), or a glob.

    Raises:
        DataSourceError: no files (``kind`` names them in the message).
    """
    if not isinstance(urls, str):
        out = [str(u) for u in urls]
    else:
        fs, _, paths = fsspec.get_fs_token_paths(urls, storage_options=storage_options)
        if len(paths) == 1 and fs.isdir(paths[0]):
            paths = sorted(p for p in fs.find(paths[0]) if p.endswith(suffix))
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        prefix = "" if protocol in ("file", "local") else f"{protocol}://"
        out = [p if "://" in p else prefix + p for p in sorted(paths)]
    if not out:
        raise DataSourceError(f"No {kind} files at {urls!r}; expected files, a directory or glob.")
    return out


class ListBlock(Block):
    """A block of samples (see :class:`Block`): a list."""

    def __init__(self, lanes: int, rows: int) -> None:
        super().__init__(lanes, rows)
        self.samples: list[Any] = [None] * (rows * lanes)

    def put(self, lane: int, piece: Any, order: Any) -> None:
        n = len(order)  # each lane its own rows of the list
        self.samples[lane : lane + n * self.lanes : self.lanes] = [piece[i] for i in order.tolist()]


class ReaderSource(Source[list[Any]]):
    """Shards of any format, read by ``read(shard, start)``: the shard's samples from row
    ``start`` on, in order (the stream stops taking when it has what it needs).

    Args:
        shards: the shards' names (paths or URLs), passed to ``read``.
        read: yields one shard's samples from a row on; must be a module-level function (or
            another picklable callable) for DataLoader worker processes.
        rows: each shard's sample count (the order needs them before reading).
    """

    def __init__(
        self,
        shards: Sequence[str],
        read: Callable[[str, int], Iterable[Any]],
        rows: Sequence[int],
    ) -> None:
        if len(rows) != len(shards) or not shards:
            raise DataSourceError(
                f"{len(shards)} shards and {len(rows)} row counts; expected one count per "
                "shard, and at least one shard."
            )
        self._shards, self._read, self._rows = list(shards), read, list(rows)

    def names(self) -> Sequence[str]:
        return self._shards

    def rows(self) -> list[int]:
        return self._rows

    def read(self, shard: int, start: int, stop: int, piece: int) -> Iterator[list[Any]]:
        samples: list[Any] = []
        got = start
        if stop > start:
            for sample in self._read(self._shards[shard], start):
                samples.append(sample)
                got += 1
                if got == stop or len(samples) == piece:
                    yield samples
                    samples = []
                if got == stop:
                    return
        if got < stop:
            raise DataSourceError(
                f"{self._shards[shard]!r} gave {got} samples; the stream counted "
                f"{self._rows[shard]} (expected its rows argument to be the count)."
            )
        if samples:
            yield samples

    def cut(self, piece: list[Any], start: int, stop: int) -> list[Any]:
        return piece[start:stop]

    def join(self, pieces: list[list[Any]]) -> list[Any]:
        return [x for p in pieces for x in p]

    def dump(self, piece: list[Any], room: Callable[[int], Any]) -> None:
        data = pickle.dumps(piece, protocol=pickle.HIGHEST_PROTOCOL)
        memoryview(room(len(data)))[: len(data)] = data

    def load(self, buffer: Any) -> list[Any]:
        """The samples :meth:`dump` wrote, unpickled: a reader function's samples may be of
        any class. The exchange reads only windows of this user's, in a directory of its
        alone (efdl.data.exchange); a source whose samples are plain data loads them with
        :func:`load_data`, which runs no code."""
        return cast("list[Any]", pickle.loads(buffer))  # what follows the pickle is ignored

    def block(self, lanes: int, rows: int, spare: Any = None, worker: bool = False) -> Block:
        return ListBlock(lanes, rows)

    def gather(self, picks: list[Pick]) -> list[Any]:
        listed = cast("list[ListPick]", picks)
        return [x for block, start, stop, step in listed for x in block.samples[start:stop:step]]

    def batch(self, picks: list[Pick]) -> Any:
        from torch.utils.data import default_collate

        return default_collate(self.gather(picks))
