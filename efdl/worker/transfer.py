"""Moving tensors between ranks: only to those who lack them, in bounded messages, in place.

After a rebuild some ranks hold the newest committed state and the others need it: newcomers,
ranks a step behind, ranks whose update was torn; and with a sharded model every rank needs
its rows of each tensor laid out for the new world, held by others in the old layout. Each
tensor (a leaf) says which of its bytes each rank holds and which each rank needs
(:class:`Leaf`); only bytes a rank needs and does not hold travel, straight into its own
tensor (or a new one where it has none yet), on its own device, in messages of at most
``bucket`` bytes:

- a stretch of a megabyte or more goes by itself, straight from the sender's tensor into the
  receiver's (no copy), as several messages if it is larger than a bucket; several such
  messages are in flight at once;
- smaller stretches are packed into one bucket (one copy on each side), one at a time;
- bytes a rank holds itself in another tensor (its old shard) are copied locally.

So the memory a transfer adds on either side is at most one bucket, and no message is so
large that it could outlast the collective timeout. With several senders for a message, each
receiver takes it from the one that has sent it the fewest bytes so far. Every rank walks the
(message, receiver) pairs in one global order, sending or receiving those that are its own,
so two ranks can never wait on each other in a cycle.

Links: CPU tensors travel over the CPU (gloo) side group; device tensors over the training
group when it is NCCL, and staged through a host bucket over the side group otherwise (gloo's
point-to-point operations take host memory only).

The planning (:func:`segments`, :func:`plan`, :func:`routes`, :func:`own_copies`) is pure;
:func:`move` does the I/O.
"""

from __future__ import annotations

import datetime
import functools
import io
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from efdl.worker.layout import Layout, byte_span

