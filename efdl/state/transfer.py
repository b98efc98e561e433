"""Moving tensors between ranks: only to those who lack them, in bounded messages, in place.

After a rebuild some ranks hold the newest committed state (the holders) and the others do
not (newcomers, ranks a step behind, ranks whose update was torn). Only the latter receive,
every tensor straight into their own tensor of the same name (or a new one where they have
none yet), on its own device, in messages of at most ``bucket`` bytes:

- a tensor goes by itself, straight from the sender's tensor into the receiver's (no copy),
  as several messages, each a slice of it, if it is larger than a bucket; several such
  messages are in flight at once;
- tensors under a megabyte are packed into one bucket (one copy on each side), one bucket at
  a time.

So the memory a transfer adds on either side is at most one bucket, and no message is so
large that it could outlast the collective timeout. Message ``j`` for the ``i``-th rank that
needs it comes from holder ``(j + i) mod len(holders)``: with several holders, the sending is
spread over them. Every rank walks the (message, receiver) pairs in one global order, sending
or receiving those that are its own, so two ranks can never wait on each other in a cycle.

Links: CPU tensors travel over the CPU (gloo) side group; device tensors over the training
group when it is NCCL, and staged through a host bucket over the side group otherwise (gloo's
point-to-point operations take host memory only).

The planning (:func:`plan`, :func:`routes`) is pure; :func:`move` does the I/O.
"""

from __future__ import annotations

import datetime
import io
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

DEFAULT_BUCKET = 64 << 20  # bytes; EFDL_SYNC_BUCKET_MB overrides it
PACK_BELOW = 1 << 20  # smaller tensors are packed together; larger ones go by themselves
WINDOW = 8  # point-to-point operations in flight at once (on their own tensors: no copy)


@dataclass(frozen=True, slots=True)
class Leaf:
    """A tensor to move: its size, where it lives, and which ranks hold it already."""

    nbytes: int
    on_device: bool
    holders: tuple[int, ...]


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
    """One point-to-point send: pieces of leaves that share holders and a link."""

    on_device: bool
    holders: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True, slots=True)
class Route:
    message: int
    src: int
    dst: int


