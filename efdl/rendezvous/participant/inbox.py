"""What a node's rendezvous thread is told, one type per kind, from every thread that tells
it: the watches (:class:`Watched`), the lease's thread, the probes, the agent's calls."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from efdl.errors import StoreError
from efdl.rendezvous.api import WatchBatch
from efdl.rendezvous.participant.liveness import Target
from efdl.rendezvous.probe import Reply


class WatchKind(StrEnum):
    ROUND = "round"  # the round key, for good
    PREDECESSOR = "predecessor"  # the node just before this one, while following
    NODES = "nodes"  # every node record, while leading
    FAILURES = "failures"  # the failure reports, while leading
    HOLDS = "holds"  # the nodes held out (efdl.rendezvous.holds), while leading


@dataclass(frozen=True, slots=True)
class Watched:
    """A batch of one of the node's watches, or its failure for good; ``term``: the election
    it belongs to (what a watch of an earlier one still delivers is dropped)."""

    kind: WatchKind
    item: WatchBatch | StoreError
    term: int


@dataclass(frozen=True, slots=True)
class Stop:
    """The node leaves, or is abandoned: the thread ends."""


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    """etcd said the lease has expired: register again."""


@dataclass(frozen=True, slots=True)
class Serve:
    """This node heads the newest round, which is not served yet: serve its store."""


@dataclass(frozen=True, slots=True)
class Publish:
    """The node record has changes not written yet."""


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing new: decide again (a new leader; a wait's deadline passed)."""


@dataclass(frozen=True, slots=True)
class Forgot:
    """etcd forgot what it held (``why``): take in what it holds now."""

    why: str


@dataclass(frozen=True, slots=True)
class FailureSeen:
    """A collective of this node's workers failed in ``generation``."""

    generation: int


@dataclass(frozen=True, slots=True)
class Probed:
    """What the nodes' probe ports said (efdl.rendezvous.participant.liveness)."""

    replies: tuple[tuple[Target, Reply], ...]


@dataclass(frozen=True, slots=True)
class Asked:
    """What the agents of members whose record went said (by node id; efdl.rendezvous.
    participant.leading)."""

    replies: dict[str, tuple[Reply, dict[str, Any] | None]]


Message = (
    Watched | Stop | LeaseExpired | Serve | Publish | Wake | Forgot | FailureSeen | Probed | Asked
)
