"""Each fleet job's agents under a user of its own: a uid from a range the operator sets aside
(``efdl node --job-uids 70000-70999``), in the spirit of systemd's ``DynamicUser=``.

A uid has no account (no passwd or group entry: a uid or gid in the range that has one is
skipped), its gid is the same number, and it gets no supplementary group. A job holds one
uid on a host while any of its agents runs there; it is picked from a hash of the job's id
(the same job usually gets the same uid back), skipping uids another job here holds or that
any process runs as. When a job's last agent on a host ends, every process left running as
its uid is killed and its files in ``/dev/shm`` are removed (as ``RemoveIPC=``), so that the
next job given that uid inherits nothing running. Files a job left elsewhere stay its uid's:
keep a job's outputs where its own credentials decide who reads them (its cache, an object
store), not in directories every job's uid can write.

Each agent gets a private directory (mode 0700, its uid's) under the daemon's state
directory: its ``HOME``, the etcd password and certificate files it may use, and the file its
exit code is written to; and a ``TMPDIR`` of its own, ``/tmp/efdl-job-<random>`` (0700, its
uid's: short, for efdl-run's Unix sockets). A job's uid must be able to run the daemon's Python
(the wrapper and efdl-run are started as it), so the daemon checks at start that every user
may enter the directories above it and above the state directory.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import re
import shutil
import signal
import stat
import tempfile
import zlib
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from efdl.errors import ConfigError

log = logging.getLogger(__name__)

SHARED = "shared"  # --job-uids shared: every job as the daemon's own user
_RANGE_RE = re.compile(r"^\s*(\d{1,10})\s*-\s*(\d{1,10})\s*$")
# uids no job may get: root, nobody, the 16- and 32-bit -1.
_SPECIAL = (0, 65534, 65535, 4294967295)
SHM = Path("/dev/shm")
# Where a job's agent gets its TMPDIR (efdl-job-<random>, 0700, its uid's): a short path every
# user may enter (efdl-run's Unix sockets go under TMPDIR, within 107 bytes), not the
# daemon's own TMPDIR, which may be private to it.
TMP_ROOT = Path("/tmp")
TMP_PREFIX = "efdl-job-"


@dataclass(frozen=True, slots=True)
class UidRange:
    """The uids ``first..last`` (both included), set aside for jobs: no account uses them."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.last < 4294967295:
            raise ConfigError(
                f"--job-uids {self} is not a range of uids; expected FIRST-LAST with "
                "0 < FIRST <= LAST < 4294967295, e.g. 70000-70999."
            )
        special = [u for u in _SPECIAL if self.first <= u <= self.last]
        if special:
            raise ConfigError(
                f"--job-uids {self} holds uid {special[0]} (nobody, or the value -1 means to "
                "the kernel); expected a range of ordinary uids, e.g. 70000-70999."
            )

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    @staticmethod
    def parse(text: str) -> UidRange:
        m = _RANGE_RE.match(text)
        if not m:
            raise ConfigError(
                f"--job-uids {text!r} is neither a range of uids FIRST-LAST (e.g. 70000-70999) "
                f"nor {SHARED!r}."
            )
        return UidRange(int(m.group(1)), int(m.group(2)))


def job_uids(text: str | None, euid: int) -> UidRange | None:
    """``--job-uids`` read: the range, or None for jobs as the daemon's own user (``shared``,
    or the flag not given by a daemon that is not root).

    Raises:
        ConfigError: a bad range; a range while the daemon is not root (it could not switch
            users); nothing given while it is root (every job would run as root and could read
            the daemon's credentials: that must be asked for by name, ``shared``).
    """
    if text is None or text.strip() == "":
        if euid == 0:
            raise ConfigError(
                "efdl node runs as root, so every job would run as root and could read this "
                "daemon's etcd credentials: give --job-uids FIRST-LAST (uids no account uses, "
                "e.g. 70000-70999) to run each job as a user of its own, or --job-uids shared "
                "to run them all as root knowingly."
            )
        return None
    if text.strip() == SHARED:
        return None
    uids = UidRange.parse(text)
    if euid != 0:
        raise ConfigError(
            f"--job-uids {uids} needs efdl node to run as root (it runs as uid {euid}) to start "
            "each job as a user of its own; run it as root, or give --job-uids shared."
        )
    return uids


SUBORDINATE_IDS = (Path("/etc/subuid"), Path("/etc/subgid"))


def check_subordinate_ids(uids: UidRange, files: Iterable[Path] = SUBORDINATE_IDS) -> None:
    """Refuse a range that overlaps a user's subordinate ids (``name:first:count`` lines of
    /etc/subuid and /etc/subgid): that user's rootless containers may run as those ids, and
    so reach a job's files and processes.

    Raises:
        ConfigError: naming the file, the user and the overlap.
    """
    for path in files:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                continue
            first, count = int(parts[1]), int(parts[2])
            low, high = max(first, uids.first), min(first + count - 1, uids.last)
            if count and low <= high:
                raise ConfigError(
                    f"--job-uids {uids} overlaps the subordinate ids {first}-{first + count - 1} "
                    f"of user {parts[0]!r} in {path} ({low}-{high}): that user's containers may "
                    "run as them. Choose a range no account, service or subordinate range uses."
                )


