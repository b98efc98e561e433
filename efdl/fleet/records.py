"""What the fleet keeps in etcd: its hosts, its jobs' specs and the allocator's statuses, with
strict JSON codecs (as efdl.rendezvous.records does for one job).

Keys live under ``/efdl-fleet/<fleet>/``, apart from the jobs' own rendezvous keys
(``/efdl/<job>/``), which a fleet job uses as a job started by hand does:

- ``hosts/<host>``: a :class:`Host` (its GPUs, which of them a process that is not efdl's
  holds), bound to the host daemon's lease;
- ``jobs/<job>/spec``: a :class:`JobSpec`, written once by ``efdl submit``;
- ``jobs/<job>/status``: a :class:`JobStatus`, written by the allocator (its placement) and by
  the host daemons and ``efdl cancel`` (the final phases).

Everything read from etcd is untrusted input: a record that does not parse raises
:class:`~efdl.rendezvous.records.RecordError` naming the key and the field.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from efdl.errors import ConfigError
from efdl.fields import Fields
from efdl.fleet.launch import split_command
from efdl.rendezvous.records import (
    HOST_RE,
    ID_RE,
    RecordError,
    check_id,
    dump_record,
    load_record,
)

FLEET_ROOT = "/efdl-fleet"
PRIORITY_RANGE = (-1000, 1000)
# Environment variable names a spec may set (efdl's own and torch's rendezvous variables are
# the agent's to set).
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
RESERVED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
)


@dataclass(frozen=True, slots=True)
class FleetKeys:
    """The etcd keys of one fleet; nothing outside ``/efdl-fleet/<fleet>/`` is touched."""

    fleet: str = "default"

    def __post_init__(self) -> None:
        check_id(self.fleet, "fleet name")

    @property
    def prefix(self) -> str:
        return f"{FLEET_ROOT}/{self.fleet}/"

    @property
    def hosts(self) -> str:
        return self.prefix + "hosts/"

    def host(self, host_id: str) -> str:
        return self.hosts + host_id

    @property
    def jobs(self) -> str:
        return self.prefix + "jobs/"

    def spec(self, job_id: str) -> str:
        return f"{self.jobs}{job_id}/spec"

    def status(self, job_id: str) -> str:
        return f"{self.jobs}{job_id}/status"

    @property
    def leader(self) -> str:
        """The allocator's election (lease-bound keys under it; the lowest revision leads)."""
        return self.prefix + "leader/"

    @property
    def events(self) -> str:
        """The allocator's decisions and their reasons (efdl.history's shape)."""
        return self.prefix + "events/"

    def events_at(self, t: float) -> str:
        """Where the events of time ``t`` (seconds) begin: the keys sort by time."""
        return f"{self.events}{int(t * 1e9):020d}"

    @property
    def events_end(self) -> str:
        """The first key after every event's: the prefix's '/' made '0', the next byte."""
        return self.events[:-1] + "0"

    @property
    def holds(self) -> str:
        """Hosts held out of the fleet (drained, quarantined: efdl.rendezvous.holds), one
        record per host, not bound to a lease."""
        return self.prefix + "holds/"

    def hold(self, host_id: str) -> str:
        return self.holds + host_id

    @staticmethod
    def node_id_of(key: str) -> str:
        """The host id at the end of a ``holds/`` key."""
        return key.rsplit("/", 1)[-1]

    @staticmethod
    def job_of(key: str) -> str:
        """The job id in a ``jobs/<job>/spec`` or ``.../status`` key."""
        return key.rstrip("/").rsplit("/", 2)[-2]


def _key_id(f: Fields, name: str, key_id: str, what: str) -> str:
    value = f.text(name, 128)
    if not ID_RE.match(value) or value != key_id:
        raise f.fail(f"names {what} {value!r}, not the {what} of its key ({key_id!r}).")
    return value


# ---------------------------------------------------------------- hosts


@dataclass(frozen=True, slots=True)
class FleetGpu:
    """One GPU of a host: NVML's index, its UUID, and whether a process that is not one of
    efdl's workers holds it (inference at peak): then no job may be placed on it."""

    index: int
    uuid: str = ""
    foreign: bool = False


@dataclass(frozen=True, slots=True)
class Host:
    """A GPU host of the fleet, under ``hosts/<host_id>``, bound to its daemon's lease."""

    host_id: str
    address: str
    gpus: tuple[FleetGpu, ...]
    version: str = ""

    def usable(self) -> frozenset[int]:
        """The GPUs no foreign process holds."""
        return frozenset(g.index for g in self.gpus if not g.foreign)

    def to_json(self) -> bytes:
        return dump_record(asdict(self))

    @staticmethod
    def from_json(raw: bytes, key: str) -> Host:
        where = f"The host record at {key}"
        f = load_record(raw, where)
        gpus = []
        for i, item in enumerate(f.value("gpus", list)):
            g = Fields(item, f"{where} (gpus[{i}])", RecordError)
            gpus.append(
                FleetGpu(g.count("index", 0, 1024), g.text("uuid", 96), g.value("foreign", bool))
            )
        if len({g.index for g in gpus}) != len(gpus):
            raise f.fail("lists a GPU index twice.")
        address = f.text("address")
        if not HOST_RE.match(address):
            raise f.fail(f"field 'address' is {address[:64]!r}, not a host name or IP address.")
        host_id = _key_id(f, "host_id", key.rsplit("/", 1)[-1], "host")
        return Host(host_id, address, tuple(gpus), f.text("version", 64))


