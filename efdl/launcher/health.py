"""Whether this node is fit to train: health checks before it joins and while it trains.

Pure verdicts (:func:`judge_gpus`, :func:`judge_disk`, :func:`judge_command`) over readings
taken by thin readers (:func:`read_gpus` through NVML, :func:`free_bytes`, :func:`run_command`);
:class:`HealthMonitor` runs them all, before the node joins and every ``--health-interval``
on a thread of its own, and hands each round of findings to the agent. A **fault** holds
the node out of the job (a quarantine with ``--quarantine-ttl``: efdl.rendezvous.holds); a
**warning** is only said (an event and a log line).

What is a fault, and why:

- An uncorrectable ECC error (volatile count since the driver loaded), a retired page or a
  remapped row pending (the GPU needs a reset before the memory is safe), a failed row
  remap, a GPU fallen off the bus (``NVML_ERROR_GPU_IS_LOST``, or a GPU this node offered
  that NVML no longer finds), and a critical Xid that the hardware or driver raises (48 a
  double-bit ECC error, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 a high
  single-bit ECC rate, 94/95 a contained/uncontained ECC error, 119/120 the GSP): each of
  these crashes the workers again after every restart, or corrupts what they compute.
- Throttling (hardware slowdown, thermal, power brake) is a **warning**: a hot GPU is slow,
  not wrong, it often passes (a fan, the room, a neighbour's load), and taking a node out
  for it costs the job a round and the node's GPUs for a whole TTL. A node that stays slow
  is the straggler detector's to judge, from the step times it actually costs the job.
  Xids that a user's program causes (13, 31, 43: an illegal access, an MMU fault, a kernel
  stopped) are warnings too: the next run of a fixed script is fine on the same GPU.
- The cache directory (a local ``--cache-url``) with less free space than
  ``--health-min-free`` or twice the last snapshot: the next persist would fail.
- ``--health-check CMD`` exiting non-zero, or running past its timeout.

Xids are read cheaply: NVML's event set for critical Xid errors is registered once, and each
check takes what queued since without waiting (``nvmlEventSetWait(set, 0)``). On a host
without NVML (no driver, no ``nvidia-ml-py``) the GPU checks are skipped and the monitor says
so once.

Not done: a loopback collective between this node's own processes. A gloo all-reduce over
127.0.0.1 exercises the CPU and the loopback device, neither of which fails in the ways that
hurt jobs (a NIC, NVLink, a GPU's NCCL path); an NCCL one needs the GPUs, which the workers
hold, and a CUDA context per GPU in the agent (about 500 MB each), and each run imports torch
in a fresh process (2-5 s of CPU). The job's own first collective after each round tests the
real path, with the hang watch's deadline (efdl.worker.hang).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Xids the hardware or driver raises, which hold the node out (see the module docstring).
FAULT_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
# Clock throttle reasons worth a warning (nvmlClocksThrottleReason*): hardware slowdown,
# software thermal, hardware thermal, hardware power brake. Software power capping (0x4) is
# a GPU at its power limit under load, as it should be.
THROTTLE_REASONS = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
OUTPUT_TAIL = 300  # characters of a health command's output kept in the reason


class Severity(StrEnum):
    FAULT = "fault"  # holds the node out (quarantine)
    WARNING = "warning"  # said only


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing a check found: which check, how bad, and a sentence naming the GPU, the
    path or the command, and the value."""

    check: str
    severity: Severity
    reason: str


@dataclass(frozen=True, slots=True)
class GpuReading:
    """What NVML says of one GPU this node offers; None where NVML cannot say (not
    supported).

    Attributes:
        index: NVML's index.
        uuid: the GPU's UUID.
        lost: NVML said the GPU is lost (fallen off the bus), or no longer finds it.
        ecc_uncorrected: uncorrectable ECC errors since the driver loaded (volatile).
        retired_pending: a retired page is pending (the GPU needs a reset).
        remap_pending: a remapped row is pending (the GPU needs a reset).
        remap_failed: a row remap failed.
        throttle: the clocks' throttle reasons (NVML's bit mask).
        xids: critical Xid errors reported since the last check.
    """

    index: int
    uuid: str
    lost: bool = False
    ecc_uncorrected: int | None = None
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    throttle: int = 0
    xids: tuple[int, ...] = ()


