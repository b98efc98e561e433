"""Samples of any format as a stream's source: :class:`ReaderSource`, through a function
``read(shard, start)`` that yields the shard's samples from row ``start`` on (WebDataset
tars, JSON lines, ...), and :func:`load_data`, which loads pickled samples that are plain
data without running any code.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

from efdl.data.blocks import Block, ListBlock, ListPick, Pick
from efdl.data.shards import Source
from efdl.errors import DataSourceError


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