# ---------------------------------------------------------------- jobs


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What ``efdl submit`` asked for, under ``jobs/<job>/spec``.

    Attributes:
        job_id: the job's id (its rendezvous keys are ``/efdl/<job_id>/``).
        argv: the training command: a script and its arguments, ``-m`` and a module, or
            ``--no-python`` and a program; every host runs it from ``workdir``, after
            ``--`` on efdl-run's command line (efdl.fleet.launch): no other leading option.
        workdir: an absolute directory that holds the code on every host (shared, or in the
            image).
        min_workers / max_workers: the job's size in workers (one per GPU).
        priority: higher may take GPUs from lower (after the allocator's
            ``preempt_after_s``), and goes first among jobs of one size (-1000..1000).
        cache_url: the remote cache; a job without one is never suspended (its state lives
            only in its workers).
        env: environment variables for the workers, as (name, value) pairs.
        submitted: wall-clock seconds at submission (first come, first served within a
            priority).
    """

    job_id: str
    argv: tuple[str, ...]
    workdir: str
    min_workers: int
    max_workers: int
    priority: int = 0
    cache_url: str = ""
    env: tuple[tuple[str, str], ...] = ()
    submitted: float = 0.0

    def __post_init__(self) -> None:
        check_id(self.job_id)
        split_command(self.job_id, self.argv)  # no leading option but -m and --no-python
        if not self.workdir.startswith("/"):
            raise ConfigError(
                f"Job {self.job_id!r}: the working directory {self.workdir!r} is not absolute; "
                "expected the directory that holds the code on every host."
            )
        if not 1 <= self.min_workers <= self.max_workers <= 65536:
            raise ConfigError(
                f"Job {self.job_id!r}: --min {self.min_workers} and --max {self.max_workers} "
                "are not a size; expected 1 <= min <= max."
            )
        low, high = PRIORITY_RANGE
        if not low <= self.priority <= high:
            raise ConfigError(
                f"Job {self.job_id!r}: priority {self.priority} is out of range; "
                f"expected {low}..{high}."
            )
        for name, _ in self.env:
            if not ENV_NAME_RE.match(name) or name in RESERVED_ENV:
                raise ConfigError(
                    f"Job {self.job_id!r}: the environment variable {name!r} cannot be set; "
                    "expected a name of letters, digits and '_', other than "
                    f"{', '.join(RESERVED_ENV)}."
                )

    @property
    def elastic(self) -> bool:
        return self.max_workers > self.min_workers

    def to_json(self) -> bytes:
        return dump_record({**asdict(self), "env": dict(self.env)})

    @staticmethod
    def from_json(raw: bytes, key: str) -> JobSpec:
        where = f"The job spec at {key}"
        f = load_record(raw, where)
        argv = f.value("argv", list)
        if not all(isinstance(a, str) for a in argv):
            raise f.fail("field 'argv' must be a list of strings.")
        env = f.value("env", dict)
        if not all(isinstance(v, str) for v in env.values()):
            raise f.fail("field 'env' must map names to strings.")
        try:
            return JobSpec(
                job_id=_key_id(f, "job_id", FleetKeys.job_of(key), "job"),
                argv=tuple(argv),
                workdir=f.text("workdir", 4096),
                min_workers=f.count("min_workers", 1, 65536),
                max_workers=f.count("max_workers", 1, 65536),
                priority=int(f.value("priority", int)),
                cache_url=f.text("cache_url", 4096),
                env=tuple(sorted(env.items())),
                submitted=f.number("submitted"),
            )
        except ConfigError as exc:
            raise RecordError(f"{where}: {exc}") from None


class Phase(StrEnum):
    QUEUED = "queued"  # never ran: waits for its min
    RUNNING = "running"  # placed: its hosts run its agents
    SUSPENDED = "suspended"  # stopped by the allocator after persisting; resumes from its cache
    FINISHED = "finished"  # its workers ended with exit 0
    FAILED = "failed"  # its agents ended with an error
    CANCELLED = "cancelled"  # efdl cancel

    @property
    def final(self) -> bool:
        return self in (Phase.FINISHED, Phase.FAILED, Phase.CANCELLED)


# A job's GPUs: (host id, GPU indices there), sorted by host id; indices sorted.
Gpus = tuple[tuple[str, tuple[int, ...]], ...]


REASON_MAX = 1024  # characters of a status's reason


def bounded(reason: str) -> str:
    """``reason`` within REASON_MAX (a long one is cut, and says so)."""
    return reason if len(reason) <= REASON_MAX else reason[: REASON_MAX - 3] + "..."


def gpu_count(gpus: Gpus) -> int:
    return sum(len(indices) for _, indices in gpus)


def describe(gpus: Gpus) -> str:
    """``host-a:0,1 host-b:3`` (``none`` for no GPUs)."""
    return " ".join(f"{h}:{','.join(map(str, ix))}" for h, ix in gpus) or "none"


@dataclass(frozen=True, slots=True)
class JobStatus:
    """The allocator's word on a job, under ``jobs/<job>/status``.

    Attributes:
        phase: where the job is (:class:`Phase`).
        gpus: the GPUs it holds now (RUNNING only).
        changed: wall-clock seconds of the last change of its GPUs or phase.
        reason: one sentence: why it is where it is.
        gpu_s: the GPU-seconds it held before ``changed`` (its attained service: while
            RUNNING it adds ``size x (now - changed)``); the allocator keeps it.
        started: when it last started or resumed (RUNNING only; 0 otherwise).
        held_s: the seconds it held GPUs before ``changed`` (while RUNNING it adds
            ``now - changed``); the allocator keeps it.
        suspends: how many times it stopped running without finishing (suspended, or all
            its GPUs lost); the allocator keeps it.
    """

    phase: Phase = Phase.QUEUED
    gpus: Gpus = ()
    changed: float = 0.0
    reason: str = ""
    gpu_s: float = 0.0
    started: float = 0.0
    held_s: float = 0.0
    suspends: int = 0

    def __post_init__(self) -> None:  # every writer's reason fits the record (a cancel's
        # --reason, an agent's log path, many notes on a large job)
        object.__setattr__(self, "reason", bounded(self.reason))

    @property
    def size(self) -> int:
        return gpu_count(self.gpus)

    def attained(self, now: float) -> float:
        """The GPU-seconds it has held up to ``now``."""
        held = self.size * max(0.0, now - self.changed) if self.phase is Phase.RUNNING else 0.0
        return self.gpu_s + held

    def held(self, now: float) -> float:
        """The seconds it has held GPUs up to ``now``."""
        running = self.phase is Phase.RUNNING and self.gpus
        return self.held_s + (max(0.0, now - self.changed) if running else 0.0)

    def fields(self) -> dict[str, Any]:
        """The record's fields (a fleet event carries them too)."""
        return {
            "phase": self.phase.value,
            "gpus": {h: list(ix) for h, ix in self.gpus},
            "changed": self.changed,
            "reason": self.reason,
            "gpu_s": self.gpu_s,
            "started": self.started,
            "held_s": self.held_s,
            "suspends": self.suspends,
        }

    def to_json(self) -> bytes:
        return dump_record(self.fields())

    @staticmethod
    def from_json(raw: bytes, key: str) -> JobStatus:
        where = f"The job status at {key}"
        f = load_record(raw, where)
        phase_text = f.text("phase", 16)
        try:
            phase = Phase(phase_text)
        except ValueError:
            raise f.fail(
                f"field 'phase' is {phase_text!r}; expected one of "
                f"{', '.join(p.value for p in Phase)}."
            ) from None
        gpus = []
        for host, indices in sorted(f.value("gpus", dict).items()):
            if (
                not ID_RE.match(host)
                or not isinstance(indices, list)
                or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= 1024
                    for i in indices
                )
            ):
                raise f.fail(
                    f"field 'gpus' has {host[:64]!r}: {indices!r}; expected a host id and "
                    "GPU indices."
                )
            gpus.append((host, tuple(sorted(set(indices)))))
        # (the allocator's counts: absent in a record written before they were kept)
        return JobStatus(
            phase,
            tuple(gpus),
            f.number("changed"),
            f.text("reason", REASON_MAX),
            f.number("gpu_s", 0.0) if "gpu_s" in f else 0.0,
            f.number("started") if "started" in f else 0.0,
            f.number("held_s", 0.0) if "held_s" in f else 0.0,
            f.count("suspends", 0, 1 << 30) if "suspends" in f else 0,
        )


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """One change of one job's status, under ``events/<time in ns>-<job>`` (not bound to a
    lease): the fleet's history, from which ``efdl jobs`` and ``efdl timeline --fleet`` tell
    who held which GPUs when."""

    time: float
    job_id: str
    status: JobStatus

    def key(self, keys: FleetKeys) -> str:
        return f"{keys.events_at(self.time)}-{self.job_id}"

    def to_json(self) -> bytes:
        return dump_record({"time": self.time, "job_id": self.job_id, **self.status.fields()})

    @staticmethod
    def from_json(raw: bytes, key: str) -> FleetEvent:
        f = load_record(raw, f"The fleet event at {key}")
        job_id = f.text("job_id", 128)
        if not ID_RE.match(job_id):
            raise f.fail(f"field 'job_id' is {job_id[:64]!r}, not a job id.")
        return FleetEvent(f.number("time"), job_id, JobStatus.from_json(raw, key))
