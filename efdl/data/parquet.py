"""Parquet files as a stream's source: :class:`ParquetSource`.

Files at local paths or any fsspec URL (``s3://``...). Row counts come from the files'
footers; a read opens the file, reads only the row groups that hold the rows asked for
(only the columns asked for), and counts the bytes it read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec  # type: ignore[import-untyped]
from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]

from efdl.data.shards import Source, expand
from efdl.errors import DataSourceError


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


def _table(batch: Any) -> Any:
    import pyarrow as pa

    return pa.Table.from_batches([batch])
