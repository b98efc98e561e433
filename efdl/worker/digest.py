"""A cheap digest of a replica's tensors, so that replicas of one step can be compared.

The tensors' bytes are read as 64-bit words (32-bit words or bytes where their size does
not allow) and summed in 64-bit integers (wrapping) on the tensors' own device, a chunk
at a time: a view, no copy, as fast as a float sum (widening 32-bit words would be 20 times
slower). Each chunk's sum is weighted by its place, so a changed bit anywhere changes the
digest, and so does moving a chunk or a tensor. Integer sums are exact and independent of
the order of the additions: two ranks with equal tensors get equal digests whatever their
kernels or thread counts, which a float sum would not promise. Cost: one read of the tensors
(0.08 s for 100M float32 parameters on one CPU core here; on a GPU at memory bandwidth) and
one device-to-host copy of a single integer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHUNK = 1 << 23  # words per partial sum
_MULT = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant, as a signed int64


def digest(tensors: Iterable[torch.Tensor]) -> int:
    """The digest of ``tensors`` (in order); never 0 (0 means "no digest" to the sync)."""
    acc: torch.Tensor | None = None
    for t in tensors:
        flat = t.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        words = _words(flat.view(torch.uint8))
        for start in range(0, max(words.numel(), 1), CHUNK):
            part = torch.sum(words[start : start + CHUNK], dtype=torch.int64)
            acc = part + 1 if acc is None else acc * _MULT + part + 1  # wraps mod 2**64
    value = int(acc.item()) if acc is not None else 0
    return value or 1


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (bytes) as the widest integer words its size allows (the same for equal tensors
    wherever they lie; one at an odd place in its storage is copied first)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if raw.numel() % size == 0:
            aligned = raw if raw.storage_offset() % size == 0 else raw.clone()
            return aligned.view(dtype)
    return raw
