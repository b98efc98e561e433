"""Asynchronous persistence: at a persisted commit every rank writes its share, in parallel.

Every rank persists the same step (the decision travels in the per-commit agreement) and
holds the same replicated state, so each cuts the state's tensors, in key-path order, into
the same parts of at most ``part_bytes`` and writes the parts assigned to it
(:func:`split_parts`, :func:`assign_parts`): the ranks write in parallel, each copying and
writing about ``1/world`` of the state. A sharded model's
tensors (FSDP2's DTensors) are not replicated: each rank writes its own rows of them, in
parts of its own, and the structure records which part holds each rank's rows, so that a job
of any world size can read them back laid out anew (efdl.worker.resume). Then:

- each rank writes its own file (its RNG states) and a report of what it wrote;
- rank 0 also writes the state's structure (``state.pt``), waits for every rank's report on
  the storage itself (a rescale may end the generation, and its store, in between; the wait
  is bounded), and writes the manifest. A rank that died before reporting leaves the
  snapshot incomplete: no manifest, and the next due commit tries again.

What the training loop waits for: the model's buffers (BatchNorm statistics change in the
forward pass) are copied at the commit. Parameters and optimizer state are copied to CPU
buffers by a copier thread, part by part, while the next step's forward and backward run
(neither changes them), each part written as soon as it is copied; the next
``optimizer.step()`` waits until the copy is done (a step
pre-hook; ``state.fence()`` for code that changes parameters elsewhere). On a GPU the copies
are non-blocking device-to-host copies into pinned buffers, on a CUDA stream of their own,
ordered after the committed step by an event: they neither wait for later kernels nor hold
them up.

At most one snapshot is in flight; memory is one CPU copy of this rank's share, its buffers
reused from one snapshot to the next.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from efdl.worker import sharded
from efdl.worker.cache import (
    STATE,
    CacheSettings,
    FileInfo,
    Manifest,
    SnapshotStorage,
    part_file,
    rank_file,
)
from efdl.worker.fence import Fence
from efdl.worker.layout import Layout as RowLayout
from efdl.worker.layout import byte_span

log = logging.getLogger(__name__)

PART_BYTES = 512 << 20  # the largest part (a larger tensor is a part by itself)
MIN_PART_BYTES = 16 << 20  # parts are no smaller than this, however many ranks share the work
WRITERS = 4  # parts of one rank written at once (a disk takes several streams faster than one)
STATS = 1000  # snapshots whose duration and size a writer keeps (benchmarks read them)
REPORT_WAIT_S = 30.0  # rank 0 waits this long for the other ranks' reports, plus 3x its write


@dataclass(frozen=True, slots=True)
class Cut:
    """How a state tree is cut into parts, the same on every rank: the replicated tensors
    into parts shared out over the ranks, and each rank's rows of the sharded tensors
    (FSDP2) into parts of its own."""

    keys: list[str]  # replicated tensors' key paths, sorted
    part_of: list[int]  # per replicated tensor, its part
    owner: list[int]  # per part, the rank that writes it
    rows: dict[str, list[int]]  # sharded tensor's key path -> per rank, the part of its rows

    @staticmethod
    def of(
        sizes: Mapping[str, int],
        world: int,
        part_bytes: int = PART_BYTES,
        row_sizes: Mapping[str, Sequence[int]] | None = None,
    ) -> Cut:
        """Args:
        sizes: the replicated tensors' sizes by key path.
        row_sizes: the sharded tensors' rows' sizes by key path, per rank.
        """
        keys = sorted(sizes)
        total = sum(sizes.values())
        target = min(part_bytes, max(MIN_PART_BYTES, math.ceil(total / world)))
        parts = split_parts([sizes[k] for k in keys], target)
        part_of = [0] * len(keys)
        for p, members in enumerate(parts):
            for i in members:
                part_of[i] = p
        part_sizes = [sum(sizes[keys[i]] for i in members) for members in parts]
        owner = assign_parts(part_sizes, world)
        row_sizes = row_sizes or {}
        split = sorted(row_sizes)
        rows: dict[str, list[int]] = {k: [0] * world for k in split}
        for r in range(world):
            sized = [row_sizes[k][r] for k in split]
            # Several parts, for the rank's writers to write at once and a reader to load
            # one at a time (a part is twice in memory while it loads).
            size = min(part_bytes, max(MIN_PART_BYTES, math.ceil(sum(sized) / WRITERS)))
            for members in split_parts(sized, size):
                for i in members:
                    rows[split[i]][r] = len(owner)
                owner.append(r)
        return Cut(keys, part_of, owner, rows)


def split_parts(sizes: Sequence[int], part_bytes: int) -> list[list[int]]:
    """Consecutive leaves packed into parts of at most ``part_bytes`` (a larger leaf is a part
    by itself). Pure."""
    parts: list[list[int]] = []
    size = part_bytes  # start a new part at the first leaf
    for i, n in enumerate(sizes):
        if size + n > part_bytes or not parts:
            parts.append([])
            size = 0
        parts[-1].append(i)
        size += n
    return parts


def assign_parts(sizes: Sequence[int], ranks: int) -> list[int]:
    """Which rank writes each part: the largest parts first, each to the rank with the fewest
    bytes so far (lowest rank on ties), so the ranks' writes take about as long. Pure."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _row_sizes(t: torch.Tensor, world: int) -> list[int]:
    """The bytes of each rank's rows of a tensor sharded over ``world`` ranks."""
    spans = (byte_span(t.shape, t.element_size(), RowLayout(world, r)) for r in range(world))
    return [end - start for start, end in spans]


