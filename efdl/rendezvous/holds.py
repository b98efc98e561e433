"""Nodes held out of a job: drained for maintenance, or quarantined as bad.

A hold is one record per node under ``/efdl/<job>/holds/<node>``, not bound to a lease: it
outlives the agent that wrote it (a node restarted by systemd is still held), and it is
written by whoever holds the node out: ``efdl drain``, the node's own agent (SIGUSR2, a
failed health check, a crash loop, a straggler), or an operator's script. The leader never
places a held node (efdl.rendezvous.decide: ``JobView.held``); the node's agent stays,
registered, and waits, as a spare that is not offered, until the hold is released
(``efdl release``: the record deleted) or, for a quarantine, its ``until`` has passed.

A fleet holds whole hosts the same way, under ``/efdl-fleet/<fleet>/holds/<host>`` (``efdl
drain --fleet``; a host's daemon quarantines its host when a job quarantined one of its
agents there): the fleet's allocator gives a held host's GPUs to no job (efdl.fleet.allocate).

A record is untrusted input: one that does not parse raises :class:`RecordError` naming the
key and the field, and readers log it and skip it (a node with a bad hold record is not
held: a typo must not take nodes out of a job silently, and the log names the key).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Protocol

from efdl.errors import ConfigError
from efdl.rendezvous.api import KeyValue, KVStore
from efdl.rendezvous.records import (
    ID_RE,
    RecordError,
    check_id,
    dump_record,
    load_record,
)

log = logging.getLogger(__name__)

REASON_LIMIT = 900  # characters of a reason kept (an event's text holds 1000)


class HoldKeys(Protocol):
    """Where holds live: a job's (efdl.rendezvous.records.JobKeys, by node) or a fleet's
    (efdl.fleet.records.FleetKeys, by host)."""

    @property
    def holds(self) -> str: ...

    def hold(self, node_id: str, /) -> str: ...

    def node_id_of(self, key: str, /) -> str: ...


class HoldKind(StrEnum):
    """Why a node is held out."""

    DRAIN = "drain"  # an operator's: for maintenance, until released
    QUARANTINE = "quarantine"  # the node's own: a failed health check, a crash loop; a TTL


@dataclass(frozen=True, slots=True)
class Hold:
    """A node held out of the job, under ``holds/<node>``.

    Attributes:
        node: the held node's id.
        kind: drain or quarantine.
        reason: one line for people: what was found, naming the GPU, path or error.
        since: wall-clock seconds when it was written.
        until: wall-clock seconds when it ends by itself; None: until released (a drain).
    """

    node: str
    kind: HoldKind
    reason: str
    since: float
    until: float | None = None

    def active(self, wall: float) -> bool:
        """Whether it holds the node out at wall-clock time ``wall`` (a past ``until`` is
        no hold)."""
        return self.until is None or wall < self.until

    def describe(self, wall: float) -> str:
        """``quarantine: <reason> (since ..., 40 min left)``, for logs and ``efdl nodes``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        if self.until is None:
            left = "until released (efdl release)"
        elif self.until <= wall:
            left = "ended"
        else:
            left = f"{_duration(self.until - wall)} left"
        return f"{self.kind.value}: {self.reason} (since {when}, {left})"

    def to_json(self) -> bytes:
        data = asdict(self)
        data["kind"] = self.kind.value
        return dump_record(data)

    @staticmethod
    def from_json(raw: bytes, key: str) -> Hold:
        where = f"The hold record at {key}"
        f = load_record(raw, where)
        kind_text = f.text("kind", 16)
        try:
            kind = HoldKind(kind_text)
        except ValueError:
            raise RecordError(
                f"{where} has kind {kind_text!r}; expected one of "
                f"{', '.join(k.value for k in HoldKind)}."
            ) from None
        node = f.text("node", 128)
        if not ID_RE.match(node) or key.rsplit("/", 1)[-1] != node:
            raise RecordError(f"{where} names node {node!r}, not the node of its key.")
        since = f.number("since", 0.0, 1e11)
        until = None if f.data.get("until") is None else f.number("until", 0.0, 1e11)
        if kind is HoldKind.QUARANTINE and until is None:
            raise RecordError(
                f"{where} is a quarantine with no 'until'; expected the wall-clock time it "
                "ends (a hold until released is a drain)."
            )
        return Hold(node, kind, f.text("reason", 4096), since, until)


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def make_hold(node: str, kind: HoldKind, reason: str, ttl_s: float | None, wall: float) -> Hold:
    """A hold of ``node`` from ``wall`` on (pure; :func:`hold` writes one).

    Raises:
        ConfigError: a bad node id, a quarantine without a positive TTL, or a drain with one.
    """
    check_id(node, "node id")
    if kind is HoldKind.QUARANTINE and (ttl_s is None or not ttl_s > 0):
        raise ConfigError(
            f"A quarantine of node {node} needs a positive time to live; got {ttl_s!r} s "
            "(--quarantine-ttl)."
        )
    if kind is HoldKind.DRAIN and ttl_s is not None:
        raise ConfigError(
            f"A drain of node {node} lasts until released; got a time to live of {ttl_s!r} s "
            "(quarantine a node to hold it out for a while)."
        )
    return Hold(node, kind, normal_reason(reason), wall, None if ttl_s is None else wall + ttl_s)


def normal_reason(reason: str) -> str:
    """A reason as a hold keeps it: one line, at most :data:`REASON_LIMIT` characters."""
    text = " ".join(reason.split()) or "no reason given"
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def hold(
    store: KVStore,
    keys: HoldKeys,
    node: str,
    kind: HoldKind,
    reason: str,
    ttl_s: float | None,
    wall: float | None = None,
    since: float | None = None,
) -> Hold:
    """Hold ``node`` out of job ``keys`` (one put; a hold already there is replaced): the
    leader's next round leaves it out, and its agent waits until the hold is released or,
    for a quarantine, ``ttl_s`` has passed. ``since``: when it began, if earlier than now
    (a quarantine renewed). Returns the hold written.

    Raises:
        ConfigError: see :func:`make_hold`.
        StoreError: etcd failed (the hold may or may not have been written).
    """
    h = make_hold(node, kind, reason, ttl_s, time.time() if wall is None else wall)
    if since is not None:
        h = replace(h, since=min(since, h.since))
    store.put(keys.hold(node), h.to_json())
    return h


def release(store: KVStore, keys: HoldKeys, node: str) -> bool:
    """Delete ``node``'s hold, if any: the leader may place it again (a newcomer, after the
    settle window). Returns whether there was one.

    Raises:
        StoreError: etcd failed.
    """
    check_id(node, "node id")
    return store.delete(keys.hold(node)) > 0


def parse_holds(kvs: tuple[KeyValue, ...], keys: HoldKeys) -> dict[str, Hold]:
    """Holds from ``holds/`` keys, ended ones included; a record that does not parse is
    logged and skipped."""
    out: dict[str, Hold] = {}
    for kv in kvs:
        try:
            out[keys.node_id_of(kv.key)] = Hold.from_json(kv.value, kv.key)
        except RecordError as exc:
            log.error("Under %s: ignoring a bad hold record: %s", keys.holds, exc)
    return out


def read_holds(store: KVStore, keys: HoldKeys, now: float | None = None) -> dict[str, Hold]:
    """The holds in force at wall-clock ``now`` (default: now), by node: one range read.

    Raises:
        StoreError: etcd failed.
    """
    wall = time.time() if now is None else now
    found = parse_holds(store.get_prefix(keys.holds).kvs, keys)
    return {n: h for n, h in found.items() if h.active(wall)}