def pick_uid(job_id: str, uids: UidRange, unavailable: Callable[[int], bool]) -> int | None:
    """A uid for ``job_id``: from a hash of its id, the first of the range on (wrapping
    round) that is not ``unavailable``; None if none is free. Pure but for ``unavailable``."""
    start = zlib.crc32(job_id.encode()) % uids.size
    for i in range(uids.size):
        uid = uids.first + (start + i) % uids.size
        if not unavailable(uid):
            return uid
    return None


def has_account(uid: int) -> bool:
    """Whether a user with this uid, or a group with this number as gid, exists."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
        except KeyError:
            continue
        return True
    return False


def process_uids() -> set[int]:
    """The uids (real, effective and saved) every process on the host runs as."""
    found: set[int] = set()
    for p in psutil.process_iter(["uids"]):
        uids = p.info["uids"]
        if uids is not None:
            found.update(uids)
    return found


def check_reachable(path: Path, what: str) -> None:
    """Every directory above ``path`` (and ``path`` itself if it is one) may be entered by
    every user: a job's uid starts the daemon's Python and reaches its private directory.

    Raises:
        ConfigError: naming the first directory that may not, with its mode.
    """
    dirs: list[Path] = []
    for target in (path.absolute(), path.resolve()):  # the path as named, and where it leads
        dirs += [*reversed(target.parents)] + ([target] if target.is_dir() else [])
    for d in dict.fromkeys(dirs):
        mode = d.stat().st_mode
        if not mode & stat.S_IXOTH:
            raise ConfigError(
                f"The jobs' users cannot reach {what} {str(path)!r}: {str(d)!r} has mode "
                f"{stat.S_IMODE(mode):04o}, which other users may not enter. Make it "
                "o+x, or move it."
            )


def prepare_state_dir(state: Path) -> tuple[Path, Path]:
    """The daemon's state directory (mode 0711: others may pass through, not list), its
    ``logs`` (0700: the daemon's alone) and ``run`` (0711: the agents' private directories)
    directories; returns (logs, run)."""
    logs, run = state / "logs", state / "run"
    for d, mode in ((state, 0o711), (logs, 0o700), (run, 0o711)):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(mode)
    return logs, run


def make_private_dir(path: Path, uid: int | None) -> None:
    """``path``, mode 0700, owned by ``uid`` (and gid ``uid``; None: the daemon's own). Fails
    if ``path`` exists."""
    path.mkdir(mode=0o700)
    if uid is not None:
        os.chown(path, uid, uid)


def make_private_tmp(uid: int) -> Path:
    """A new directory ``/tmp/efdl-job-<random>`` (mode 0700) owned by ``uid``: a job's
    ``TMPDIR``."""
    path = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=TMP_ROOT))
    os.chown(path, uid, uid)
    return path


def orphan_tmps(uids: UidRange, known: Collection[str]) -> list[Path]:
    """The jobs' ``TMPDIR`` directories (:func:`make_private_tmp`) owned by a uid of ``uids``
    that are not in ``known`` (a daemon that died before removing them)."""
    found = []
    for d in TMP_ROOT.glob(f"{TMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            st = d.lstat()
            ours = stat.S_ISDIR(st.st_mode) and uids.first <= st.st_uid <= uids.last
            if ours and str(d) not in known:
                found.append(d)
    return found


def write_private(path: Path, data: bytes, uid: int | None) -> None:
    """A new file (mode 0600) owned by ``uid`` holding ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if uid is not None:
            os.fchown(fd, uid, uid)
        os.write(fd, data)
    finally:
        os.close(fd)


def remove_private_dir(path: Path) -> None:
    """Remove an agent's private directory (the daemon's: nothing in it is followed)."""
    shutil.rmtree(path, ignore_errors=True)


def sweep(uid: int, pids: Iterable[int] = ()) -> int:
    """End what a job's uid left on this host: kill every process that runs as ``uid``
    (``pids``: those already known) and remove its files at the top of ``/dev/shm``. Returns
    how many processes were killed."""
    procs = {
        p.pid: p
        for p in psutil.process_iter(["uids"])
        if p.info["uids"] is not None and uid in p.info["uids"]
    }
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.setdefault(pid, psutil.Process(pid))
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(list(procs.values()), timeout=10)
    with contextlib.suppress(OSError):
        for entry in SHM.iterdir():
            with contextlib.suppress(OSError):
                if entry.lstat().st_uid != uid:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
    return len(procs)