@dataclass(slots=True)
class _Job:
    """One snapshot being written by this rank."""

    step: int
    epoch: int | None
    rank: int
    world: int
    parts: dict[str, dict[str, torch.Tensor]]  # this rank's part files: key path -> buffer
    copies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]  # part -> (buffer, source)
    own: dict[str, Any]
    structure: dict[str, Any] | None  # rank 0: what state.pt holds
    expected: set[str]  # rank 0: every part file of the snapshot
    on_done: Callable[[Manifest], None]
    step_done: Any = None  # a CUDA event: the committed step's kernels are done
    attempt: int = 0  # this writing of the snapshot (efdl.worker.cache)
    generation: int = 0  # the generation that writes it (Manifest.generation)
    started: float = field(default_factory=time.perf_counter)


class Persister:
    """This rank's background writer.

    Args:
        settings: where and how often.
        part_bytes: the largest part file (tests make it small).
        fence: this worker's fence (efdl.worker.fence): no manifest is written once it has
            closed, so a generation cut off from etcd completes no snapshot its successor
            could resume from or be overtaken by.
        storage: where to write (default: ``settings.url``'s storage).
    """

    def __init__(
        self,
        settings: CacheSettings,
        part_bytes: int = PART_BYTES,
        fence: Fence | None = None,
        storage: SnapshotStorage | None = None,
    ) -> None:
        self.settings = settings
        self.part_bytes = part_bytes
        self._fence = fence
        self.storage = storage if storage is not None else SnapshotStorage(settings.url)
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied = threading.Event()
        self._copied.set()
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self._last_step = 0
        self._writing = 0  # the step of the snapshot being (or last) written
        self._last_time = time.monotonic()
        self.last_persisted: int | None = None
        self.blocked_s = 0.0  # time the training loop spent waiting for copies (for benchmarks)
        # Per snapshot, for benchmarks: seconds from the commit to this rank's report (rank 0:
        # to the manifest, the snapshot complete), and the bytes this rank wrote.
        self.durations: collections.deque[float] = collections.deque(maxlen=STATS)
        self.written: collections.deque[int] = collections.deque(maxlen=STATS)

    def due(self, step: int, pipelined: bool = False) -> bool:
        """Whether ``step`` should be persisted (by count or time), the writer being free.

        Args:
            pipelined: the decision is for the next commit's step (the agreement carries it
                there), and a snapshot begun at this commit does not count as busy: it has
                a step to finish (efdl.worker.peers copies every commit so).
        """
        s = self.settings
        counted = step + 1 if pipelined else step
        by_count = s.every_steps > 0 and counted - self._last_step >= s.every_steps
        by_time = s.every_s > 0 and time.monotonic() - self._last_time >= s.every_s
        free = not self.busy_before(step) if pipelined else not self.busy
        return (by_count or by_time) and free

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def count_from(self, step: int) -> None:
        """The next snapshot is due ``every_steps`` after ``step`` (the step held after a
        sync, which a resume may have taken back before the last snapshot's)."""
        self._last_step = min(self._last_step, step)
        self._writing = min(self._writing, step)  # one still being written is an old one

    def busy_before(self, step: int) -> bool:
        """Still writing a snapshot begun at a commit before ``step``'s (one begun at this
        very commit has had no time yet)."""
        return self.busy and self._writing < step

    def skip(self, step: int, rank: int, attempt: int) -> None:
        """This rank writes nothing of snapshot ``step`` in ``attempt`` (its writer is still
        busy with the last one): it reports no files, in the background, so that rank 0 gives
        the snapshot up at once instead of waiting for this rank's report."""
        if rank == 0:
            return

        def report() -> None:
            try:
                self.storage.report(step, rank, {}, attempt)
            except Exception as exc:  # rank 0 then waits out its deadline
                log.info("Could not report skipping step %d: %s", step, exc)

        threading.Thread(target=report, name="efdl-persist-skip", daemon=True).start()

    def fence(self) -> None:
        """Wait until the last snapshot's tensors are copied (before they change)."""
        if not self._copied.is_set():
            t0 = time.perf_counter()
            self._copied.wait()
            self.blocked_s += time.perf_counter() - t0

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the snapshot in flight; True if none is left."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.busy

    def start(
        self,
        step: int,
        epoch: int | None,
        rank: int,
        world: int,
        tree: dict[str, Any],
        copy_now: set[str],
        own: dict[str, Any],
        on_done: Callable[[Manifest], None],
        attempt: int = 0,
        generation: int = 0,
    ) -> None:
        """Persist ``step``: this rank's share of ``tree`` (the replicated state, tensors by
        reference), and ``own`` (what is this rank's alone, already a private copy).

        Args:
            attempt: this writing's number, the same on every rank (efdl.worker.cache).
            generation: the generation whose ranks write it (efdl.worker.cache.Manifest).
            copy_now: key paths of tensors the next forward pass changes (the model's
                buffers): copied now rather than in the background.
            on_done: called on rank 0 with the manifest once the snapshot is complete.
        """
        self.fence()
        self._last_step, self._last_time = step, time.monotonic()
        self._writing = step
        leaves, _ = pytree.tree_flatten_with_path(tree)
        tensors = {pytree.keystr(p): t for p, t in leaves if isinstance(t, torch.Tensor)}
        split = {k: t for k, t in tensors.items() if isinstance(t, DTensor)}
        cut = Cut.of(
            {k: t.nbytes for k, t in tensors.items() if k not in split},
            world,
            self.part_bytes,
            {k: _row_sizes(t, world) for k, t in split.items()},
        )
        mine = [
            (key, p, tensors[key])
            for key, p in zip(cut.keys, cut.part_of, strict=True)
            if cut.owner[p] == rank
        ]
        mine += [(key, cut.rows[key][rank], sharded.local(t)) for key, t in split.items()]
        parts: dict[str, dict[str, torch.Tensor]] = {}
        copies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        buffers: dict[str, torch.Tensor] = {}
        for key, p, tensor in mine:
            src = tensor.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            buffers[key] = buf
            parts.setdefault(part_file(p), {})[key] = buf
            if key in copy_now:
                buf.copy_(src)
            else:
                copies.setdefault(part_file(p), []).append((buf, src))
        self._buffers = buffers  # a share no longer this rank's is freed
        structure = None
        if rank == 0:
            names = {k: part_file(p) for k, p in zip(cut.keys, cut.part_of, strict=True)}
            devices = {k: t.device.type for k, t in tensors.items()}
            skeleton = pytree.tree_map(
                lambda x: (
                    torch.empty(x.shape, dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor)
                    else copy.deepcopy(x)
                ),
                tree,
            )
            structure = {
                "tree": skeleton,
                "parts": names,
                "rows": {k: [part_file(p) for p in ps] for k, ps in cut.rows.items()},
                "devices": devices,
            }
        job = _Job(
            step,
            epoch,
            rank,
            world,
            parts,
            copies,
            own,
            structure,
            {part_file(p) for p in range(len(cut.owner))},
            on_done,
            attempt=attempt,
            generation=generation,
        )
        if any(src.is_cuda for pairs in copies.values() for _, src in pairs):
            job.step_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            job.step_done.record()
        self._copied.clear()
        self._thread = threading.Thread(
            target=self._write, args=(job,), name=f"efdl-persist-{step}", daemon=True
        )
        self._thread.start()

    def _copy(self, job: _Job, copied: dict[str, threading.Event]) -> None:
        """The copier thread: this rank's parts to their CPU buffers, part by part (each
        written as soon as it is copied), then the fence opens."""
        try:
            with torch.no_grad():
                for name in sorted(job.parts):
                    pairs = job.copies.get(name, [])
                    if job.step_done is None:
                        for buf, src in pairs:
                            buf.copy_(src)
                    else:
                        if self._stream is None:
                            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                        with torch.cuda.stream(self._stream):
                            self._stream.wait_event(job.step_done)
                            for buf, src in pairs:
                                buf.copy_(src, non_blocking=True)
                        self._stream.synchronize()
                    copied[name].set()
        finally:
            self._copied.set()
            for done in copied.values():
                done.set()

    def _write(self, job: _Job) -> None:
        storage = self.storage
        copied = {name: threading.Event() for name in job.parts}
        copier = threading.Thread(
            target=self._copy, args=(job, copied), name=f"efdl-copy-{job.step}", daemon=True
        )
        copier.start()
        try:

            def write_part(name: str) -> FileInfo:
                copied[name].wait()  # copying the next part while this one is written
                return storage.write(job.step, name, job.parts[name], sync=False)

            names = sorted(job.parts)
            with concurrent.futures.ThreadPoolExecutor(WRITERS, "efdl-write") as pool:
                files = dict(zip(names, pool.map(write_part, names), strict=True))
            files[rank_file(job.rank)] = storage.write(job.step, rank_file(job.rank), job.own)
            storage.sync(job.step, job.parts)  # on disk before it is reported
            took = time.perf_counter() - job.started
            self.written.append(sum(f.size for f in files.values()))
            if job.rank != 0:
                storage.report(job.step, job.rank, files, job.attempt)
                self.durations.append(time.perf_counter() - job.started)
                return
            assert job.structure is not None
            files[STATE] = storage.write(job.step, STATE, job.structure)
            others = self._gather(job, REPORT_WAIT_S + 3 * took)
            if others is None:
                return
            files.update(others)
            missing = sorted(job.expected - set(files))
            if missing:
                log.warning(
                    "Step %d is not persisted: no rank wrote %s.", job.step, ", ".join(missing[:3])
                )
                return
            if self._fence is not None and not self._fence.open():
                log.warning(
                    "Step %d is not persisted: this rank's agent has not reached etcd for "
                    "longer than its fence timeout (the generation may have been replaced).",
                    job.step,
                )
                return
            manifest = Manifest(job.step, job.epoch, job.world, files, generation=job.generation)
            storage.commit(manifest)
            self.durations.append(time.perf_counter() - job.started)
            self.last_persisted = job.step
            storage.prune(self.settings.keep, written=job.step)
            job.on_done(manifest)
        except Exception as exc:  # storage trouble must not stop training
            log.warning(
                "Persisting step %d to %s failed: %s",
                job.step,
                self.settings.url,
                exc,
                exc_info=True,
            )
        finally:
            copier.join()  # the fence is open in any case

    def _gather(self, job: _Job, wait_s: float) -> dict[str, FileInfo] | None:
        """Rank 0: every other rank's report of ``job``'s step in ``job``'s attempt, read from
        storage (polled: storage has no watch; off the training path and bounded by
        ``wait_s``). Each poll lists the snapshot's directory once and reads only the reports
        there of ranks still awaited; a report of another attempt (a crashed run's) is read as
        not there yet."""
        deadline = time.monotonic() + wait_s
        waiting = set(range(1, job.world))
        files: dict[str, FileInfo] = {}
        pause = 0.005  # the others finish about when this rank does: look again soon, then less
        while True:
            for r in sorted(waiting & self.storage.reporters(job.step)):
                found = self.storage.reported(job.step, r, job.attempt)
                if found is not None:
                    files.update(found)
                    waiting.discard(r)
            if not waiting:
                return files
            if time.monotonic() > deadline:
                log.warning(
                    "Step %d is not persisted: rank(s) %s did not report within %.0f s.",
                    job.step,
                    ", ".join(map(str, sorted(waiting)[:5])),
                    wait_s,
                )
                return None
            time.sleep(pause)
            pause = min(0.2, pause * 2)