DEFAULT_BUCKET = 64 << 20  # bytes; EFDL_SYNC_BUCKET_MB overrides it
PACK_BELOW = 1 << 20  # smaller tensors are packed together; larger ones go by themselves
WINDOW = 8  # point-to-point operations in flight at once (on their own tensors: no copy)


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[start, end)`` of a leaf, on rank ``rank``."""

    rank: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Leaf:
    """A tensor to move: its size, where it lives, which of its bytes each rank holds
    (``held``) and which each rank needs (``wanted``). A replicated tensor is held whole by
    its holders and wanted whole by every rank (:meth:`whole`); a sharded one is held and
    wanted in row ranges, laid out differently before and after a rescale."""

    nbytes: int
    on_device: bool
    held: tuple[Span, ...]
    wanted: tuple[Span, ...]

    @classmethod
    def whole(
        cls, nbytes: int, on_device: bool, holders: Sequence[int], ranks: Sequence[int]
    ) -> Leaf:
        """Held whole by ``holders``, wanted whole by ``ranks``."""
        return cls(
            nbytes,
            on_device,
            tuple(Span(r, 0, nbytes) for r in holders),
            tuple(Span(r, 0, nbytes) for r in ranks),
        )


def rows_leaf(
    shape: Sequence[int],
    itemsize: int,
    on_device: bool,
    held: Iterable[tuple[int, Layout]],
    wanted: Iterable[tuple[int, Layout]],
) -> Leaf:
    """A tensor of ``shape`` sharded on dim 0: ``(rank, layout)`` of the ranks holding rows
    of it, and of the ranks needing rows of it."""
    span = functools.partial(byte_span, shape, itemsize)
    return Leaf(
        math.prod(shape) * itemsize,
        on_device,
        tuple(Span(r, *span(layout)) for r, layout in held),
        tuple(Span(r, *span(layout)) for r, layout in wanted),
    )


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, end)`` of leaf ``leaf``."""

    leaf: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point send to each of ``receivers``, from one of ``senders``: pieces of
    leaves that share both and a link."""

    on_device: bool
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True, slots=True)
class Route:
    message: int
    src: int
    dst: int


class UnheldError(ValueError):
    """Bytes some rank needs are held by none."""


def segments(leaf: Leaf) -> Iterator[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """``leaf`` cut where any rank's holding or need begins or ends: ``(start, end, senders,
    receivers)`` for each stretch some rank needs and does not hold (adjacent stretches of
    the same ranks merged). A rank never receives bytes it holds itself.

    Raises:
        UnheldError: a needed stretch is held by no rank.
    """
    cuts = sorted(
        {0, leaf.nbytes} | {x for s in (*leaf.held, *leaf.wanted) for x in (s.start, s.end)}
    )
    run: list[Any] | None = None
    for a, b in itertools.pairwise(cuts):
        if a >= b:
            continue
        holders = tuple(sorted({s.rank for s in leaf.held if s.start <= a and b <= s.end}))
        takers = {s.rank for s in leaf.wanted if s.start <= a and b <= s.end}
        receivers = tuple(sorted(takers - set(holders)))
        if receivers and not holders:
            raise UnheldError(
                f"bytes [{a}, {b}) of a {leaf.nbytes}-byte tensor are held by no rank"
            )
        if run is not None and run[1] == a and run[2:] == [holders, receivers]:
            run[1] = b
            continue
        if run is not None and run[3]:
            yield run[0], run[1], run[2], run[3]
        run = [a, b, holders, receivers]
    if run is not None and run[3]:
        yield run[0], run[1], run[2], run[3]


def plan(leaves: Sequence[Leaf], bucket: int) -> list[Message]:
    """Cut what ranks need of ``leaves`` into messages of at most ``bucket`` bytes: a stretch
    of ``PACK_BELOW`` bytes or more by itself (in slices if larger than a bucket), smaller
    ones packed together. Stretches of different senders, receivers or links never share a
    message. Pure and deterministic: every rank computes the same plan from the same leaves.

    Raises:
        UnheldError: a needed stretch is held by no rank.
    """
    if bucket < 1:
        raise ValueError(f"The transfer bucket must be at least 1 byte (got {bucket}).")
    groups: dict[tuple[bool, tuple[int, ...], tuple[int, ...]], list[Piece]] = {}
    for i, leaf in enumerate(leaves):
        for a, b, senders, receivers in segments(leaf):
            groups.setdefault((leaf.on_device, senders, receivers), []).append(Piece(i, a, b))
    out: list[Message] = []
    for (on_device, senders, receivers), pieces in groups.items():
        packs: list[list[Piece]] = [[]]
        size = 0
        for p in pieces:
            n = p.nbytes
            if n >= min(bucket, PACK_BELOW):  # alone, in slices
                packs += [
                    [Piece(p.leaf, a, min(p.end, a + bucket))]
                    for a in range(p.start, p.end, bucket)
                ]
                packs.append([])
                size = 0
                continue
            if size + n > bucket:
                packs.append([])
                size = 0
            packs[-1].append(p)
            size += n
        out += [Message(on_device, senders, receivers, tuple(p)) for p in packs if p]
    return out


def routes(messages: Sequence[Message]) -> Iterator[Route]:
    """Every (message, receiver) pair in the one global order, with the sender: for each
    receiver, the sender that has sent it the fewest bytes so far (ties: in turn), so the
    senders share the sending by bytes."""
    load: dict[tuple[int, int], int] = {}  # (receiver, sender) -> bytes so far
    for j, m in enumerate(messages):
        n = len(m.senders)
        for i, dst in enumerate(m.receivers):
            turn = [m.senders[(j + i + k) % n] for k in range(n)]
            src = min(turn, key=lambda h: load.get((dst, h), 0))
            load[(dst, src)] = load.get((dst, src), 0) + m.nbytes
            yield Route(j, src, dst)


def fan_out(messages: Sequence[Message]) -> int:
    """The most receivers one sender serves for one message: a receiver may wait that many
    sends for its own, so each operation's timeout is the collective timeout times this."""
    return max(
        (math.ceil(len(m.receivers) / len(m.senders)) for m in messages if m.receivers),
        default=1,
    )


def own_copies(leaves: Sequence[Leaf], rank: int) -> Iterator[Piece]:
    """The bytes ``rank`` needs and holds itself: copied locally where its held and wanted
    tensors differ (a shard laid out anew), nothing where they are one."""
    for i, leaf in enumerate(leaves):
        for w in leaf.wanted:
            if w.rank != rank:
                continue
            for h in leaf.held:
                a, b = max(w.start, h.start), min(w.end, h.end)
                if h.rank == rank and a < b:
                    yield Piece(i, a, b)


@dataclass(frozen=True, slots=True)
class Link:
    """How one kind of tensor travels: the group and where a packed bucket is staged."""

    group: Any  # a ProcessGroup; None is the default (training) group
    staging: torch.device


@dataclass(frozen=True, slots=True)
class Moved:
    sent: int  # bytes
    received: int
    seconds: float = 0.0  # from the first message to the last


