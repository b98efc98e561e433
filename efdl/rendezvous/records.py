"""What the rendezvous keeps in etcd: keys, node records and rounds, with strict JSON codecs.

Everything read from etcd is untrusted input: a record that does not parse raises
:class:`RecordError` naming the key and the field, and the caller logs it and skips it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from efdl.errors import ConfigError, EfdlError
from efdl.fields import Fields

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a job id or a node id
# A host name or an IP address (v6 with an optional zone): what workers connect to.
HOST_RE = re.compile(r"^[A-Za-z0-9._:%\[\]-]{1,253}$")
ROOT = "/efdl"


class RecordError(EfdlError):
    """A value in etcd is not a valid efdl record."""


def check_id(value: str, what: str = "job id") -> str:
    """Return ``value`` (a job id or a node id) if it is safe as one path segment of an etcd
    key.

    Raises:
        ConfigError: it could escape its prefix (``/``, ``..``) or is otherwise odd.
    """
    if not ID_RE.match(value) or ".." in value:
        raise ConfigError(
            f"The {what} {value!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/' and no '..')."
        )
    return value


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The etcd keys of one job; nothing outside ``/efdl/<job>/`` is ever touched."""

    job_id: str

    def __post_init__(self) -> None:
        check_id(self.job_id)

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.job_id}/"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes/"

    @property
    def round(self) -> str:
        return self.prefix + "round"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def events(self) -> str:
        """The job's history (efdl.history), not bound to any lease."""
        return self.prefix + "events/"

    @property
    def failures(self) -> str:
        """Reports of failed collectives (``failures/<node>``: the generation), bound to the
        reporter's lease; the leader watches them and probes the job's nodes."""
        return self.prefix + "failures/"

    def failure(self, node_id: str) -> str:
        return self.failures + node_id

    @property
    def members(self) -> str:
        return self.prefix + "members/"

    def member(self, node_id: str) -> str:
        return self.members + node_id

    @property
    def cache(self) -> str:
        """The newest persisted snapshot (not bound to a lease: it outlives every node)."""
        return self.prefix + "cache"

    @property
    def progress(self) -> str:
        """The job's newest committed step (:class:`Progress`; not bound to a lease: a job
        whose every worker died must still know that it had trained)."""
        return self.prefix + "progress"

    @property
    def holds(self) -> str:
        """Nodes held out of the job (drained, quarantined: efdl.rendezvous.holds), one
        record per node, not bound to a lease: a hold outlives the agent that wrote it."""
        return self.prefix + "holds/"

    def hold(self, node_id: str) -> str:
        return self.holds + node_id

    def node_id_of(self, key: str) -> str:
        """The node id at the end of a ``nodes/``, ``members/``, ``failures/`` or ``holds/``
        key."""
        return key.rsplit("/", 1)[-1]


# ---------------------------------------------------------------- validation helpers


# etcd's default request limit (--max-request-bytes): no record efdl writes comes near it (no
# record grows with the fleet; tests/unit/test_model.py writes one of 4096 nodes).
RECORD_LIMIT = 3 << 19


def load_record(raw: bytes, where: str) -> Fields:
    """The fields of a JSON record read from etcd at ``where`` (a RecordError if it is not
    one)."""
    if len(raw) > RECORD_LIMIT:
        raise RecordError(f"{where} is larger than etcd's request limit (1.5 MiB).")
    return Fields.parse(raw, where, RecordError)


