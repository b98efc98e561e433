"""WebDataset tar shards as a stream's source.

A WebDataset shard is a tar file whose consecutive members that share a key make up one
sample: ``dir/000123.jpg`` and ``dir/000123.cls`` are the ``jpg`` and ``cls`` fields of the
sample keyed ``dir/000123`` (the key is the name up to the first dot of its last part; the
field, the rest, lower-cased). Members that are not files, names with no dot, and
``__name__`` members at the top level are left out, as WebDataset does.

:class:`TarSource` reads them for :class:`~efdl.data.stream.ElasticStream`: a sample is a
dict of its fields' bytes and ``"__key__"``, and a batch (without a ``transform``) is a dict
of lists. Decode the fields in the stream's ``transform`` (images, JSON, ...). A lane that
starts at a sample within a shard walks the members' headers to it, seeking over their
data, and reads only from there.
"""

from __future__ import annotations

import functools
import re
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import fsspec  # type: ignore[import-untyped]

from efdl.data.samples import ReaderSource, load_data
from efdl.data.shards import expand
from efdl.errors import DataSourceError

_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # key, fields (WebDataset's rule)


def _split(name: str) -> tuple[str, str] | None:
    """A member's (key, field), or None where it belongs to no sample."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    match = _NAME.match(name)
    return (match.group(1), match.group(2).lower()) if match else None


def _members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """The tar's sample members in order, with their key and field."""
    while (member := tar.next()) is not None:
        tar.members = []  # type: ignore[attr-defined]  # not kept: a shard may hold millions
        if member.isfile():
            named = _split(member.name)
            if named is not None:
                yield member, named[0], named[1]


def _open(url: str, storage_options: dict[str, Any]) -> Any:
    try:
        return fsspec.open(url, "rb", **storage_options).open()
    except (OSError, ValueError) as exc:
        raise DataSourceError(f"Cannot open the tar shard {url!r}: {exc}") from exc


def _tar(url: str, f: Any) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=f, mode="r:")  # seeks over the data it does not read
    except tarfile.TarError as exc:
        f.close()
        raise DataSourceError(
            f"{url!r} is not a tar file ({exc}); expected a WebDataset shard (an uncompressed tar)."
        ) from exc


def tar_samples(
    url: str, start: int = 0, storage_options: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """The samples of the tar shard at ``url`` from sample ``start`` on: each a dict of its
    fields' bytes and ``"__key__"``.

    Raises:
        DataSourceError: the shard cannot be opened or is not a tar.
    """
    f = _open(url, dict(storage_options or {}))
    with f, _tar(url, f) as tar:
        index, key = -1, None
        sample: dict[str, Any] = {}
        for member, name, field in _members(tar):
            if name != key:
                if sample:
                    yield sample
                index, key, sample = index + 1, name, {}
            if index < start:
                continue  # its data is seeked over, not read
            if not sample:
                sample["__key__"] = name
            if field in sample:
                raise DataSourceError(
                    f"{url!r} has two {field!r} members for the sample {name!r}; expected each "
                    "of a sample's fields once (its members one after the other)."
                )
            data = tar.extractfile(member)
            assert data is not None  # a file member
            sample[field] = data.read()
        if sample:
            yield sample


def count_samples(url: str, storage_options: dict[str, Any] | None = None) -> int:
    """The samples in the tar shard at ``url`` (its members' headers are read, not their
    data)."""
    f = _open(url, dict(storage_options or {}))
    with f, _tar(url, f) as tar:
        keys, last = 0, None
        for _, key, _ in _members(tar):
            keys, last = keys + (key != last), key
        return keys


class TarSource(ReaderSource):
    """WebDataset tar shards (paths or fsspec URLs; a directory or glob expands to its
    ``.tar`` files, sorted).

    Args:
        urls: the shards, or one directory or glob.
        rows: each shard's sample count, if known (a WebDataset index has them); else each
            shard's members' headers are read once here, 32 shards at a time.
        storage_options: passed to fsspec.

    Raises:
        DataSourceError: no shards, a count per shard missing, or a shard that is not a tar.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        rows: Sequence[int] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        options = dict(storage_options or {})
        shards = expand(urls, options, suffix=".tar", kind="tar")
        if rows is None:
            with ThreadPoolExecutor(max_workers=min(32, len(shards))) as pool:
                rows = list(
                    pool.map(functools.partial(count_samples, storage_options=options), shards)
                )
        # A partial of a module-level function: picklable, for DataLoader workers.
        super().__init__(shards, functools.partial(tar_samples, storage_options=options), rows)

    def load(self, buffer: Any) -> list[Any]:
        """A window another DataLoader worker gave: its samples are dicts of strings and
        bytes, loaded without running any code (efdl.data.samples.load_data)."""
        return cast("list[Any]", load_data(buffer))
