"""The agent's judge of its workers' hangs, from outside them (efdl.worker.hang).

Once a second it reads the beat of each of its in-place workers (a file the worker's thread
writes in the agent's private directory) and, for one that has stood still past its hang
timeout, asks the generation's c10d store whether a peer waits in a collective it has not
entered. A worker frozen in a C call that holds the GIL, or stopped, writes no beat: the
last one it wrote stands, and says where it stood. The judge never runs in the process it
judges, so nothing a worker does to itself can keep it from judging.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from efdl.worker.hang import MARK_KEY, POLL_S, Beat, Hang, beat_path, judge, read_top

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_TIMEOUT_S = 2.0  # a generation's store that does not answer in this long is gone


def _connect(host: str, port: int) -> Any:
    """A client of a generation's c10d store (torch imported on first use)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        host,
        port,
        None,
        False,
        datetime.timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )


def hang_text(rank: int, pid: int, h: Hang) -> str:
    """What worker rank ``rank`` (process ``pid``), judged hung, did: a sentence for the log
    and the job's history."""
    frozen = (
        f"; it has been frozen for {h.frozen_s:.0f} s (its own threads do not run: a C call "
        "that holds the GIL, or a stopped process)"
        if h.frozen_s >= 3 * POLL_S
        else ""
    )
    since = f"since its state was synced at step {h.step}" if h.first else f"after step {h.step}"
    return (
        f"worker rank {rank} (pid {pid}) made no step for {h.stalled_s:.0f} s "
        f"{since} while a peer waited on it in a collective of group {h.group} (hang "
        f"timeout {h.timeout_s:.0f} s){frozen}"
    )


class HangJudge:
    """Judges this agent's in-place workers (see the module docstring), on its own thread.

    Args:
        directory: where the workers write their beats.
        workers: the pids of the in-place workers to judge now (called from the judge's
            thread: a snapshot, never the agent's live collections).
        store_of: the c10d store (host, port) of a generation this node's workers train
            in, or None if it is not the current one (no judgment then).
        on_hung: called (from the judge's thread, once per worker) with a hung worker's pid
            and the verdict.
        clock: monotonic seconds (the workers' beats use the same clock).
        connect: makes a store client (tests give their own).
    """

    def __init__(
        self,
        directory: Path,
        workers: Callable[[], Collection[int]],
        store_of: Callable[[int], tuple[str, int] | None],
        on_hung: Callable[[int, Hang], None],
        clock: Callable[[], float] = time.monotonic,
        connect: Callable[[str, int], Any] = _connect,
    ) -> None:
        self._dir = directory
        self._workers = workers
        self._store_of = store_of
        self._on_hung = on_hung
        self._clock = clock
        self._connect = connect
        self._stores: dict[tuple[str, int], Any] = {}
        self._judged: set[int] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="efdl-hang-judge", daemon=True)

    def start(self) -> HangJudge:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def forget(self, pid: int) -> None:
        """Worker ``pid`` exited: drop its beat."""
        with contextlib.suppress(OSError):
            beat_path(self._dir, pid).unlink()

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                self.look()
            except Exception:  # never let one bad look end the judge
                log.exception("The hang judge could not look at the workers.")

    def look(self) -> None:
        """Judge every in-place worker once."""
        for pid in self._workers():
            if pid in self._judged:
                continue
            beat = self._read(pid)
            if beat is None:
                continue
            marked, top = self._marks(beat.generation)
            verdict = judge(beat, self._clock(), marked, top)
            if verdict is not None:
                self._judged.add(pid)
                self._on_hung(pid, verdict)

    def _read(self, pid: int) -> Beat | None:
        try:
            return Beat.from_json(beat_path(self._dir, pid).read_bytes())
        except FileNotFoundError:
            return None  # not beating yet (an older worker, or one that just started)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("Ignoring worker %d's unreadable beat: %s", pid, exc)
            return None

    def _marks(
        self, generation: int
    ) -> tuple[Callable[[str, int], int], Callable[[str], int | None]]:
        """What the ranks of ``generation`` marked on its store: how many marks say a rank
        stood inside collective ``n`` of a group, and the highest ``n`` of a group; nothing
        where the store cannot be asked."""

        def ask(fn: Callable[[Any], T], default: T) -> T:
            where = self._store_of(generation)
            if where is None:
                return default
            try:
                store = self._stores.get(where)
                if store is None:
                    self._stores = {where: self._connect(*where)}  # one generation at a time
                    store = self._stores[where]
                return fn(store)
            except Exception as exc:  # the generation's store is gone: judge nothing
                log.debug("Could not read generation %d's marks: %s", generation, exc)
                self._stores.pop(where, None)
                return default

        def marks(group: str, n: int) -> int:
            return ask(lambda store: int(store.add(MARK_KEY.format(group, n), 0)), 0)

        def top(group: str) -> int | None:
            return ask(lambda store: read_top(store, group), None)

        return marks, top
