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

import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import fsspec  # type: ignore[import-untyped]

C = TypeVar("C")  # a source's piece of rows: a pyarrow Table, or a list of samples


class DataSourceError(ValueError):
    """A shard that cannot be read as the stream needs it (missing, not Parquet, a column
    it lacks, fewer rows than counted)."""


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

    def take(self, piece: C, order: Any) -> C:
        """The rows of ``piece`` at ``order`` (an int64 numpy array), in that order."""
        return piece.take(order)  # type: ignore[attr-defined, no-any-return]

    def collate(self, piece: C) -> Any:
        """A batch of a piece the stream made (its own copy of the rows), where it has no
        transform of the user's."""
        return to_torch(piece, copy=False)


def to_torch(table: Any, copy: bool = True) -> dict[str, Any]:
    """A pyarrow Table as a dict: numeric and boolean columns as tensors, lists of numbers of
    one length as 2-D tensors, anything else as a Python list.

    Args:
        copy: True: the tensors own their memory (a copy). False: they use the table's
            buffers, where the caller owns them alone (a table it made, never a memory-mapped
            or shared one): Arrow marks its buffers read-only, and writing to such a tensor
            writes to the table.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.types as pt
    import torch

    def tensor(values: Any) -> Any:
        if copy:
            return torch.from_numpy(values.to_numpy(zero_copy_only=False, writable=True))
        with warnings.catch_warnings():  # "The given NumPy array is not writable"
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(values.to_numpy(zero_copy_only=False))

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
        DataSourceError: no files, or (at ``rows()``) a file that is not Parquet.
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
        self._urls = _expand(urls, self.storage_options)
        if rows is not None and len(rows) != len(self._urls):
            raise DataSourceError(
                f"rows has {len(rows)} counts for {len(self._urls)} Parquet files; expected one "
                "count per file, in the files' order."
            )
        self._rows = list(rows) if rows is not None else None
        self._footers: dict[int, Any] = {}  # each shard's metadata, once read (no re-read)
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
            self._rows = [sum(groups) for groups in metas]
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

    def _open(self, shard: int) -> Any:
        import pyarrow.parquet as pq

        url = self._urls[shard]
        try:
            f = fsspec.open(url, "rb", **self.storage_options).open()
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
        return pf

    def _footer(self, shard: int) -> list[int]:
        pf = self._open(shard)
        try:
            groups = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            with self._lock:
                self._footers[shard] = pf.metadata
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


def _table(batch: Any) -> Any:
    import pyarrow as pa

    return pa.Table.from_batches([batch])


def _expand(urls: str | Sequence[str], storage_options: dict[str, Any]) -> list[str]:
    """A list of files from a list, a directory, or a glob."""
    if not isinstance(urls, str):
        out = [str(u) for u in urls]
    else:
        fs, _, paths = fsspec.get_fs_token_paths(urls, storage_options=storage_options)
        if len(paths) == 1 and fs.isdir(paths[0]):
            paths = sorted(p for p in fs.find(paths[0]) if p.endswith(".parquet"))
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        prefix = "" if protocol in ("file", "local") else f"{protocol}://"
        out = [p if "://" in p else prefix + p for p in sorted(paths)]
    if not out:
        raise DataSourceError(f"No Parquet files at {urls!r}; expected files, a directory or glob.")
    return out


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

    def take(self, piece: list[Any], order: Any) -> list[Any]:
        return [piece[i] for i in order.tolist()]

    def collate(self, piece: list[Any]) -> Any:
        from torch.utils.data import default_collate

        return default_collate(piece)