def judge_gpus(readings: Sequence[GpuReading]) -> list[Finding]:
    """The findings of this node's GPUs (see the module docstring for what is a fault)."""
    out: list[Finding] = []
    for g in readings:
        name = f"GPU {g.index} ({g.uuid})"

        def fault(check: str, text: str, name: str = name) -> None:
            out.append(Finding(check, Severity.FAULT, f"{name} {text}"))

        if g.lost:
            fault("gpu-lost", "has fallen off the bus (NVML: GPU is lost, or no longer found)")
            continue
        if g.ecc_uncorrected:
            fault(
                "ecc", f"has {g.ecc_uncorrected} uncorrectable ECC error(s) since the driver loaded"
            )
        if g.retired_pending:
            fault("retired-pages", "has retired pages pending (it needs a reset)")
        if g.remap_pending:
            fault("remapped-rows", "has remapped rows pending (it needs a reset)")
        if g.remap_failed:
            fault("remapped-rows", "failed to remap a row (its memory is bad)")
        for xid in g.xids:
            if xid in FAULT_XIDS:
                fault("xid", f"reported Xid {xid}")
            else:
                out.append(
                    Finding(
                        "xid",
                        Severity.WARNING,
                        f"{name} reported Xid {xid} (usually the program's own error)",
                    )
                )
        reasons = [text for bit, text in THROTTLE_REASONS.items() if g.throttle & bit]
        if reasons:
            out.append(
                Finding(
                    "throttle",
                    Severity.WARNING,
                    f"{name} is throttled: {', '.join(reasons)} (reasons 0x{g.throttle:x})",
                )
            )
    return out


def judge_disk(path: Path, free: int, need: int) -> Finding | None:
    """A fault when ``path`` has ``free`` bytes and the next snapshot needs ``need``."""
    if free >= need:
        return None
    return Finding(
        "disk",
        Severity.FAULT,
        f"the cache directory {path} has {free / 1e6:.0f} MB free; at least {need / 1e6:.0f} MB "
        "are needed (--health-min-free, and twice the last snapshot)",
    )


def judge_command(command: str, code: int | None, output: str, timeout_s: float) -> Finding | None:
    """A fault when the user's health command exited non-zero (``code``; None: it ran past
    ``timeout_s``); ``output``: its stdout and stderr, whose tail goes into the reason."""
    if code == 0:
        return None
    tail = " ".join(output.split())[-OUTPUT_TAIL:]
    how = f"ran past its timeout ({timeout_s:g} s)" if code is None else f"exited {code}"
    said = f": ...{tail}" if len(tail) == OUTPUT_TAIL else f": {tail}" if tail else ""
    return Finding("command", Severity.FAULT, f"the health check {command!r} {how}{said}")


def faults(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.FAULT]


def reason_of(found: Sequence[Finding]) -> str:
    """One line for a hold's reason: the findings' sentences."""
    return "; ".join(f.reason for f in found)


# ---------------------------------------------------------------- readers (I/O)


