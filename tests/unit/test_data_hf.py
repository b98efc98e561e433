"""Hugging Face ``datasets`` through efdl.data.from_hf: an arrow-backed Dataset (after a
shuffle and a select) and a Parquet IterableDataset give each row once per epoch over any
world; one that cannot be split by row is refused with what to do instead."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from efdl.data import DataSourceError, ElasticStream, from_hf


def epoch_ids(make: Any, world: int, workers: int = 0) -> Counter[int]:
    seen: Counter[int] = Counter()
    for rank in range(world):
        s: ElasticStream = make()
        s.set_world(rank, world)
        for batch in DataLoader(s, batch_size=None, num_workers=workers):
            seen.update(int(i) for i in batch["id"])
    return seen


def test_an_arrow_dataset_after_shuffle_and_select(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"id": list(range(3000)), "t": [f"r{i}" for i in range(3000)]})
    ds = ds.shuffle(seed=1).select(range(2000))  # an indices mapping over the Arrow table
    for world, workers in ((1, 0), (3, 2)):
        seen = epoch_ids(
            lambda: from_hf(ds, 96, shard_rows=256, lanes=8, window=32), world, workers
        )
        assert sorted(seen) == sorted(ds["id"]) and max(seen.values()) == 1
    batch = next(iter(from_hf(ds, 96, columns=["t"], lanes=8)))
    assert list(batch) == ["t"] and all(t.startswith("r") for t in batch["t"])


def test_a_parquet_iterable_dataset_and_a_mapped_one(tmp_path: Path) -> None:
    files = []
    for i in range(3):
        path = tmp_path / f"{i}.parquet"
        pq.write_table(pa.table({"id": pa.array(range(i * 100, i * 100 + 90), pa.int64())}), path)
        files.append(str(path))
    it = datasets.load_dataset("parquet", data_files=files, streaming=True, split="train")
    seen = epoch_ids(lambda: from_hf(it, 16, lanes=4, window=8), 2)
    assert sorted(seen) == [i * 100 + r for i in range(3) for r in range(90)]
    with pytest.raises(DataSourceError, match=r"MappedExamplesIterable.*transform"):
        from_hf(it.map(lambda x: x), 16, lanes=4)
    with pytest.raises(DataSourceError, match="not list"):
        from_hf([1, 2], 16)