def dump_record(obj: Any) -> bytes:
    """A record as etcd keeps it: compact JSON with sorted keys."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


# ---------------------------------------------------------------- node records


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A GPU behind a worker slot: NVML's index (a MIG instance: its parent's), product name,
    memory, and UUID (``GPU-...`` or ``MIG-...``; empty in records of efdl 0.1 agents)."""

    index: int
    model: str = ""
    memory_mb: int = 0
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node agent offers, under ``nodes/<node_id>``, bound to its lease.

    Attributes:
        node_id: unique within the job.
        host: the address peers use to reach this node (store, workers).
        store_port: where this agent serves the c10d store when it holds rank 0.
        slots: how many workers it can run (its free GPUs, or --nproc-per-node on CPU).
        gpus: the GPUs behind the slots; empty on CPU hosts.
        cpus: CPU count, for thread shares.
        version: efdl version of the agent.
        start_time: wall-clock seconds when the agent started.
        incarnation: bumped by the agent to ask for a new round without a membership change
            (its workers failed and were restarted).
        down: slots whose in-place worker died and whose replacement is not ready yet; the
            node offers ``slots - down`` workers until it is (see :attr:`offered`).
        probe_port: where the agent accepts connections while it lives (0: nowhere); a
            refused connection there is evidence that it died (efdl.rendezvous.probe).
        holds: the ``round_id`` of the round whose workers this node still runs, written
            when it registers again after its lease was lost (etcd revoked it, or it expired
            while etcd was away): the leader then takes it for the member it was, not for a
            newcomer, and no round follows. Empty: a node that joins.
        fence_s: its workers stop committing this long after its agent last reached etcd
            (efdl.worker.fence); 0: an agent that does not fence (an older one).
    """

    node_id: str
    host: str
    store_port: int
    slots: int
    gpus: tuple[GpuInfo, ...] = ()
    cpus: int = 1
    version: str = ""
    start_time: float = 0.0
    incarnation: int = 0
    down: int = 0
    probe_port: int = 0
    holds: str = ""
    fence_s: float = 0.0

    @property
    def offered(self) -> int:
        """How many workers the node can run now."""
        return self.slots - self.down

    def to_json(self) -> bytes:
        return dump_record(asdict(self))

    @staticmethod
    def from_json(raw: bytes, key: str) -> NodeRecord:
        where = f"The node record at {key}"
        f = load_record(raw, where)
        gpus = []
        for i, item in enumerate(f.value("gpus", list)):
            g = Fields(item, f"{where} (gpus[{i}])", RecordError)
            gpus.append(
                GpuInfo(
                    g.count("index", 0, 1024),
                    g.text("model"),
                    g.count("memory_mb"),
                    g.text("uuid", 96) if "uuid" in g else "",
                )
            )
        record = NodeRecord(
            node_id=f.text("node_id", 128),
            host=f.text("host"),
            store_port=f.count("store_port", 0, 65535),
            slots=f.count("slots", 1, 4096),
            gpus=tuple(gpus),
            cpus=f.count("cpus", 1, 1 << 16),
            version=f.text("version", 64),
            start_time=f.number("start_time"),
            incarnation=f.count("incarnation", 0, 1 << 40),
        )
        if "down" in f:  # absent from the records of older agents
            record = replace(record, down=f.count("down", 0, record.slots))
        if "probe_port" in f:
            record = replace(record, probe_port=f.count("probe_port", 0, 65535))
        if "holds" in f:
            record = replace(record, holds=f.text("holds", 64))
        if "fence_s" in f:
            record = replace(record, fence_s=f.number("fence_s", 0.0, 1e6))
        if not ID_RE.match(record.node_id) or key.rsplit("/", 1)[-1] != record.node_id:
            raise RecordError(f"{where} names node {record.node_id!r}, not the node of its key.")
        if not HOST_RE.match(record.host):
            raise RecordError(
                f"{where} field 'host' is {record.host[:64]!r}, not a host name or IP address."
            )
        return record


# ---------------------------------------------------------------- the remote cache


@dataclass(frozen=True, slots=True)
class CacheRecord:
    """The job's newest complete snapshot in its remote cache, under ``cache``.

    Tells a resume from a cold start (and ``efdl status`` shows it).
    """

    step: int
    epoch: int | None
    world_size: int
    url: str
    time: float
    generation: int = 0  # the generation that persisted it (efdl.rendezvous.outputs)

    def to_json(self) -> bytes:
        return dump_record(asdict(self))

    @property
    def position(self) -> tuple[int, int]:
        return (self.generation, self.step)

    @staticmethod
    def from_json(raw: bytes, key: str) -> CacheRecord:
        where = f"The cache record at {key}"
        f = load_record(raw, where)
        return CacheRecord(
            step=f.count("step", 0, 1 << 62),
            epoch=f.optional_count("epoch", 0, 1 << 40),
            world_size=f.count("world_size", 1, 1 << 20),
            url=f.text("url", 4096),
            time=f.number("time"),
            generation=f.optional_count("generation", 0, 1 << 40) or 0,
        )


@dataclass(frozen=True, slots=True)
class Progress:
    """The job's newest committed step, under ``progress``: written by the agent of the node
    that runs rank 0 (at most once a second, off its event loop), deleted by a new run.

    ``step`` is the newest step that every rank of ``generation`` committed (the one the
    per-commit agreement confirmed; with rollback copies, the newest copy's): a rank that
    survives a failure of that generation holds it or a newer one. A generation in which no
    rank holds state and no snapshot can be resumed, after this step was committed, is an
    error (:class:`~efdl.errors.StateLostError`), not a cold start; so is one whose holders
    are all behind it. Written only over a record of an older position
    (efdl.rendezvous.outputs).
    """

    step: int
    generation: int
    time: float

    def to_json(self) -> bytes:
        return dump_record(asdict(self))

    @property
    def position(self) -> tuple[int, int]:
        return (self.generation, self.step)

    @staticmethod
    def from_json(raw: bytes, key: str) -> Progress:
        f = load_record(raw, f"The progress record at {key}")
        return Progress(
            f.count("step", 0, 1 << 62), f.count("generation", 0, 1 << 40), f.number("time")
        )


# ---------------------------------------------------------------- rounds


class RoundStatus(StrEnum):
    ACTIVE = "active"  # train with these members
    WAITING = "waiting"  # fewer than --min workers: stop and wait for more
    FAILED = "failed"  # waited longer than the join timeout: exit with an error
    CLOSED = "closed"  # `efdl stop`: stop the workers, exit cleanly
    FINISHED = "finished"  # a node's workers all completed: let the others finish, exit

    @property
    def final(self) -> bool:
        """No round follows this one."""
        return self in (RoundStatus.FAILED, RoundStatus.CLOSED, RoundStatus.FINISHED)


@dataclass(frozen=True, slots=True)
class Member:
    """One node's place in a round, under ``members/<node_id>``: how many workers it runs and
    the global rank of its first one. The leader writes every member's record before the
    round; a node reads only its own (so no record and no watch grows with the fleet).

    Attributes:
        group_rank: the node's index in rank order (torchrun's GROUP_RANK).
        incarnation, revision: what the node's record said when the round was made: its
            incarnation (a higher one later: it restarted its workers) and the etcd revision
            that created it (another one later: it joined again under the same id, e.g. after
            being restarted under the same id). 0: not recorded.
        generation, round_id: the round it was written for; a record whose ``round_id`` is
            not the round's is left over from another round (its node is not a member).
        probe_port: where the node's agent answered probes when the round was made (0:
            nowhere). A leader that sees the member's record go asks it there whether it still
            runs the round's workers and is registering again (efdl.rendezvous.participant).
        fence_s: the node's fence timeout when the round was made (its record's): a leader
            replaces a generation cut off from etcd whole no sooner than this (and a margin)
            after its members' records went (efdl.worker.fence). 0: it does not fence.
    """

    node_id: str
    workers: int
    first_rank: int
    host: str = ""
    incarnation: int = 0
    revision: int = 0
    group_rank: int = 0
    generation: int = 0
    round_id: str = ""
    probe_port: int = 0
    fence_s: float = 0.0

    def to_json(self) -> bytes:
        return dump_record(asdict(self))

    @staticmethod
    def from_json(raw: bytes, key: str) -> Member:
        where = f"The member record at {key}"
        f = load_record(raw, where)
        member = Member(
            f.text("node_id", 128),
            f.count("workers", 1, 4096),
            f.count("first_rank", 0, 1 << 20),
            f.text("host"),
            f.count("incarnation", 0, 1 << 40),
            f.count("revision", 0, 1 << 62),
            f.count("group_rank", 0, 1 << 20),
            f.count("generation", 1, 1 << 40),
            f.text("round_id", 64),
        )
        if "probe_port" in f:  # absent from the records of older leaders
            member = replace(member, probe_port=f.count("probe_port", 0, 65535))
        if "fence_s" in f:
            member = replace(member, fence_s=f.number("fence_s", 0.0, 1e6))
        if key.rsplit("/", 1)[-1] != member.node_id:
            raise RecordError(f"{where} names node {member.node_id!r}, not the node of its key.")
        return member


@dataclass(frozen=True, slots=True)
class Round:
    """One generation of the job, written by the leader alone with compare-and-swap, under
    ``round``; every agent watches it, so its size does not depend on the fleet's: the
    members are in records of their own (:class:`Member`).

    Attributes:
        generation: 1, 2, ...; each round is acted on exactly once.
        status: what agents do with it.
        world_size: workers in the round.
        nodes: member nodes in the round.
        head: the node that runs rank 0 (serves the generation's c10d store).
        round_id: names this round; its members' records carry it.
        members_revision: the etcd revision at which the leader had written every member's
            record (later writes may be of the next round's); a node reads its own there.
        spares: live nodes beyond the members (waiting beyond --max, or below --min).
        store_host, store_port: the c10d store of this generation, served fresh by the rank-0
            node's agent; port 0 until that agent has published it.
        reason: why this round was made, for logs and ``efdl status``.
        leader: the node that wrote it.
        since: wall-clock seconds when the current state (e.g. WAITING) began.
        created: wall-clock seconds when this round was written.
        member: the reading node's own member record (None: not a member); filled in by the
            node's agent, not part of the round key.
    """

    generation: int
    status: RoundStatus
    world_size: int = 0
    nodes: int = 0
    head: str = ""
    round_id: str = ""
    members_revision: int = 0
    spares: int = 0
    store_host: str = ""
    store_port: int = 0
    reason: str = ""
    leader: str = ""
    since: float = 0.0
    created: float = 0.0
    member: Member | None = None

    @property
    def served(self) -> bool:
        """Whether agents may act on it: an ACTIVE round is served once the rank-0 node's agent
        has published the port of the generation's fresh c10d store (until then no worker
        could reach a store that holds only this generation's keys)."""
        return self.status is not RoundStatus.ACTIVE or self.store_port != 0

    def to_json(self) -> bytes:
        data = asdict(self)
        del data["member"]
        data["status"] = self.status.value
        return dump_record(data)

    @staticmethod
    def from_json(raw: bytes, key: str) -> Round:
        where = f"The round at {key}"
        f = load_record(raw, where)
        status_text = f.text("status", 16)
        try:
            status = RoundStatus(status_text)
        except ValueError:
            raise RecordError(
                f"{where} has status {status_text!r}; expected one of "
                f"{', '.join(s.value for s in RoundStatus)}."
            ) from None
        world_size = f.count("world_size", 0, 1 << 20)
        nodes = f.count("nodes", 0, 1 << 20)
        head = f.text("head", 128)
        if status is RoundStatus.ACTIVE and not (0 < nodes <= world_size and head):
            raise RecordError(
                f"{where} is active with {nodes} nodes, {world_size} workers and head {head!r}; "
                "expected at least one node, no more nodes than workers, and a head node."
            )
        return Round(
            generation=f.count("generation", 1, 1 << 40),
            status=status,
            world_size=world_size,
            nodes=nodes,
            head=head,
            round_id=f.text("round_id", 64),
            members_revision=f.count("members_revision", 0, 1 << 62),
            spares=f.count("spares", 0, 1 << 20),
            store_host=f.text("store_host"),
            store_port=f.count("store_port", 0, 65535),
            reason=f.text("reason", 4096),
            leader=f.text("leader", 128),
            since=f.number("since"),
            created=f.number("created"),
        )


# ---------------------------------------------------------------- the job's history


class EventKind(StrEnum):
    ROUND = "round"  # the leader wrote a round (any status)
    JOIN = "join"
    LEAVE = "leave"
    CRASH = "crash"  # a worker failed
    RESTART = "restart"  # workers restarted, or a lost in-place worker replaced
    EVICT = "evict"  # a dead node's lease ended on evidence (efdl.rendezvous.probe)
    LEASE_LOST = "lease-lost"  # the lease expired or was revoked: registered again, training on
    HANG = "hang"  # a worker made no step for the hang timeout while its peers waited: replaced
    PERSIST = "persist"  # rank 0 wrote a snapshot to the remote cache
    RESUME = "resume"  # the job resumed from the remote cache
    RESCALE = "rescale"  # training went on at a new size; ``seconds``: how long it stood still
    SLOW = "slow"  # this node's own work per step was slower than the others' (efdl.worker.pace)
    HOLD = "hold"  # a node was held out (drained or quarantined): ``<kind>: <reason>``
    RELEASE = "release"  # a node's hold was released (or ended): it may be placed again
    HEALTH = "health"  # a health check's warning that holds nothing out (throttling)


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to the job, under ``events/<time in ns>-<node>``
    (efdl.history).

    Attributes:
        time: wall-clock seconds.
        kind: what.
        node: the node it happened to (a round: the leader; an eviction: the evicted).
        generation: the round generation it happened in (or made).
        text: one line for people; a round's is ``<status>: <reason>``.
        world_size: the world size it left or made, where that means something (0: none).
        step: the training step it concerns (-1: none).
        seconds: a duration it measured (rescale: stood still; persist: writing), or -1.
    """

    time: float
    kind: EventKind
    node: str
    generation: int
    text: str
    world_size: int = 0
    step: int = -1
    seconds: float = -1.0

    @staticmethod
    def of_round(time: float, node: str, r: Round) -> Event:
        return Event(
            time, EventKind.ROUND, node, r.generation, f"{r.status.value}: {r.reason}", r.world_size
        )

    @property
    def round_status(self) -> RoundStatus | None:
        """A round event's status (None for other kinds)."""
        if self.kind is not EventKind.ROUND:
            return None
        try:
            return RoundStatus(self.text.split(":", 1)[0])
        except ValueError:
            return None

    def to_json(self) -> bytes:
        return dump_record(asdict(self))

    @staticmethod
    def from_json(raw: bytes, key: str) -> Event:
        where = f"The event at {key}"
        f = load_record(raw, where)
        kind = f.text("kind")
        if kind not in EventKind.__members__.values():
            raise RecordError(f"{where} has kind {kind!r}; expected one of {', '.join(EventKind)}.")
        return Event(
            f.number("time"),
            EventKind(kind),
            f.text("node", 128),
            f.count("generation", 0, 1 << 40),
            f.text("text", 1000),
            f.count("world_size", 0, 1 << 24),
            f.count("step", -1, 1 << 62),
            f.number("seconds"),
        )

    def key(self, keys: JobKeys) -> str:
        return f"{keys.events}{int(self.time * 1e9):019d}-{self.node}"
