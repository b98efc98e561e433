"""Asynchronous persistence: a commit hands its state to a background writer and returns.

At most one snapshot is in flight. While one is being written, later commits are not queued
(there is nothing to replace: the next due commit after it is the newest), so memory stays
bounded: one CPU copy of the model and optimizer state, whose buffers are reused from one
snapshot to the next.

What the training loop waits for: small values (step, sampler, user values, scheduler) and
the model's buffers (BatchNorm statistics change in the forward pass) are copied at the
commit. Parameters and optimizer state are copied to the CPU by the writer's thread while the
next step's forward and backward run (neither changes them), and the next
``optimizer.step()`` waits until that copy is done (a step pre-hook). Code that changes
parameters in place outside the optimizer between a commit and the next step must call
``state.fence()`` first.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from efdl.state.cache import STATE, CacheSettings, FileInfo, Manifest, SnapshotStore, rank_file

log = logging.getLogger(__name__)

Collect = Callable[[int, str, FileInfo], dict[str, FileInfo]]


class Persister:
    """This rank's background writer.

    Args:
        settings: where and how often.
    """

    def __init__(self, settings: CacheSettings) -> None:
        self.settings = settings
        self.store = SnapshotStore(settings.url)
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied = threading.Event()
        self._copied.set()
        self._thread: threading.Thread | None = None
        self._last_step = 0
        self._last_time = time.monotonic()
        self._started = 0.0
        self.last_persisted: int | None = None
        self.blocked_s = 0.0  # time the training loop spent waiting for copies (for benchmarks)
        self.durations: list[float] = []  # start to manifest, per snapshot (for benchmarks)

    def due(self, step: int) -> bool:
        """Whether ``step`` should be persisted (by count or time), the writer being free."""
        s = self.settings
        by_count = s.every_steps > 0 and step - self._last_step >= s.every_steps
        by_time = s.every_s > 0 and time.monotonic() - self._last_time >= s.every_s
        return (by_count or by_time) and not self.busy

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
        world: int,
        rank: int,
        tree: dict[str, Any] | None,
        sync_paths: set[str],
        own: dict[str, Any],
        collect: Collect,
        on_done: Callable[[Manifest], None],
    ) -> None:
        """Persist ``step``: ``tree`` (rank 0: the replicated state, tensors by reference;
        None elsewhere) and ``own`` (this rank's shard, already a private copy). ``collect``
        reports this rank's file and, on rank 0, returns every rank's files that came."""
        self.fence()
        self._last_step, self._last_time = step, time.monotonic()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        cpu_tree = self._stage(tree, "", sync_paths, pairs) if tree is not None else None
        self._copied.clear()
        self._started = time.perf_counter()
        self._thread = threading.Thread(
            target=self._write,
            args=(step, epoch, world, rank, cpu_tree, pairs, own, collect, on_done),
            name=f"efdl-persist-{step}",
            daemon=True,
        )
        self._thread.start()

    def _stage(
        self,
        obj: Any,
        path: str,
        sync_paths: set[str],
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> Any:
        """``obj`` with every tensor replaced by its (reused) CPU buffer; the copies to make
        go to ``pairs``, except for ``sync_paths``, copied now."""
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(
                    src.shape, dtype=src.dtype, pin_memory=src.is_cuda and torch.cuda.is_available()
                )
                self._buffers[path] = buf
            if path in sync_paths:
                buf.copy_(src)
            else:
                pairs.append((buf, src))
            return buf
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{path}/{k}", sync_paths, pairs) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            items = [self._stage(v, f"{path}/{i}", sync_paths, pairs) for i, v in enumerate(obj)]
            return type(obj)(items)
        return copy.deepcopy(obj)

    def _write(
        self,
        step: int,
        epoch: int | None,
        world: int,
        rank: int,
        cpu_tree: Any,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        own: dict[str, Any],
        collect: Collect,
        on_done: Callable[[Manifest], None],
    ) -> None:
        try:
            try:
                with torch.no_grad():
                    for buf, src in pairs:
                        buf.copy_(src)
            finally:
                self._copied.set()
            files: dict[str, FileInfo] = {}
            if cpu_tree is not None:
                files[STATE] = self.store.write(step, STATE, cpu_tree)
            name = rank_file(rank)
            info = self.store.write(step, name, own)
            files.update(collect(step, name, info))
            if rank != 0:
                return
            files[name] = info
            manifest = Manifest(step, epoch, world, files)
            self.store.commit(manifest)
            self.last_persisted = step
            self.durations.append(time.perf_counter() - self._started)
            self.store.prune(self.settings.keep)
            on_done(manifest)
        except Exception as exc:  # storage trouble must not stop training
            log.warning(
                "Persisting step %d to %s failed: %s", step, self.settings.url, exc, exc_info=True
            )
