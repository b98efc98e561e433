"""The interface of a stream's data: :class:`Source`, shards of rows and the operations on
a piece of them, and :func:`expand`, the files a URL names.

A source names its shards, counts their rows, and reads a shard's rows ``[start, stop)`` as
pieces; it also owns the pieces' type (how to measure, cut, join and reorder them), so the
stream (efdl.data.stream) never looks inside a row. Its pieces are Arrow tables unless it
says otherwise (efdl.data.blocks holds them); the kinds are efdl.data.parquet's and
efdl.data.samples'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

import fsspec  # type: ignore[import-untyped]

from efdl.data.blocks import (
    ArrowBlock,
    ArrowLanes,
    ArrowPick,
    Block,
    Pick,
    gather_table,
    gather_tensors,
)
from efdl.errors import DataSourceError

C = TypeVar("C")  # a source's piece of rows: a pyarrow Table, or a list of samples


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
