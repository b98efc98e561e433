"""Where the rows of a sharded tensor are (pure): FSDP2's layout and the ranks that cover it.

With FSDP2 (``fully_shard``) every rank holds chunk ``index`` of ``shards`` of each parameter
and optimizer state along dim 0, cut as ``torch.chunk`` cuts: chunks of
``ceil(length / shards)`` rows, the last ones short or empty.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Layout:
    """How a rank holds every sharded tensor: chunk ``index`` of ``shards`` along dim 0."""

    shards: int
    index: int


def rows(length: int, layout: Layout) -> tuple[int, int]:
    """The rows ``[start, end)`` of a dim-0 ``length`` that ``layout`` holds."""
    size = -(-length // layout.shards)
    start = min(layout.index * size, length)
    return start, min(start + size, length)


def overlap(length: int, a: Layout, b: Layout) -> tuple[int, int]:
    """The rows ``[start, end)`` of a dim-0 ``length`` that both ``a`` and ``b`` hold
    (``start >= end``: none)."""
    (a0, a1), (b0, b1) = rows(length, a), rows(length, b)
    return max(a0, b0), min(a1, b1)


def byte_span(shape: Sequence[int], itemsize: int, layout: Layout) -> tuple[int, int]:
    """The bytes of a contiguous tensor of ``shape`` that ``layout`` holds."""
    if not shape:
        raise ValueError("A 0-dimensional tensor cannot be sharded.")
    row = itemsize * math.prod(shape[1:])
    start, end = rows(shape[0], layout)
    return start * row, end * row


def covers(layouts: Iterable[Layout]) -> bool:
    """Whether ``layouts`` hold every row between them: all of one ``shards``, every index."""
    held = set(layouts)
    counts = {layout.shards for layout in held}
    if len(counts) != 1:
        return False
    (shards,) = counts
    return {layout.index for layout in held} == set(range(shards))
