"""Hangs, seen from outside the worker: what each worker says of itself, and who judges.

A worker whose main thread is stuck outside any collective (a DataLoader deadlock, a process
stuck in the CUDA driver after a GPU fault, a C call that holds the GIL, a process stopped)
still looks alive; its peers wait in their next collective until it times out, and then the
healthy ones fail. A watch inside the worker cannot judge it: a frozen process's own threads
cannot run. So the judgment is its agent's (efdl.launcher.hangs), from two things:

- the worker's **beat**: a thread of the worker writes, about once a second, a small file in
  its agent's private directory (:class:`Beat`): when it last made progress (a commit, its
  training function's entry in this generation, or a collective entered: an evaluation that
  all-reduces is progress), its step, its hang timeout, and how many collectives it has
  entered in each process group. A worker that is frozen stops writing it; what it wrote
  last stands;
- its peers' **marks**: a rank that has made no progress for a while marks, on the
  generation's c10d store, how many collectives it has entered in each group
  (``efdl/hang/<group>/<n>``), and raises the group's highest such count
  (``efdl/hang/<group>/top``). A peer stuck inside a collective of a group marks one more
  than a rank of that group that has not entered it. Ranks that all stand still together (a
  checkpoint every rank writes) mark the same counts and judge nobody.

A worker is hung (:func:`judge`) once it has made no progress for its hang timeout while it
trains, and some peer has marked a collective, in a group it shares with it, that it has not
entered: it is the rank the others wait on; its agent kills it, and it is replaced in place.
A worker whose beat has gone silent (its own threads cannot run) may have entered some
collectives after the counts it wrote last: it is hung once a peer stands still past them
(the group's top). Groups are compared one by one: under pipeline or tensor parallelism the
ranks of different groups run different numbers of collectives by design.

The hang timeout is ``--hang-timeout`` (``EFDL_HANG_TIMEOUT``), or by default 90% of the
collective timeout (torch's default, 10 minutes, unless the script sets one), and at least
five times the longest step seen: a rank that holds its peers longer than that would make
their collectives time out anyway, so efdl acts first and replaces the rank that holds the
job, not the ones that wait. So a step slower than usual on one rank while the others wait
(rank 0's evaluation, or its checkpoint save) is allowed what the collective timeout allows;
raise both for longer ones. Nothing is judged during the state sync of a generation (a
newcomer's setup before it, and the transfers in it, make peers wait on purpose), nor while
a worker waits at its fence (efdl.worker.fence).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from efdl.protocol.env import BEAT_DIR_ENV, HANG_TIMEOUT_ENV

log = logging.getLogger(__name__)

STEPS = 5  # the default timeout is at least this many of the longest step seen
SHARE = 0.9  # and 90% of the collective timeout
POLL_S = 1.0  # how often the watch beats (and looks whether to mark)
FROZEN_S = 3 * POLL_S  # a beat older than this: the worker's own threads do not run
MARK_KEY = "efdl/hang/{}/{}"  # on the generation's store: a rank stands inside collective N
TOP = "top"  # MARK_KEY.format(group, TOP): the highest N any rank of the group stood inside


def default_timeout(collective_s: float, longest_step_s: float) -> float:
    """The hang timeout when none is set (see the module docstring)."""
    return max(SHARE * collective_s, STEPS * longest_step_s)


def entered(skip: Any = None) -> dict[str, int]:
    """How many collectives this process has been asked for in each of its process groups
    (by group name, the same on every rank), but ``skip`` (efdl's own side group, used at
    every commit)."""
    import torch.distributed as dist  # the agent reads this module without torch

    counts: dict[str, int] = {}
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is skip:
            continue
        try:
            counts[str(pg.group_name)] = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError):  # a backend without sequence numbers
            continue
    return counts


def beat_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"beat-{pid}.json"


@dataclass(frozen=True, slots=True)
class Beat:
    """What a worker says of itself, for its agent to judge (see the module docstring).

    Attributes:
        at: when it wrote this (monotonic seconds: one clock for every process of a host).
        generation: the generation it trains in.
        step: its last committed step.
        since: when it last made progress (its last commit, or its training function's entry
            in this generation); None while nothing is to be judged (not training: in the
            sync, before or after the training function, or waiting at its fence).
        timeout_s: its hang timeout.
        counts: the collectives it has entered, by process group.
        first: it has not committed in this generation yet (``since`` is its training
            function's entry, after its state was synced at ``step``).
        marked: the count it marked last in each group (its own marks, told from its peers').
    """

    at: float
    generation: int
    step: int
    since: float | None
    timeout_s: float
    counts: Mapping[str, int]
    first: bool = False
    marked: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(
            {**asdict(self), "counts": dict(self.counts), "marked": dict(self.marked)}
        ).encode()

    @staticmethod
    def from_json(raw: bytes) -> Beat:
        """Raises ValueError (or KeyError, TypeError) for anything but a worker's beat."""
        d = json.loads(raw)
        counts, marked = d["counts"], d.get("marked", {})
        for name, value in (("counts", counts), ("marked", marked)):
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in value.items()
            ):
                raise ValueError(f"bad {name}")
        since = d["since"]
        return Beat(
            float(d["at"]),
            int(d["generation"]),
            int(d["step"]),
            None if since is None else float(since),
            float(d["timeout_s"]),
            counts,
            bool(d.get("first", False)),
            marked,
        )


@dataclass(frozen=True, slots=True)
class Hang:
    """A worker judged hung: it holds the job."""

    step: int
    stalled_s: float
    timeout_s: float
    frozen_s: float  # how long its beat has been silent (its own threads cannot run)
    group: str  # a group in which a peer waits in a collective it has not entered
    first: bool = False  # stuck before its first commit of the generation


def judge(
    beat: Beat,
    now: float,
    marks: Callable[[str, int], int],
    top: Callable[[str], int | None] = lambda group: None,
) -> Hang | None:
    """Whether the worker that wrote ``beat`` is hung at ``now`` (see the module docstring).
    ``marks(group, n)``: how many marks ranks made that they stood inside collective ``n`` of
    ``group``; ``top(group)``: the highest such ``n`` (None: none). Pure but for those, which
    are asked only once the worker has made no progress for its timeout.

    A frozen worker (its beat silent) is hung also when a peer stands inside the very
    collective it entered last (a mark at its own count that is not its own): stopped inside
    a collective, it holds the peers that entered it with it."""
    if beat.since is None:
        return None
    stalled = now - beat.since
    if stalled < beat.timeout_s:
        return None
    frozen = max(0.0, now - beat.at)
    for group, count in sorted(beat.counts.items()):
        if marks(group, count + 1) > 0:
            return Hang(beat.step, stalled, beat.timeout_s, frozen, group, beat.first)
        if frozen >= FROZEN_S:  # its counts may be behind: it entered more before it froze
            highest = top(group)
            own = int(beat.marked.get(group) == count)
            if (highest is not None and highest > count) or marks(group, count) > own:
                return Hang(beat.step, stalled, beat.timeout_s, frozen, group, beat.first)
    return None


class HangWatch:
    """This worker's beat and marks (see the module docstring), on a thread of its own.

    Args:
        beat_dir: where to write the beat (its agent's private directory); None: nowhere
            (no agent judges), only the marks.
        collective_s: the collective timeout (seconds).
        timeout_s: the hang timeout; None: the default, from ``collective_s`` and the steps.
        active: whether the main thread trains now (inside the ``@efdl.elastic`` function):
            before and after it (evaluation, saving, exit) nothing is judged.
        clock: monotonic seconds.
        count: the collectives entered per group, but those of the group given
            (:func:`entered`).
    """

    def __init__(
        self,
        beat_dir: str | Path | None,
        collective_s: float,
        timeout_s: float | None = None,
        active: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        count: Callable[[Any], dict[str, int]] = entered,
    ) -> None:
        self._beat_path = beat_path(beat_dir, os.getpid()) if beat_dir is not None else None
        self._active = active
        self._count = count
        self._collective_s = collective_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=64)
        self._last: float | None = None  # the last commit in this generation; None: none yet
        self._since: float | None = None  # when it began to train in it (after the sync)
        self._step = 0
        self._generation = 0
        self._connect: Callable[[], Any] | None = None  # the generation's store, if in one
        self._skip: Any = None
        self._store: Any = None
        self._marked: dict[str, int] = {}
        self._seen: dict[str, int] = {}  # the counts at the last beat
        self._moved: float | None = None  # when the counts last changed (progress too)
        self._paused = False  # the main thread waits on purpose
        self._warned = False  # that the collective timeout is short for the steps
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def from_env(collective_s: float, active: Callable[[], bool] = lambda: True) -> HangWatch:
        """With the agent's directory and ``--hang-timeout``, if any."""
        raw = os.environ.get(HANG_TIMEOUT_ENV, "")
        return HangWatch(
            os.environ.get(BEAT_DIR_ENV), collective_s, float(raw) if raw else None, active
        )

    def timeout_s(self) -> float:
        with self._lock:
            longest = max(self._steps, default=0.0)
        if self._timeout_s is not None:
            return self._timeout_s
        timeout = default_timeout(self._collective_s, longest)
        if timeout > self._collective_s and not self._warned:
            self._warned = True
            log.warning(
                "Steps take up to %.1f s: a peer's collective times out (%.0f s) before a rank "
                "that holds it is taken for hung (%.0f s); raise the collective timeout "
                "(efdl.init_process_group(timeout_s=...)) above five steps.",
                longest,
                self._collective_s,
                timeout,
            )
        return timeout

    def set_collective_timeout(self, seconds: float) -> None:
        self._collective_s = seconds

    def committed(self, step: int) -> None:
        """A commit (the main thread): progress."""
        now = self._clock()
        with self._lock:
            if self._last is not None:
                self._steps.append(now - self._last)
            self._last, self._step = now, step

    def joined(self, connect: Callable[[], Any], skip: Any, generation: int = 0) -> None:
        """This worker is in a new generation: ``connect`` gives a client of its store;
        ``skip`` is efdl's side group. Nothing is judged until it trains in it (trains())."""
        with self._lock:
            self._connect, self._skip, self._generation = connect, skip, generation
            self._store, self._marked, self._last, self._since = None, {}, None, None
            self._seen, self._moved = {}, None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="efdl-hang", daemon=True)
            self._thread.start()

    def trains(self) -> None:
        """The state is synced and the training function called (the main thread): from now
        on, standing still while a peer waits holds the job, before its first commit too."""
        with self._lock:
            if self._connect is not None:
                self._since = self._clock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The main thread stands still on purpose (fenced, efdl.worker.fence): judge nothing
        meanwhile; its clock starts again when it goes on."""
        with self._lock:
            self._paused = True
        self._write_beat()
        try:
            yield
        finally:
            now = self._clock()
            with self._lock:
                self._paused = False
                if self._last is not None:
                    self._last = now
                if self._since is not None:
                    self._since = now

    def left(self) -> None:
        """This worker left its generation (a rescale, a failure): nothing to judge."""
        with self._lock:
            self._connect, self._store, self._last, self._since = None, None, None, None
        self._write_beat()

    def close(self) -> None:
        """Stop (at exit: no store call may be under way while the interpreter ends)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        if self._beat_path is not None:
            with contextlib.suppress(OSError):
                self._beat_path.unlink()

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            self._write_beat()
            try:
                self._mark()
            except Exception as exc:  # the store went with its generation: mark nothing
                log.debug("The hang watch could not mark: %s", exc)
                with self._lock:
                    self._store = None

    def _progress(self) -> float | None:
        """When this rank last made progress in its generation (hold the lock): a commit, its
        training function's entry, or a collective entered (seen at a beat)."""
        if self._last is None and self._since is None:
            return None  # not training in this generation yet: in its sync
        return max(t for t in (self._last, self._since, self._moved) if t is not None)

    def beat(self) -> Beat:
        """What this worker says of itself now (a collective entered since the last beat
        counts as progress)."""
        timeout = self.timeout_s()
        with self._lock:
            judged = self._connect is not None and not self._paused and self._active()
            generation, step, skip = self._generation, self._step, self._skip
            first, marked = self._last is None, dict(self._marked)
        counts = self._count(skip) if judged else {}
        now = self._clock()
        with self._lock:
            if counts and counts != self._seen:
                if self._seen:
                    self._moved = now
                self._seen = counts
            progress = self._progress()
        return Beat(
            now, generation, step, progress if judged else None, timeout, counts, first, marked
        )

    def _write_beat(self) -> None:
        """The beat, to its file (atomically: the agent never reads half of it)."""
        beat = self.beat()  # also where progress by collectives is seen
        if self._beat_path is None:
            return
        try:
            tmp = self._beat_path.with_suffix(".tmp")
            tmp.write_bytes(beat.to_json())
            os.replace(tmp, self._beat_path)
        except OSError as exc:  # the agent's directory is gone: it is gone too
            log.debug("Could not write the beat: %s", exc)

    def _mark(self) -> None:
        """No progress for a while (inside a collective, or not): mark on the generation's
        store how many collectives this rank has entered in each group, and raise the
        group's top to it."""
        timeout = self.timeout_s()
        with self._lock:
            last = self._progress()
            connect, paused = self._connect, self._paused
        if last is None or connect is None or paused or not self._active():
            return
        if self._clock() - last < min(2.0, timeout / 4):
            return
        counts = self._count(self._skip)
        store = self._store or connect()
        with self._lock:
            if self._connect is not connect:  # left the generation meanwhile
                return
            self._store = store
        for group, count in counts.items():
            if self._marked.get(group) != count:
                store.add(MARK_KEY.format(group, count), 1)
                raise_top(store, group, count)
                self._marked[group] = count


def raise_top(store: Any, group: str, count: int) -> None:
    """Make ``group``'s top at least ``count`` (compare-and-set: ranks mark at once)."""
    key, want, expected = MARK_KEY.format(group, TOP), str(count), ""
    for _ in range(16):
        got = store.compare_set(key, expected, want)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got == want or (got.isdigit() and int(got) >= count):
            return
        expected = got


def read_top(store: Any, group: str) -> int | None:
    """``group``'s top on ``store`` (None: no rank of it has marked)."""
    key = MARK_KEY.format(group, TOP)
    if not store.check([key]):
        return None
    raw = store.get(key)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return int(text) if text.isdigit() else None
