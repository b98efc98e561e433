"""Hugging Face ``datasets`` as efdl streams: the same each-sample-once guarantee.

- An arrow-backed ``datasets.Dataset`` (``load_dataset(...)`` without streaming, or
  ``Dataset.from_*``) is read through its Arrow table: its rows are cut into shards of
  ``shard_rows`` consecutive rows (the unit the epoch shuffles), read zero-copy from the
  memory-mapped cache files, after any ``select``/``shuffle`` indices it carries.
- An ``IterableDataset`` straight from Parquet files (``load_dataset("parquet",
  data_files=..., streaming=True)``, or a Hub data set stored as Parquet) is read from those
  files by efdl's own Parquet reader. One with ``map``/``filter``/``shuffle`` applied cannot
  be split by row, and is refused: apply the function as the stream's ``transform``.

Rows come as Arrow tables to the stream's transform (default: a dict of tensors per column);
feature decoding (images, audio) is the transform's, as with any Arrow batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from efdl.data.parquet import ParquetSource
from efdl.data.shards import Source
from efdl.data.stream import ElasticStream
from efdl.errors import DataSourceError


class DatasetSource(Source[Any]):
    """An arrow-backed ``datasets.Dataset``, as shards of ``shard_rows`` consecutive rows."""

    def __init__(self, dataset: Any, shard_rows: int = 8192) -> None:
        if shard_rows < 1:
            raise ValueError(f"shard_rows is {shard_rows!r}; expected a whole number >= 1.")
        self._data = dataset.with_format("arrow")
        self._n, self._shard_rows = len(dataset), shard_rows

    def names(self) -> Sequence[str]:
        return [f"rows {a}-{min(a + self._shard_rows, self._n) - 1}" for a in self._firsts()]

    def _firsts(self) -> range:
        return range(0, self._n, self._shard_rows)

    def rows(self) -> list[int]:
        return [min(self._shard_rows, self._n - a) for a in self._firsts()]

    def read(self, shard: int, start: int, stop: int, piece: int) -> Iterator[Any]:
        first = shard * self._shard_rows
        for a in range(first + start, first + stop, piece):
            yield self._data[a : min(a + piece, first + stop)]


def parquet_files(dataset: Any) -> list[str]:
    """The Parquet files an ``IterableDataset`` reads, if it reads them as they are.

    Raises:
        DataSourceError: it is not a plain Parquet stream (map/filter/shuffle applied, or
            another format).
    """
    inner = getattr(dataset, "_ex_iterable", None)
    kwargs = getattr(inner, "kwargs", None)
    files = kwargs.get("files") if isinstance(kwargs, dict) else None
    if type(inner).__name__ != "ArrowExamplesIterable" or not files:
        raise DataSourceError(
            f"This IterableDataset ({type(inner).__name__}) is not Parquet files read as they "
            "are: efdl streams an IterableDataset only as load_dataset('parquet', "
            "data_files=..., streaming=True) gives it, before map/filter/shuffle. Give the "
            "function as ElasticStream's transform instead, or pass the files themselves."
        )
    flat = [str(f) for group in files for f in (group if isinstance(group, list) else [group])]
    if not all(f.split("::")[0].endswith(".parquet") for f in flat):
        raise DataSourceError(
            f"This IterableDataset reads {flat[:3]}...; expected Parquet files (.parquet)."
        )
    return [f.split("::")[0] for f in flat]


def from_hf(
    dataset: Any,
    global_batch_size: int,
    *,
    shard_rows: int = 8192,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    **stream_args: Any,
) -> ElasticStream:
    """An :class:`ElasticStream` over a Hugging Face data set (see the module docstring).

    Args:
        dataset: a ``datasets.Dataset`` or a Parquet ``datasets.IterableDataset``.
        global_batch_size: samples per step over all ranks.
        shard_rows: a ``Dataset``'s rows per shard (the unit the epoch's shuffle moves).
        columns: the columns to read (None: all).
        storage_options: fsspec options for a Parquet ``IterableDataset``'s files.
        **stream_args: lanes, window, seed, shuffle, transform, threads (ElasticStream's).

    Raises:
        DataSourceError: a data set efdl cannot split by row.
    """
    import datasets

    if isinstance(dataset, datasets.Dataset):
        if columns is not None:
            dataset = dataset.select_columns(list(columns))
        source: Source[Any] = DatasetSource(dataset, shard_rows)
    elif isinstance(dataset, datasets.IterableDataset):
        source = ParquetSource(parquet_files(dataset), columns, storage_options)
    else:
        raise DataSourceError(
            f"from_hf takes a datasets.Dataset or IterableDataset, not {type(dataset).__name__}."
        )
    return ElasticStream(source, global_batch_size, **stream_args)
