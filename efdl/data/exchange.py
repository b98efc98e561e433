"""A rank's DataLoader workers share the windows they decode: each is decoded once.

Every batch of a step holds rows of all of a rank's lanes, and DataLoader worker ``w`` of
``n`` makes the batches of steps ``w, w + n, ...``. Were each worker to read every lane, the
rank would read and decode its data ``n`` times. Instead worker ``w`` reads its own group of
the rank's lanes (neighbours together: they share the row groups they meet in) and gives
each window it decodes to the workers whose steps take rows of it (:class:`Exchange`).

A window goes through a file in shared memory (``/dev/shm`` where there is one). Each owner
keeps a pool of such files, mapped once: it writes a window into a free one (a copy into
memory already there: no allocation, no fault), then links it once under each taker's name.
A taker maps the file once too (its mapping is kept for the file's next windows), reads the
window in place, and removes its name when its steps are done with the window's block
(:meth:`Exchange.release`); a file whose names are all gone is free again. The pool grows
while every file is in use (a taker behind), and goes with its iteration's directory, as
does a name nobody took (an iteration left before its end; :func:`sweep`).

The directory goes when every one of the loader's workers has closed its side (each marks
it), not when the last of those that began does: a worker may begin after the others gave
it all its windows and closed (near an epoch's end an iteration's steps are few, and the
first batch of the worker slowest to start is the last one asked for).

Only this user's processes may write a window: what a taker reads becomes its rows (and a
reader function's samples are unpickled). An iteration's directory is made with mode 0700
and checked (with ``lstat``: a directory, not a symbolic link, of this user, open to no
other) before use, also when another worker made it; a window is opened without following a
link and read only if it is a regular file of this user that no other can write
(:class:`SharedDirectoryError` otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from efdl.data.shards import Source
from efdl.errors import DataSourceError, EfdlError
from efdl.protocol.env import DATA_SHM_ENV

# How long a worker waits for another's window. A worker that dies makes the DataLoader
# fail within seconds; this bounds a worker that hangs (a read that never returns).
WAIT_S = 600.0
_PREFIX = "efdl-stream-"
_LOOK_S = 0.05  # how often a waiting worker looks whether the owner left


class SharedDirectoryError(EfdlError, PermissionError):
    """The directory of a rank's DataLoader workers' windows, or a window in it, is not this
    user's alone: another user could have made it, or written what a worker would read."""


def base() -> Path:
    """Where the windows go: ``EFDL_DATA_SHM`` if set, else shared memory if the machine has
    it, else the temp folder."""
    chosen = os.environ.get(DATA_SHM_ENV)
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def token() -> str:
    """A new stream's: its process and a random part (``sweep`` finds a dead process's)."""
    return f"{os.getpid()}-{os.urandom(4).hex()}"


def sweep(stream: str, keep: Path | None = None) -> None:
    """Remove the iteration directories of the stream whose token is ``stream`` (but
    ``keep``): windows of iterations that ended before every worker took them. Those of
    processes that are gone (killed before they could) go too, once unchanged for
    ``_STALE_S``."""
    for old in base().glob(f"{_PREFIX}*"):
        if old == keep or not _ours(old):  # another user's is not ours to judge
            continue
        if old.name.startswith(f"{_PREFIX}{stream}-") or _stale(old):
            shutil.rmtree(old, ignore_errors=True)


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is a directory of this user (not a link to one)."""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def _private(folder: Path) -> None:
    """Make ``folder`` a directory of this user's alone (mode 0700, whatever the umask), or
    check that the one there is.

    Raises:
        SharedDirectoryError: what is there is a link, not a directory, another user's, or
            open to others in any way.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    me = os.geteuid()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != me or stat.S_IMODE(info.st_mode) & 0o077:
        raise SharedDirectoryError(
            f"The directory for this rank's DataLoader workers' windows, {folder}, is "
            f"{_described(info)}; expected a directory (not a symbolic link) of this user "
            f"(uid {me}) with mode 0o700, as efdl makes it. Another user may have made it to "
            "feed or read the windows: remove it, or set EFDL_DATA_SHM to a folder only this "
            "user can write to."
        )
    if stat.S_IMODE(info.st_mode) != 0o700:  # this user's, made under a umask like 0o277
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_ino == info.st_ino:  # the one checked
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _described(info: os.stat_result) -> str:
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(info.st_mode)
        else "a directory"
        if stat.S_ISDIR(info.st_mode)
        else "a regular file"
        if stat.S_ISREG(info.st_mode)
        else "a special file"
    )
    return f"{kind} owned by uid {info.st_uid} with mode {oct(stat.S_IMODE(info.st_mode))}"