def plan(leaves: Sequence[Leaf], bucket: int) -> list[Message]:
    """Cut ``leaves`` into messages of at most ``bucket`` bytes: a leaf of ``PACK_BELOW`` bytes
    or more by itself (in slices if larger than a bucket), smaller ones packed together.
    Leaves of different holders or links never share a message; empty leaves need none. Pure
    and deterministic: every rank computes the same plan from the same leaves."""
    if bucket < 1:
        raise ValueError(f"The transfer bucket must be at least 1 byte (got {bucket}).")
    groups: dict[tuple[bool, tuple[int, ...]], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.nbytes:
            groups.setdefault((leaf.on_device, leaf.holders), []).append(i)
    out: list[Message] = []
    for (on_device, holders), members in groups.items():
        packs: list[list[Piece]] = [[]]
        size = 0
        for i in members:
            n = leaves[i].nbytes
            if n >= min(bucket, PACK_BELOW):  # alone, in slices
                packs += [[Piece(i, a, min(n, a + bucket))] for a in range(0, n, bucket)]
                packs.append([])
                size = 0
                continue
            if size + n > bucket:
                packs.append([])
                size = 0
            packs[-1].append(Piece(i, 0, n))
            size += n
        out += [Message(on_device, holders, tuple(p)) for p in packs if p]
    return out


def routes(messages: Sequence[Message], needy: Sequence[int]) -> Iterator[Route]:
    """Every (message, receiver) pair in the one global order, with the holder that sends it:
    for each receiver, the holder that has sent it the fewest bytes so far (ties: in turn), so
    the holders share the sending by bytes. A needy rank that holds a message's leaves already
    does not receive it."""
    load: dict[tuple[int, int], int] = {}  # (receiver, holder) -> bytes so far
    for j, m in enumerate(messages):
        receivers = [r for r in needy if r not in m.holders]
        for i, dst in enumerate(receivers):
            n = len(m.holders)
            turn = [m.holders[(j + i + k) % n] for k in range(n)]
            src = min(turn, key=lambda h: load.get((dst, h), 0))
            load[(dst, src)] = load.get((dst, src), 0) + m.nbytes
            yield Route(j, src, dst)


def fan_out(messages: Sequence[Message], needy: Sequence[int]) -> int:
    """The most receivers one holder serves for one message: a receiver may wait that many
    sends for its own, so each operation's timeout is the collective timeout times this."""
    most = 1
    for m in messages:
        receivers = sum(1 for r in needy if r not in m.holders)
        most = max(most, math.ceil(receivers / len(m.holders)))
    return most


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


def move(
    messages: Sequence[Message],
    needy: Sequence[int],
    tensors: Sequence[torch.Tensor | None],
    links: dict[bool, Link],
    timeout: datetime.timedelta,
    fresh: Sequence[bool] = (),
) -> Moved:
    """Send and receive this rank's share of ``messages``.

    Args:
        messages: the plan (:func:`plan`), the same on every rank.
        needy: the ranks that receive what they do not hold.
        tensors: per leaf, this rank's tensor: the data where it holds the leaf, the
            destination (contiguous, of the leaf's size) where it needs it; None where
            neither.
        links: per ``on_device``, how such tensors travel.
        timeout: the collective timeout; each operation may take :func:`fan_out` times it.
        fresh: per leaf, whether this rank's tensor is new host memory (touched on a helper
            thread before it is received into).
    """
    me = dist.get_rank()
    started = time.perf_counter()
    per_op = timeout * fan_out(messages, needy)
    mine = [r for r in routes(messages, needy) if me in (r.src, r.dst)]
    incoming = dict.fromkeys(
        p.leaf for r in mine if r.dst == me for p in messages[r.message].pieces
    )
    prefault = _Prefault(
        [
            (leaf, t)
            for leaf in incoming
            if leaf < len(fresh) and fresh[leaf] and (t := tensors[leaf]) is not None
        ]
    )
    staging: dict[torch.device, torch.Tensor] = {}
    flat: dict[int, torch.Tensor] = {}  # leaf -> its bytes (a contiguous copy if need be)
    sent = received = 0

    def bytes_of(leaf: int) -> torch.Tensor:
        if leaf not in flat:
            t = tensors[leaf]
            if t is None:
                raise RuntimeError(f"Tensor {leaf} of the transfer is missing on rank {me}.")
            flat[leaf] = _bytes(t if t.is_contiguous() else t.contiguous())
        return flat[leaf]

    def bucket(link: Link, n: int) -> torch.Tensor:
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
        direct = len(pieces) == 1 and bytes_of(pieces[0].leaf).device.type == link.staging.type
        if direct:  # the tensor's own bytes: no copy, several in flight
            view = bytes_of(pieces[0].leaf)[pieces[0].start : pieces[0].end]
            if route.src == me:
                post(dist.isend(view, route.dst, group=link.group))
            else:
                prefault.wait(pieces[0].leaf)
                post(dist.irecv(view, route.src, group=link.group))
        elif route.src == me:  # packed or staged through the one bucket: one at a time
            data = bucket(link, m.nbytes)
            offset = 0
            for p in pieces:
                data[offset : offset + p.nbytes].copy_(bytes_of(p.leaf)[p.start : p.end])
                offset += p.nbytes
            _wait(dist.isend(data, route.dst, group=link.group), per_op)
        else:
            data = bucket(link, m.nbytes)
            _wait(dist.irecv(data, route.src, group=link.group), per_op)
            offset = 0
            for p in pieces:
                prefault.wait(p.leaf)
                bytes_of(p.leaf)[p.start : p.end].copy_(data[offset : offset + p.nbytes])
                offset += p.nbytes
        if route.src == me:
            sent += m.nbytes
        else:
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
    """A state's structure as ranks share it: the tree with every tensor a meta tensor (its
    values that are not tensors as they are), and the device type of each tensor by key."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    devices = {pytree.keystr(p): t.device.type for p, t in leaves if isinstance(t, torch.Tensor)}
    skeleton = pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), tree
    )
    return {"tree": skeleton, "devices": devices}


def targets(
    skeleton: Any,
    devices: Mapping[str, str],
    own: Mapping[str, torch.Tensor],
    holding: bool,
    own_device: torch.device,
) -> list[Target]:
    """For each tensor of ``skeleton`` (in its order), where it lands here: this rank's own
    tensor of that key path where it fits (a holder's must), else a new one on
    ``own_device`` (or the CPU, for tensors that live there)."""
    out = []
    leaves, _ = pytree.tree_flatten_with_path(skeleton)
    for path, meta in leaves:
        if not isinstance(meta, torch.Tensor):
            continue
        key = pytree.keystr(path)
        on_device = devices.get(key, "cpu") != "cpu"
        mine = own.get(key)
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
            out.append(Target(key, meta.nbytes, on_device, mine, True))
        else:
            where = own_device if on_device else torch.device("cpu")
            new = torch.empty(meta.shape, dtype=meta.dtype, device=where)
            out.append(Target(key, meta.nbytes, on_device, new, False))
    return out


def _describe(t: torch.Tensor | None) -> str:
    return "missing" if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device.type}"


def fill(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """``skeleton`` with its tensors, in order, replaced by ``tensors``."""
    it = iter(tensors)
    return pytree.tree_map_only(torch.Tensor, lambda _: next(it), skeleton)
