"""The agent <-> worker messages: one frozen dataclass each, one encoding for all.

On the wire a message is one JSON object per line, ``{"type": <kind>, <field>: <value>...}``
(:func:`encode`); :func:`decode` gives back the dataclass, or None for a line that is not one
of these with fields of the right types (logged by the caller, never acted on).

Worker -> agent: :class:`Hello`, :class:`Stepped`, :class:`Agreed`, :class:`Rescaled`,
:class:`PeerFailed`, :class:`Persisted`, :class:`ResumedFromCache`, :class:`StateLost`.
Agent -> worker: :class:`Placed`, :class:`Leave`, :class:`Waiting`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker stands in one generation.

    ``job_step``: the job's newest committed step as its agent knew it (etcd's progress
    record, and its own workers' commits): a generation in which no rank holds state must
    not start over from step 0 if it is above 0, nor one whose holders are behind it go on
    from their older step (efdl.errors.StateLostError). ``job_generation``: the generation
    that committed it (a holder of an older generation's line is behind it whatever its
    step: efdl.worker.transaction).
    """

    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    job_step: int = 0
    job_generation: int = 0


# ---------------------------------------------------------------- worker -> agent


@dataclass(frozen=True, slots=True)
class Hello:
    """An efdl-aware worker connects: it rebuilds in place (rounds, not restarts)."""

    KIND: ClassVar[str] = "hello"
    pid: int
    local_rank: int


@dataclass(frozen=True, slots=True)
class Stepped:
    """A plain script's worker took an optimizer step (efdl.launcher.stepwatch): sent without
    a hello, so it names its process."""

    KIND: ClassVar[str] = "stepped"
    time: float
    pid: int


@dataclass(frozen=True, slots=True)
class Agreed:
    """Local rank 0 committed ``step``, and every rank of ``generation`` holds ``agreed`` or
    newer (the job's progress record; at most once a second)."""

    KIND: ClassVar[str] = "progress"
    step: int
    agreed: int
    generation: int


@dataclass(frozen=True, slots=True)
class Rescaled:
    """Rank 0's first commit in a new generation: training went on at ``world_size`` after
    standing still ``stood_still`` seconds."""

    KIND: ClassVar[str] = "rescaled"
    generation: int
    world_size: int
    step: int
    stood_still: float


@dataclass(frozen=True, slots=True)
class PeerFailed:
    """A peer's connection closed in ``generation``: probe the job's nodes now."""

    KIND: ClassVar[str] = "peer_failed"
    generation: int


@dataclass(frozen=True, slots=True)
class Persisted:
    """Rank 0 wrote a snapshot of ``step`` to the remote cache."""

    KIND: ClassVar[str] = "persisted"
    step: int
    epoch: int | None
    world_size: int
    bytes: int
    seconds: float
    generation: int


@dataclass(frozen=True, slots=True)
class ResumedFromCache:
    """The generation resumed from the snapshot of ``step`` in ``source``: "the cache" (the
    remote cache) or "the peer copies" (efdl.worker.peers)."""

    KIND: ClassVar[str] = "resumed"
    step: int
    source: str = "the cache"


@dataclass(frozen=True, slots=True)
class Paced:
    """Local rank 0's node took ``node_s`` seconds of its own per step (median over ``steps``
    steps of ``generation``) while the other nodes took ``others_s`` (efdl.worker.pace);
    ``slower``: how many other nodes were slower still (0: this node is the slowest, the one
    that may leave first)."""

    KIND: ClassVar[str] = "pace"
    generation: int
    node_s: float
    others_s: float
    steps: int
    slower: int = 0


@dataclass(frozen=True, slots=True)
class StateLost:
    """No rank holds the job's state and nothing can bring it back: the error's text."""

    KIND: ClassVar[str] = "state_lost"
    message: str


# ---------------------------------------------------------------- agent -> worker


@dataclass(frozen=True, slots=True)
class Placed:
    """A new round places the worker (efdl.worker.channel.AgentChannel)."""

    KIND: ClassVar[str] = "round"
    placement: Placement


@dataclass(frozen=True, slots=True)
class Leave:
    """Leave at the next step boundary (this node leaves, or the worker is not placed)."""

    KIND: ClassVar[str] = "leave"


@dataclass(frozen=True, slots=True)
class Waiting:
    """The job waits below --min for up to ``for_s`` (its join timeout): a placement may take
    that long."""

    KIND: ClassVar[str] = "waiting"
    for_s: float


ToAgent = (
    Hello
    | Stepped
    | Agreed
    | Rescaled
    | PeerFailed
    | Persisted
    | ResumedFromCache
    | Paced
    | StateLost
)
ToWorker = Placed | Leave | Waiting
Message = ToAgent | ToWorker

_KINDS: dict[str, type[Any]] = {
    cls.KIND: cls
    for cls in (
        Hello, Stepped, Agreed, Rescaled, PeerFailed, Persisted, ResumedFromCache, Paced, StateLost,
        Placed, Leave, Waiting,
    )
}  # fmt: skip


def encode(message: Message) -> bytes:
    """One JSON line (a :class:`Placed` carries its placement's fields inline)."""
    if isinstance(message, Placed):
        fields = dataclasses.asdict(message.placement)
    else:
        fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    return (json.dumps({"type": message.KIND, **fields}) + "\n").encode()


def decode(data: object) -> Message | None:
    """The message a decoded JSON line holds; None if it is not one (an unknown kind, a
    field missing or of the wrong type)."""
    if not isinstance(data, dict):
        return None
    cls = _KINDS.get(str(data.get("type")))
    if cls is None:
        return None
    if cls is Placed:
        placement = _build(Placement, data)
        return None if placement is None else Placed(placement)
    return typing.cast(Message | None, _build(cls, data))


def _build(cls: type[Any], data: dict[str, Any]) -> Any:
    hints = _HINTS[cls]
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING:
                return None
            continue
        value, hint = data[f.name], hints[f.name]
        if not _fits(value, hint):
            return None
        values[f.name] = float(value) if hint is float else value
    return cls(**values)


def _fits(value: object, hint: object) -> bool:
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    args = typing.get_args(hint)  # X | None
    return value is None or any(_fits(value, a) for a in args if a is not type(None))


# Each message's field types, read once (the annotations are strings until resolved).
_HINTS: dict[type[Any], dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in (*_KINDS.values(), Placement)
}