# A directory whose process is gone, unchanged this long, is left over. (A process of
# another PID namespace that shares /dev/shm may look gone: its directories change while it
# reads.)
_STALE_S = 600.0


def _stale(folder: Path) -> bool:
    try:
        os.kill(int(folder.name[len(_PREFIX) :].split("-", 1)[0]), 0)
        return False
    except ProcessLookupError:
        pass
    except (ValueError, OSError):  # not ours to judge, or another user's process
        return False
    try:
        return time.time() - folder.stat().st_mtime > _STALE_S
    except OSError:
        return False


def _allocate(fd: int, size: int) -> None:
    """Give the file ``fd`` ``size`` bytes of memory now: a write into a mapping of shared
    memory that has no room kills the process (SIGBUS), where this raises ENOSPC."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # pragma: no cover - macOS
        os.ftruncate(fd, size)


@dataclass
class _File:
    """One of an owner's pool files: its mapping, and the names it was last given under
    (free once they are all gone)."""

    path: Path
    map: mmap.mmap | None = None
    names: list[Path] = field(default_factory=list)
    writing: bool = False

    def free(self) -> bool:
        if self.writing:
            return False
        self.names = [n for n in self.names if n.exists()]
        return not self.names

    def room(self, size: int) -> mmap.mmap:
        """The mapping, grown to ``size`` bytes if smaller (never shrunk: a taker may still
        map the longer file)."""
        if self.map is None or len(self.map) < size:
            fd = os.open(self.path, os.O_RDWR)  # gone: the exchange was closed
            try:
                _allocate(fd, size)
                self.map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        return self.map


class Exchange:
    """One DataLoader worker's side of its rank's windows for one iteration.

    Args:
        source: writes the windows into its files and reads them back (``Source.dump`` /
            ``Source.load``).
        stream: the stream's token (the same in all of its workers).
        iteration: the same in all workers of one iteration, and naming what a window's
            rows depend on (the order, the rank's share): an iteration that names the
            same as an earlier one finds the same rows under the same names.
        worker, workers: this worker, and the loader's workers.
    """

    def __init__(
        self,
        source: Source[Any],
        stream: str,
        iteration: str,
        worker: int,
        workers: int,
        wait_s: float = WAIT_S,
    ) -> None:
        self.source, self.worker, self.workers, self.wait_s = source, worker, workers, wait_s
        self.root = base() / f"{_PREFIX}{stream}-{iteration}"
        self.root.parent.mkdir(parents=True, exist_ok=True)
        _private(self.root)  # before anything in it is read or written
        sweep(stream, keep=self.root)  # earlier iterations are over: their workers stopped
        self._closed = threading.Event()
        self._pool: list[_File] = []  # this worker's files for the windows it gives
        self._pool_lock = threading.Lock()  # reader threads give at once
        self._tag = os.urandom(3).hex()  # its files' names: not an earlier iteration's
        self._maps: dict[int, mmap.mmap] = {}  # others' files this worker mapped, by inode
        # When this worker began, by the clock of the directory's files (see left()).
        begun = self.root / f"begun.{worker}"
        begun.touch()
        self._begun_ns = begun.stat().st_mtime_ns
        # Only this worker marks that it closed this iteration: a mark here is older.
        self._closed_mark(worker).unlink(missing_ok=True)

    def _name(self, j: int, lane: int, taker: int | str) -> Path:
        return self.root / f"{j}-{lane}.{taker}"

    def _closed_mark(self, worker: int) -> Path:
        """Where ``worker`` marks that it closed its side: "finished" or "left"."""
        return self.root / f"closed.{worker}"

    def _finished(self, worker: int) -> bool:
        try:
            return self._closed_mark(worker).read_text() == "finished"
        except FileNotFoundError:
            return False

    def give(self, j: int, lane: int, piece: Any, takers: Iterable[int]) -> None:
        """Lane ``lane``'s window ``j``, to each of ``takers`` (other workers)."""
        takers = [t for t in takers if t != self.worker]
        if not takers:
            return
        with self._pool_lock:
            if self._closed.is_set():  # (under the lock: close() empties the pool)
                return
            file = next((f for f in self._pool if f.free()), None)
            if file is None:
                file = _File(self.root / f"pool.{self.worker}.{self._tag}.{len(self._pool)}")
                os.close(os.open(file.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
                self._pool.append(file)
            file.writing, file.names = True, [self._name(j, lane, t) for t in takers]
        try:
            self.source.dump(piece, file.room)
        except OSError as exc:
            file.writing, file.names = False, []
            if self._closed.is_set():  # close() removed the file: nobody takes the window
                return
            raise DataSourceError(
                f"Cannot write a window for the other DataLoader workers to {self.root} "
                f"({exc}); expected room for about three windows per lane there: give "
                "/dev/shm more (docker --shm-size, a memory emptyDir) or set EFDL_DATA_SHM "
                "to a folder with room."
            ) from exc
        try:
            for taker, name in zip(takers, file.names, strict=True):
                # Each name appears whole: a link to a written file, over a name an earlier
                # iteration left (which holds the same rows).
                linked = self._name(j, lane, f"w{self.worker}-{taker}")
                os.link(file.path, linked)
                os.replace(linked, name)
        except FileNotFoundError:
            if not self._closed.is_set():  # as above
                raise
        finally:
            file.writing = False

    def take(self, j: int, lane: int, owner: int) -> Any:
        """Lane ``lane``'s window ``j`` from worker ``owner``, once it gave it.

        Raises:
            DataSourceError: it did not within ``wait_s`` seconds, or this side was closed.
            SharedDirectoryError: the window is a link, or not a regular file of this user
                that only it can write.
        """
        path = self._name(j, lane, self.worker)
        now = time.monotonic()
        deadline, look = now + self.wait_s, now + _LOOK_S
        pause = 0.0002
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                if self._closed.is_set():
                    raise DataSourceError("The stream's iteration was closed.") from None
                if time.monotonic() > look:  # the marks: a directory listing, now and then
                    why, look = self._not_coming(j, lane, owner), time.monotonic() + _LOOK_S
                    if why:
                        raise DataSourceError(why) from None
                if time.monotonic() > deadline:
                    raise DataSourceError(
                        f"DataLoader worker {owner} of {self.workers} did not give window {j} "
                        f"of lane {lane} within {self.wait_s:.0f} s (in {self.root}); expected "
                        "every worker of the loader to read its lanes. Is it stuck on a read?"
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, 0.005)
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # ELOOP: a symbolic link
                    raise
                raise SharedDirectoryError(
                    f"The window {path} cannot be opened as a file ({exc}); expected a "
                    "regular file of this user, not a symbolic link."
                ) from exc
            try:
                return self.source.load(self._map(fd, path))
            finally:
                os.close(fd)

    def _not_coming(self, j: int, lane: int, owner: int) -> str | None:
        """Why window ``j`` of lane ``lane`` will not come, if it will not: a worker left the
        iteration, or its owner finished without it (an owner links its names before it
        marks that it finished, so a name not there after the mark will not come)."""
        gone = self.left()
        if gone is not None:
            return (
                f"DataLoader worker {gone[0]} left the iteration before it gave window {j} "
                f"of lane {lane}: {gone[1] or 'the loop over it ended'}."
            )
        if self._finished(owner) and not self._name(j, lane, self.worker).exists():
            return (
                f"DataLoader worker {owner} of {self.workers} finished the iteration without "
                f"window {j} of lane {lane} for worker {self.worker} (in {self.root}); "
                "expected every window a worker's steps take to be given. Please report this."
            )
        return None

    def _map(self, fd: int, path: Path) -> mmap.mmap:
        """The file ``fd`` mapped: the mapping of an earlier window of it where it is long
        enough. Its inode names it: a file this worker maps cannot go while the mapping
        lives, so no other file takes its inode number meanwhile. Only a regular file of
        this user that no other can write is read (``path`` names it)."""
        info = os.fstat(fd)
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            raise SharedDirectoryError(
                f"The window {path} is {_described(info)}; expected a regular file of this "
                f"user (uid {os.geteuid()}) that no other can write, as efdl writes them: "
                "another user may have written it. Not read."
            )
        mapped = self._maps.get(info.st_ino)
        if mapped is None or len(mapped) < info.st_size:
            mapped = self._maps[info.st_ino] = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
        return mapped

    def release(self, j: int, lane: int) -> None:
        """This worker is done with lane ``lane``'s window ``j`` (nothing refers to its rows
        any more): its owner may write another window over it."""
        self._name(j, lane, self.worker).unlink(missing_ok=True)

    def left(self) -> tuple[int, str] | None:
        """A worker that left this iteration before its end (it will give nothing more), if
        any, and its error. Its mark is newer than this worker's start: one as old or older
        is an earlier iteration's of the same name (the same files' clock, not this
        process's)."""
        try:
            marks = [self.root / n for n in os.listdir(self.root) if n.startswith("left.")]
        except FileNotFoundError:
            raise DataSourceError(
                f"The directory of this iteration's windows, {self.root}, was removed while "
                "its DataLoader workers read: by another iteration over the same stream? "
                "Iterate one loader over a stream at a time."
            ) from None
        for mark in marks:
            with contextlib.suppress(OSError):
                if mark.stat().st_mtime_ns > self._begun_ns:
                    return int(mark.suffix[1:]), mark.read_text()
        return None

    def close(self, finished: bool, error: str = "", wait: bool = True) -> None:
        """This worker is done with the iteration: windows still named for it are dropped,
        and the directory goes with the last of the loader's workers to close. Not
        ``finished`` (it left before its end: the loop ended, or ``error``): it marks that
        it left, so the others stop waiting for its windows. Not ``wait``: from a
        finalizer, which may run in a reader thread that holds the pool's lock; the pool is
        taken without it (a file a give makes meanwhile goes with the directory)."""
        self._closed.set()
        self._maps.clear()  # each goes with the last rows that refer to it
        if wait:
            with self._pool_lock:
                pool, self._pool = self._pool, []
        else:
            pool, self._pool = self._pool, []
        # No worker of this iteration removes the directory before this one marks that it
        # closed (below); where something else did (another iteration's sweep), nothing is
        # left to tidy.
        with contextlib.suppress(FileNotFoundError):
            if not finished:
                (self.root / f"left.{self.worker}").write_text(error)
            # Its pool's files (a name not yet taken keeps its file for the taker), and the
            # windows named for it ("{j}-{lane}.{worker}").
            for file in pool:
                file.path.unlink(missing_ok=True)
            mine = f".{self.worker}"
            for name in os.listdir(self.root):
                if name.endswith(mine) and name[0].isdigit():
                    (self.root / name).unlink(missing_ok=True)
            self._closed_mark(self.worker).write_text("finished" if finished else "left")
        # The last of the loader's workers to close removes the directory, with any window
        # nobody took and the marks. (Two that close at once may both: that is no error.)
        if all(self._closed_mark(w).exists() for w in range(self.workers)):
            shutil.rmtree(self.root, ignore_errors=True)
