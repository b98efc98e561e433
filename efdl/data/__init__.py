"""Streamed data whose epoch survives a change of world size (docs/data.md).

efdl.data.order (the epoch's order, pure), efdl.data.source (shards: Parquet, or any format
through a reader function), efdl.data.stream (:class:`ElasticStream`, the dataset),
efdl.data.hf (Hugging Face ``datasets``), efdl.data.tar (WebDataset tar shards). Imported
on first use: pyarrow and torch load only when a stream is made.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "ElasticStream": "efdl.data.stream",
    "ParquetSource": "efdl.data.parquet",
    "ReaderSource": "efdl.data.samples",
    "DataSourceError": "efdl.errors",
    "StreamShareError": "efdl.data.order",
    "SharedDirectoryError": "efdl.data.exchange",
    "from_hf": "efdl.data.hf",
    "TarSource": "efdl.data.tar",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'efdl.data' has no attribute {name!r}")