class _Prefault:
    """Touches new host tensors on a helper thread, in the order they will be received: a
    receive into memory never touched runs at a fraction of the link's speed (the kernel maps
    each page inside the copy), and zero-filling them meanwhile costs the receive nothing."""

    def __init__(self, tensors: list[tuple[int, torch.Tensor]]) -> None:
        self._done = {leaf: threading.Event() for leaf, _ in tensors}
        if tensors:
            threading.Thread(
                target=self._run, args=(tensors,), name="efdl-prefault", daemon=True
            ).start()

    def _run(self, tensors: list[tuple[int, torch.Tensor]]) -> None:
        for leaf, t in tensors:
            try:
                t.zero_()
            finally:
                self._done[leaf].set()

    def wait(self, leaf: int) -> None:
        done = self._done.get(leaf)
        if done is not None:
            done.wait()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat byte tensor (a view: ``t`` must be contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class Region:
    """Where a leaf's bytes ``[start, start + tensor.nbytes)`` are on this rank."""

    tensor: torch.Tensor
    start: int = 0


def move(
    leaves: Sequence[Leaf],
    held: Sequence[Region | None],
    wanted: Sequence[Region | None],
    links: dict[bool, Link],
    timeout: datetime.timedelta,
    bucket: int,
    fresh: Sequence[bool] = (),
) -> Moved:
    """Send and receive this rank's share of ``leaves`` (planned in messages of at most
    ``bucket`` bytes: :func:`plan`), and copy what it holds itself in another tensor
    (:func:`own_copies`).

    Args:
        leaves: what each rank holds and needs, the same on every rank.
        held: per leaf, the bytes this rank holds of it (what it sends), or None.
        wanted: per leaf, where the bytes this rank needs of it land (contiguous), or None.
            Where a leaf is replicated, both are the one tensor.
        links: per ``on_device``, how such tensors travel.
        timeout: the collective timeout; each operation may take :func:`fan_out` times it.
        bucket: the largest message, in bytes.
        fresh: per leaf, whether this rank's wanted tensor is new host memory (touched on a
            helper thread before it is received into).
    """
    me = dist.get_rank()
    started = time.perf_counter()
    messages = plan(leaves, bucket)
    per_op = timeout * fan_out(messages)
    mine = [r for r in routes(messages) if me in (r.src, r.dst)]
    incoming = dict.fromkeys(
        p.leaf for r in mine if r.dst == me for p in messages[r.message].pieces
    )
    prefault = _Prefault(
        [
            (leaf, region.tensor)
            for leaf in incoming
            if leaf < len(fresh) and fresh[leaf] and (region := wanted[leaf]) is not None
        ]
    )
    staging: dict[torch.device, torch.Tensor] = {}
    flat: dict[tuple[int, int], torch.Tensor] = {}  # its bytes (a contiguous copy if need be)
    sent = received = 0

    def view(regions: Sequence[Region | None], p: Piece) -> torch.Tensor:
        region = regions[p.leaf]
        if region is None:
            raise RuntimeError(f"Tensor {p.leaf} of the transfer is missing on rank {me}.")
        data = flat.get((id(regions), p.leaf))
        if data is None:
            t = region.tensor  # wanted tensors are contiguous: received into, not a copy
            data = flat[(id(regions), p.leaf)] = _bytes(t if t.is_contiguous() else t.contiguous())
        if not region.start <= p.start <= p.end <= region.start + data.numel():
            raise RuntimeError(
                f"Bytes [{p.start}, {p.end}) of tensor {p.leaf} are not in rank {me}'s "
                f"[{region.start}, {region.start + data.numel()})."
            )
        return data[p.start - region.start : p.end - region.start]

    for p in own_copies(leaves, me):
        src, dst = view(held, p), view(wanted, p)
        if src.data_ptr() != dst.data_ptr():
            prefault.wait(p.leaf)
            dst.copy_(src)

    def staged(link: Link, n: int) -> torch.Tensor:
        buf = staging.get(link.staging)
        if buf is None or buf.numel() < n:
            size = max(m.nbytes for m in messages)
            buf = staging[link.staging] = torch.empty(size, dtype=torch.uint8, device=link.staging)
        return buf[:n]

    pending: deque[Any] = deque()  # direct operations in flight, oldest first

    def post(work: Any) -> None:
        pending.append(work)
        while len(pending) > WINDOW:
            _wait(pending.popleft(), per_op)

    for route in mine:
        m = messages[route.message]
        link = links[m.on_device]
        pieces = m.pieces
        sending = route.src == me
        if len(pieces) == 1:
            one = view(held if sending else wanted, pieces[0])
            if one.device.type == link.staging.type:  # its own bytes: no copy, several at once
                if sending:
                    post(dist.isend(one, route.dst, group=link.group))
                else:
                    prefault.wait(pieces[0].leaf)
                    post(dist.irecv(one, route.src, group=link.group))
                sent += m.nbytes if sending else 0
                received += 0 if sending else m.nbytes
                continue
        data = staged(link, m.nbytes)  # packed or staged through the one bucket: one at a time
        offset = 0
        if sending:
            for p in pieces:
                data[offset : offset + p.nbytes].copy_(view(held, p))
                offset += p.nbytes
            _wait(dist.isend(data, route.dst, group=link.group), per_op)
            sent += m.nbytes
        else:
            _wait(dist.irecv(data, route.src, group=link.group), per_op)
            for p in pieces:
                prefault.wait(p.leaf)
                view(wanted, p).copy_(data[offset : offset + p.nbytes])
                offset += p.nbytes
            received += m.nbytes
    while pending:
        _wait(pending.popleft(), per_op)
    return Moved(sent, received, time.perf_counter() - started)


def _wait(work: Any, timeout: datetime.timedelta) -> None:
    if work is not None:  # None: this rank is not in the group (never here)
        work.wait(timeout)


def share(obj: Any, src: int, group: Any) -> Any:
    """``obj`` (given on rank ``src``) on every rank of ``group``: saved with ``torch.save``
    and read back with ``torch.load(weights_only=True)``, so it must be plain data."""
    blob = b""
    if dist.get_rank() == src:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        blob = buffer.getvalue()
    size = torch.tensor([len(blob)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if blob:
        data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    dist.broadcast(data, src, group=group)
    if dist.get_rank() == src:
        return obj
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


# ------------------------------------------------------------------ where tensors land


@dataclass(frozen=True, slots=True)
class Target:
    """Where one tensor of a state lands on this rank: ``tensor``, this rank's own (``own``)
    or a new one."""

    key: str  # its pytree key path
    nbytes: int
    on_device: bool
    tensor: torch.Tensor
    own: bool


def header(tree: Any) -> dict[str, Any]:
    """A state's structure as ranks share it: the tree with every tensor a meta tensor of its
    whole shape (its values that are not tensors as they are), the device type of each
    tensor by key, and the keys of the tensors sharded over the ranks (DTensors)."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    tensors = [(pytree.keystr(p), t) for p, t in leaves if isinstance(t, torch.Tensor)]
    skeleton = pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), tree
    )
    return {
        "tree": skeleton,
        "devices": {key: t.device.type for key, t in tensors},
        "sharded": [key for key, t in tensors if isinstance(t, DTensor)],
    }


def tensor_leaves(skeleton: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``skeleton`` by key path, in its order."""
    leaves, _ = pytree.tree_flatten_with_path(skeleton)
    for path, meta in leaves:
        if isinstance(meta, torch.Tensor):
            yield pytree.keystr(path), meta


def target(
    key: str,
    meta: torch.Tensor,
    device_type: str,
    mine: torch.Tensor | None,
    holding: bool,
    own_device: torch.device,
) -> Target:
    """Where the tensor ``key`` lands here: ``mine`` (this rank's own of that key path)
    where it fits (a holder's must), else a new one on ``own_device`` (or the CPU, for
    tensors that live there)."""
    on_device = device_type != "cpu"
    fits = (
        mine is not None
        and mine.shape == meta.shape
        and mine.dtype == meta.dtype
        and (mine.device.type != "cpu") == on_device
    )
    if holding and not fits:
        raise RuntimeError(
            f"This rank holds the newest step, but its {key} is {_describe(mine)}, not "
            f"{_describe(meta)}: the ranks' states differ in structure (do all ranks "
            "build the same model and optimizer?)."
        )
    if mine is not None and fits and (holding or mine.is_contiguous()):
        return Target(key, meta.nbytes, on_device, mine, True)
    where = own_device if on_device else torch.device("cpu")
    new = torch.empty(meta.shape, dtype=meta.dtype, device=where)
    return Target(key, meta.nbytes, on_device, new, False)


def targets(
    skeleton: Any,
    devices: Mapping[str, str],
    own: Mapping[str, torch.Tensor],
    holding: bool,
    own_device: torch.device,
) -> list[Target]:
    """For each tensor of ``skeleton`` (in its order), where it lands here (:func:`target`)."""
    return [
        target(key, meta, devices.get(key, "cpu"), own.get(key), holding, own_device)
        for key, meta in tensor_leaves(skeleton)
    ]


def _describe(t: torch.Tensor | None) -> str:
    return "missing" if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device.type}"


def fill(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """``skeleton`` with its tensors, in order, replaced by ``tensors``."""
    it = iter(tensors)
    return pytree.tree_map_only(torch.Tensor, lambda _: next(it), skeleton)
