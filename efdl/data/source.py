"""Where a stream's rows come from: shards, their row counts, and reads from a row onward.

A :class:`Source` names its shards, counts their rows, and reads a shard's rows ``[start,
stop)`` as pieces; it also owns the pieces' type (how to measure, cut, join and reorder
them), so the stream (efdl.data.stream) never looks inside a row. Two kinds:

- :class:`ParquetSource`: Parquet files at local paths or any fsspec URL (``s3://``...).
  Row counts come from the files' footers; a read opens the file, reads only the row groups
  that hold the rows asked for (only the columns asked for), and counts the bytes it read.
- :class:`ReaderSource`: any format, through a function ``read(shard, start)`` that yields
  the shard's samples from row ``start`` on (WebDataset tars, JSON lines, ...).

This module gathers the names; they live in efdl.data.shards (:class:`Source`,
:func:`expand`), efdl.data.blocks (the blocks a step's rows are taken from, and its
batches), efdl.data.parquet, efdl.data.samples (:class:`ReaderSource`, :func:`load_data`)
and efdl.errors (:class:`DataSourceError`).
"""

from __future__ import annotations

from efdl.data.blocks import (
    ArrowBlock,
    ArrowLanes,
    ArrowPick,
    Block,
    ListBlock,
    ListPick,
    Pick,
    gather_table,
    gather_tensors,
    to_torch,
)
from efdl.data.parquet import ParquetSource
from efdl.data.samples import ReaderSource, load_data
from efdl.data.shards import C, Source, expand
from efdl.errors import DataSourceError

__all__ = [
    "ArrowBlock",
    "ArrowLanes",
    "ArrowPick",
    "Block",
    "C",
    "DataSourceError",
    "ListBlock",
    "ListPick",
    "ParquetSource",
    "Pick",
    "ReaderSource",
    "Source",
    "expand",
    "gather_table",
    "gather_tensors",
    "load_data",
    "to_torch",
]
