"""WebDataset tar shards through ElasticStream (efdl.data.tar): real tar files, on disk and
on the local S3 server, read by the stream with and without DataLoader workers."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from efdl.data.source import DataSourceError
from efdl.data.stream import ElasticStream
from efdl.data.tar import TarSource, count_samples, tar_samples


def write_tar(path: Path, first: int, n: int, extra: bool = False) -> None:
    """A WebDataset shard of samples ``first .. first + n - 1``: an image-like ``.jpg`` of
    bytes and a ``.json`` label each, under a folder; with ``extra``, members that belong to
    no sample (a directory, a top-level ``__meta__``, a name with no dot)."""

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w") as tar:
        if extra:
            folder = tarfile.TarInfo("train")
            folder.type = tarfile.DIRTYPE
            tar.addfile(folder)
            add(tar, "__meta__", b"{}")
        for i in range(first, first + n):
            add(tar, f"train/{i:06d}.JPG", bytes([i % 251]) * (100 + i % 7))
            add(tar, f"train/{i:06d}.json", json.dumps({"id": i}).encode())
            if extra and i == first:
                add(tar, "README", b"no dot: not a sample's")


def shards_at(folder: Path, sizes: tuple[int, ...] = (40, 3, 77)) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names, first = [], 0
    for k, n in enumerate(sizes):
        path = folder / f"shard-{k:03d}.tar"
        write_tar(path, first, n, extra=k == 0)
        names.append(str(path))
        first += n
    return names


def label(batch: dict[str, Any]) -> list[int]:
    return [json.loads(raw)["id"] for raw in batch["json"]]


def test_a_shard_reads_as_samples_from_any_start(tmp_path: Path) -> None:
    (name,) = shards_at(tmp_path, (12,))
    assert count_samples(name) == 12
    samples = list(tar_samples(name))
    assert [s["__key__"] for s in samples] == [f"train/{i:06d}" for i in range(12)]
    assert set(samples[0]) == {"__key__", "jpg", "json"}  # fields lower-cased
    assert samples[5]["jpg"] == bytes([5]) * 105
    assert [json.loads(s["json"])["id"] for s in tar_samples(name, 9)] == [9, 10, 11]
    assert list(tar_samples(name, 12)) == []


def test_any_start_inside_a_shard_gives_its_samples_from_there(tmp_path: Path) -> None:
    """Names long enough for extended (pax) headers included."""
    path = tmp_path / "long.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(300):
            folder = "d" * (150 if i % 5 == 0 else 1)  # a name over 100 bytes: a pax header
            for field in ("jpg", "cls"):
                info = tarfile.TarInfo(f"{folder}/{i:05d}.{field}")
                data = f"{i}-{field}".encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    name = str(path)
    whole = [s["cls"] for s in tar_samples(name)]
    assert whole == [f"{i}-cls".encode() for i in range(300)]
    assert count_samples(name) == 300
    for start in (1, 63, 64, 65, 130, 299, 300):
        assert [s["cls"] for s in tar_samples(name, start)] == whole[start:], start


@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_once_per_epoch_at_any_world(tmp_path: Path, workers: int) -> None:
    names = shards_at(tmp_path)
    source = TarSource(str(tmp_path))  # the directory: its .tar files, sorted
    assert source.names() == names and source.rows() == [40, 3, 77]
    for world in (1, 3):
        got = []
        for rank in range(world):
            stream = ElasticStream(source, 24, lanes=4, window=10, seed=3)
            stream.set_world(rank, world)
            loader: DataLoader[Any] = DataLoader(stream, batch_size=None, num_workers=workers)
            for batch in loader:
                assert len(batch["jpg"]) == len(batch["__key__"]) == len(batch["json"])
                got += label(batch)
        assert sorted(got) == list(range(120)), (world, workers)


def test_a_rescale_mid_epoch_splits_the_rest_over_the_new_world(tmp_path: Path) -> None:
    source = TarSource(shards_at(tmp_path), rows=[40, 3, 77])  # counts given: not read
    first = ElasticStream(source, 24, lanes=4, window=10)
    first.set_world(0, 1)
    got = []
    for batch in first:
        got += label(batch)
        first.advance()
        if first.cursor == 48:
            break
    for rank in range(2):
        again = ElasticStream(source, 24, lanes=4, window=10)
        again.load_state_dict(first.state_dict())
        again.set_world(rank, 2)
        got += [i for batch in again for i in label(batch)]
    assert sorted(got) == list(range(120))


def test_tar_shards_on_s3(s3_bucket: str, tmp_path: Path) -> None:
    import fsspec  # type: ignore[import-untyped]

    fs = fsspec.filesystem("s3")
    for name in shards_at(tmp_path, (30, 50)):
        fs.put(name, f"{s3_bucket}/wds/{Path(name).name}")
    source = TarSource(f"{s3_bucket}/wds/")
    assert source.rows() == [30, 50]
    streams = [ElasticStream(source, 16, lanes=4, window=8) for _ in range(2)]
    for rank, s in enumerate(streams):
        s.set_world(rank, 2)
    assert sorted(i for s in streams for b in s for i in label(b)) == list(range(80))


def test_bad_shards_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataSourceError, match="No tar files at"):
        TarSource(str(tmp_path / "empty"))
    not_tar = tmp_path / "bad.tar"
    not_tar.write_bytes(b"this is not a tar file" * 100)
    with pytest.raises(DataSourceError, match="is not a tar file"):
        TarSource([str(not_tar)])
    with pytest.raises(DataSourceError, match="Cannot open the tar shard"):
        TarSource([str(tmp_path / "missing.tar")])
    names = shards_at(tmp_path / "ok", (5,))
    with pytest.raises(DataSourceError, match="one count per shard"):
        TarSource(names, rows=[5, 5])
    with pytest.raises(DataSourceError, match="gave 5 samples; the stream counted 9"):
        list(ElasticStream(TarSource(names, rows=[9]), 4, lanes=1, window=4))
    twice = tmp_path / "twice.tar"
    with tarfile.open(twice, "w") as tar:
        for _ in range(2):
            info = tarfile.TarInfo("a/000001.jpg")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(DataSourceError, match="two 'jpg' members for the sample 'a/000001'"):
        list(tar_samples(str(twice)))