def run_command(command: str, timeout_s: float) -> tuple[int | None, str]:
    """Run ``command`` through the shell, in a process group of its own; its exit code
    (None: killed at ``timeout_s``, with its group) and its output. The output goes to a
    temporary file, not a pipe: a helper the command left behind (in the background, or
    in a session of its own) that still holds it neither keeps a check that passed from
    ending nor holds a hung one past its deadline."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            command,
            shell=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        out.seek(0)
        return code, out.read().decode(errors="replace")


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def local_cache_dir(url: str | None) -> Path | None:
    """The local directory of a cache URL (a path, or ``file://``); None for a remote one."""
    if not url:
        return None
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    return None if "://" in url else Path(url).expanduser()


class GpuReader:
    """Reads the GPUs ``gpus`` (NVML index, UUID) through NVML (``nvml``: the ``pynvml``
    module; default: import it). A MIG instance is read as its parent GPU (ECC, rows, Xids
    and throttling are the whole GPU's), once however many of its instances the node offers.
    NVML stays initialised while the reader lives (:meth:`close`), so that its Xid event set
    keeps what happens between reads."""

    def __init__(self, gpus: Sequence[tuple[int, str]], nvml: Any = None) -> None:
        self._uuids = [uuid for _, uuid in gpus]
        self._index = {uuid: index for index, uuid in gpus}  # as the node offered them
        self._nvml = nvml
        self._events: Any = None
        self.note = ""  # why GPUs are not read ("": they are)
        if not self._uuids:
            self.note = "this node offers no GPU"
            return
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                self.note = "nvidia-ml-py is not installed"
                return
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            self.note = f"NVML is not available ({exc})"
            self._nvml = None
            return
        self._uuids = self._parents(gpus)
        self._events = self._register_xids()

    def _parents(self, gpus: Sequence[tuple[int, str]]) -> list[str]:
        """The UUIDs to read: each GPU's, a MIG instance's parent's, each once."""
        nvml = self._nvml
        out: list[str] = []
        for index, uuid in gpus:
            if uuid.startswith("MIG-"):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    parent = nvml.nvmlDeviceGetUUID(handle)
                    uuid = parent.decode() if isinstance(parent, bytes) else str(parent)
                except nvml.NVMLError as exc:
                    log.info("The parent of MIG instance %s is not found (%s).", uuid, exc)
            if uuid not in out:
                out.append(uuid)
                self._index.setdefault(uuid, index)
        return out

    def _register_xids(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except (nvml.NVMLError, AttributeError) as exc:
            log.info("Xid errors are not read here (%s).", exc)
            return None
        for uuid in self._uuids:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except (nvml.NVMLError, AttributeError) as exc:  # a lost GPU: read() says so
                log.info("Xid errors of GPU %s are not read (%s).", uuid, exc)
        return events

    def read(self) -> list[GpuReading]:
        """A reading of each GPU; [] where NVML is not there (:attr:`note` says why)."""
        nvml = self._nvml
        if nvml is None:
            return []
        xids = self._xids()
        out = []
        for uuid in self._uuids:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                index = int(nvml.nvmlDeviceGetIndex(handle))
            except nvml.NVMLError as exc:  # GPU_IS_LOST, NOT_FOUND: gone from the bus
                log.debug("NVML cannot find GPU %s: %s", uuid, exc)
                out.append(GpuReading(self._index.get(uuid, -1), uuid, lost=True))
                continue
            out.append(self._reading(handle, index, uuid, tuple(xids.get(uuid, ()))))
        return out

    def _reading(self, handle: Any, index: int, uuid: str, xids: tuple[int, ...]) -> GpuReading:
        nvml = self._nvml

        def ecc() -> int:
            return int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )

        def retired() -> bool:
            return bool(
                nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED
            )

        rows = self._call(lambda: tuple(nvml.nvmlDeviceGetRemappedRows(handle)))
        throttle = self._call(lambda: int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)))
        return GpuReading(
            index,
            uuid,
            ecc_uncorrected=self._call(ecc),
            retired_pending=self._call(retired),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failed=None if rows is None else bool(rows[3]),
            throttle=throttle or 0,
            xids=xids,
        )

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, None where NVML does not support it (or fails on it)."""
        try:
            return fn()
        except (self._nvml.NVMLError, AttributeError):
            return None

    def _xids(self) -> dict[str, list[int]]:
        """The critical Xids queued since the last read, by GPU UUID (no wait)."""
        nvml = self._nvml
        found: dict[str, list[int]] = {}
        if self._events is None:
            return found
        for _ in range(1000):  # bounded: a storm of events is read over several checks
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing more queued
                break
            try:
                uuid = str(nvml.nvmlDeviceGetUUID(data.device))
            except nvml.NVMLError:
                uuid = "?"
            found.setdefault(uuid, []).append(int(data.eventData))
        return found

    def close(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        self._nvml = None
        with contextlib.suppress(nvml.NVMLError, AttributeError):
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """What the monitor checks (from the launch configuration).

    Args:
        interval_s: between checks while training (0: only before joining).
        command: the user's ``--health-check`` (None: none).
        command_timeout_s: its deadline.
        cache_dir: the local cache directory whose free space is checked (None: none).
        min_free_bytes: the least free space there.
        collective: the node's own collective, run before it joins with the command's
            deadline (efdl.launcher.collective.check, its ranks and devices bound); None: not.
    """

    interval_s: float
    command: str | None
    command_timeout_s: float
    cache_dir: Path | None
    min_free_bytes: int
    collective: Callable[[float], Finding | None] | None = None


class HealthMonitor:
    """Runs every check (:meth:`check`), and every ``interval_s`` on a thread of its own
    (:meth:`start`), handing the findings of each round of checks that found something to
    ``report`` (from that thread). ``snapshot_bytes``: the size of the last snapshot this
    node wrote (0: none), read from the thread (a single attribute)."""

    def __init__(
        self,
        settings: HealthSettings,
        gpus: Sequence[tuple[int, str]],
        snapshot_bytes: Callable[[], int],
        tag: Callable[[], str],
        nvml: Any = None,
    ) -> None:
        self._settings = settings
        self._snapshot_bytes = snapshot_bytes
        self._tag = tag
        self._gpus = GpuReader(gpus, nvml)
        if self._gpus.note:
            log.info("%s: the GPU health checks are skipped: %s.", tag(), self._gpus.note)
        self._stop = threading.Event()
        self._soon = threading.Event()  # check now, not at the interval's end
        self._thread: threading.Thread | None = None

    def check(self, joining: bool = False) -> list[Finding]:
        """Run every check once; the findings (faults and warnings). ``joining``: before the
        node joins (the node's collective too, when asked for: its GPUs are free then)."""
        s = self._settings
        found = judge_gpus(self._gpus.read())
        if joining and s.collective is not None and not faults(found):
            verdict = s.collective(s.command_timeout_s)
            if verdict is not None:
                found.append(verdict)
        if s.cache_dir is not None:
            need = max(s.min_free_bytes, 2 * self._snapshot_bytes())
            try:
                disk = judge_disk(s.cache_dir, free_bytes(s.cache_dir), need)
            except OSError as exc:
                disk = Finding(
                    "disk",
                    Severity.FAULT,
                    f"the cache directory {s.cache_dir} cannot be read: {exc}",
                )
            if disk is not None:
                found.append(disk)
        if s.command is not None:
            try:
                code, output = run_command(s.command, s.command_timeout_s)
            except OSError as exc:
                code, output = 127, str(exc)
            verdict = judge_command(s.command, code, output, s.command_timeout_s)
            if verdict is not None:
                found.append(verdict)
        return found

    def start(self, report: Callable[[list[Finding]], None]) -> None:
        """Check every ``interval_s`` (none with 0) until :meth:`close`."""
        if self._settings.interval_s <= 0 or self._thread is not None:
            return

        def run() -> None:
            while True:
                self._soon.wait(self._settings.interval_s)
                self._soon.clear()
                if self._stop.is_set():
                    return
                try:
                    found = self.check()
                except Exception as exc:  # a reader's bug must not end the agent
                    log.warning("%s: the health checks failed to run: %s", self._tag(), exc)
                    continue
                if found:
                    report(found)

        self._thread = threading.Thread(target=run, name="efdl-health", daemon=True)
        self._thread.start()

    def check_soon(self) -> None:
        """Run the checks now on the monitor's thread (none without an interval)."""
        self._soon.set()

    def close(self) -> None:
        self._stop.set()
        self._soon.set()
        thread = self._thread
        if thread is not None:
            # A health command runs to its own timeout at most; the thread is a daemon.
            thread.join(timeout=1.0)
        self._gpus.close()
