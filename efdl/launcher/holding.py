"""This node's own hold (efdl.rendezvous.holds), as its agent sees and writes it, and the
health checks (efdl.launcher.health) that may write one.

The agent watches one key, ``holds/<its node>``, from before it joins: whoever holds the node
out (``efdl drain``, or the agent itself: SIGUSR2, a failed health check, a crash loop, a
straggler) the agent hears of it, says what it waits for, and knows when a quarantine ends.
The leader, which watches every hold, is the one that leaves the node out of its rounds: the
node's workers leave at a step boundary as those of any node a round leaves out, and the
agent stays, registered, waiting, as a spare that is not offered. Waiting has no deadline of
its own: a drain lasts until released (an agent under systemd waits for the operator, which is
the point of a drain), a quarantine until its ``until``; a job that cannot go on without the
node fails at the job's own join timeout, which ends every agent.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

from efdl.config import LaunchConfig
from efdl.errors import ConfigError, StoreError
from efdl.launcher import collective
from efdl.launcher.health import (
    Finding,
    HealthMonitor,
    HealthSettings,
    Severity,
    faults,
    local_cache_dir,
    reason_of,
)
from efdl.launcher.inbox import HealthFound, HoldChanged
from efdl.protocol.env import SIMULATED_GPUS_ENV
from efdl.rendezvous.api import EventType, KVStore, Watch, WatchBatch
from efdl.rendezvous.holds import Hold, HoldKind, hold, normal_reason, parse_holds
from efdl.rendezvous.records import EventKind, GpuInfo, JobKeys, NodeRecord

log = logging.getLogger(__name__)

# How long before a quarantine ends its node's health is checked again (at most a tenth of
# what is left): a node still bad has its quarantine renewed before the leader places it.
RECHECK_BEFORE_S = 30.0


def collective_of(
    asked: bool, slots: int, gpus: Sequence[GpuInfo], simulated: bool
) -> tuple[int, tuple[str, ...]] | None:
    """What the node's own collective runs over (efdl.launcher.health.HealthSettings): one
    rank per slot, on its GPUs by UUID (gloo on the CPU where it has none, or simulated
    ones); None unless ``--health-collective``."""
    if not asked:
        return None
    if simulated or not gpus:
        return slots, ()
    return len(gpus), tuple(g.uuid or str(g.index) for g in gpus)


def _collective_check(
    over: tuple[int, tuple[str, ...]] | None,
) -> Callable[[float], Finding | None] | None:
    """The node's own collective over ``over`` (ranks, devices), given its deadline."""
    return None if over is None else functools.partial(collective.check, *over)


class Holding:
    """Node ``node``'s hold in job ``job_id`` and its health checks, for its agent's loop.

    The hold is read and watched (:meth:`start`; its changes reach the loop as
    :class:`HoldChanged`, the health monitor's findings as :class:`HealthFound`, both through
    ``post``), written by :meth:`hold_out`, and timed: :meth:`due` and :meth:`on_timer` re-check
    a quarantined node's health shortly before its quarantine ends, and say when it ended.

    Args:
        cfg: the launch configuration (the quarantine TTL, the health flags, the cache).
        store: the job's etcd.
        job_id: the job.
        node: this node's record (its GPUs are checked).
        post: puts an event on the agent's queue (from any thread).
        record: writes an event of this node into the job's history (on the loop).
        tag: says the job, node and generation, for the log.
        environ: the environment (default ``os.environ``): with ``EFDL_SIMULATED_GPUS`` the
            GPUs are not read.
    """

    def __init__(
        self,
        cfg: LaunchConfig,
        store: KVStore,
        job_id: str,
        node: NodeRecord,
        post: Callable[[object], None],
        record: Callable[[EventKind, str], None],
        tag: Callable[[], str],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self._cfg = cfg
        self._store = store
        self._keys = JobKeys(job_id)
        self._node = node.node_id
        self._post = post
        self._record = record
        self._tag = tag
        self._watch: Watch | None = None
        self.current: Hold | None = None  # as last heard of (ended ones too)
        self._said: Hold | None = None  # the hold last said to be waited for
        self._ends: float | None = None  # monotonic: when the quarantine ends
        self._recheck_at: float | None = None  # monotonic: check health before it ends
        self._warned: frozenset[str] = frozenset()  # the health warnings said last
        self.snapshot_bytes = 0  # the last snapshot this node wrote (the disk check)
        simulated = bool(env.get(SIMULATED_GPUS_ENV))
        self._health = HealthMonitor(
            HealthSettings(
                cfg.health_interval_s,
                cfg.health_check,
                cfg.health_check_timeout_s,
                local_cache_dir(cfg.cache_for(job_id)),
                cfg.health_min_free_mb << 20,
                _collective_check(
                    collective_of(cfg.health_collective, node.slots, node.gpus, simulated)
                ),
            ),
            [] if simulated else [(g.index, g.uuid) for g in node.gpus if g.uuid],
            lambda: self.snapshot_bytes,
            tag,
        )

    # ---------------------------------------------------------------- before joining

    def start(self) -> None:
        """Read this node's hold and watch it from there on; says what it waits for if it is
        held.

        A watch that cannot start is said and not retried: the leader, which watches every
        hold, still leaves the node out; only this agent's words about it are lost."""
        key = self._keys.hold(self._node)
        try:
            snap = self._store.get_prefix(key)
            self.current = parse_holds(
                tuple(kv for kv in snap.kvs if kv.key == key), self._keys
            ).get(self._node)
            self._watch = self._store.watch(
                key, start_revision=snap.revision + 1, sink=self._on_batch
            )
        except StoreError as exc:
            log.warning("%s: cannot read this node's hold (%s).", self._tag(), exc)
        self.changed(self.current)

    def check_now(self) -> list[Finding]:
        """Run the health checks once, here (before joining); what they found ([]: they
        passed, said; or they failed to run, said too: a reader's bug must not keep the node
        out of the job)."""
        try:
            found = self._health.check(joining=True)
        except Exception as exc:
            log.warning("%s: the health checks failed to run: %s", self._tag(), exc)
            return []
        if not found:
            log.info("%s: the health checks passed.", self._tag())
        return found

    def start_checks(self) -> None:
        """Check every ``--health-interval`` from now on (the node has joined)."""
        self._health.start(lambda found: self._post(HealthFound(tuple(found))))

    def _on_batch(self, item: WatchBatch | StoreError) -> None:
        """From the watch's thread: the node's hold as it is now, to the loop."""
        if isinstance(item, StoreError):
            log.warning("%s: the watch of this node's hold failed: %s", self._tag(), item)
            return
        now: Hold | None = None if item.reset else self.current
        key = self._keys.hold(self._node)
        for ev in item.events:
            if ev.kv.key != key:
                continue
            if ev.type is EventType.DELETE:
                now = None
            else:
                now = parse_holds((ev.kv,), self._keys).get(self._node)
        self.current = now
        self._post(HoldChanged(now))

    # ---------------------------------------------------------------- on the loop

    def active(self, wall: float | None = None) -> Hold | None:
        """The node's hold in force now (None: none, or it ended); from any thread."""
        h = self.current
        return h if h is not None and h.active(time.time() if wall is None else wall) else None

    def text(self) -> str:
        """The node's hold in force, in words ("" if none); from any thread."""
        h = self.active()
        return h.describe(time.time()) if h is not None else ""

    def hold_out(self, kind: HoldKind, reason: str, ttl_s: float | None = None) -> Hold | None:
        """Hold this node out (one put, at once): the leader's next round leaves it out. A
        quarantine lasts ``ttl_s`` (default ``--quarantine-ttl``); one in force is renewed; a
        drain in force is kept (an operator's hold is not turned into a quarantine; the
        finding is recorded). Returns the hold in force, None if etcd did not take it
        (said; training is not stopped for etcd's sake)."""
        if kind is HoldKind.QUARANTINE and ttl_s is None:
            ttl_s = self._cfg.quarantine_ttl_s
        existing = self.active()
        if kind is HoldKind.QUARANTINE and existing is not None and existing.kind is HoldKind.DRAIN:
            log.warning(
                "%s: %s; this node is drained already, so it stays drained.", self._tag(), reason
            )
            self._record(EventKind.HEALTH, f"while drained: {reason}"[:900])
            return existing
        renewal = existing is not None and (existing.kind, existing.reason) == (
            kind,
            normal_reason(reason),
        )
        try:
            since = existing.since if renewal and existing is not None else None
            written = hold(self._store, self._keys, self._node, kind, reason, ttl_s, since=since)
        except (StoreError, ConfigError) as exc:
            log.error(
                "%s: could not hold this node out (%s: %s): %s",
                self._tag(),
                kind.value,
                reason,
                exc,
            )
            return None
        self.current = written
        if renewal:  # the same finding again: a longer hold, no new event
            log.info("%s: renewed this node's %s: %s.", self._tag(), kind.value, written.reason)
        else:
            self._record(EventKind.HOLD, f"{kind.value}: {written.reason}")
        self.changed(written)
        return written

    def changed(self, h: Hold | None) -> None:
        """This node's hold is ``h`` now (None: none): say what it waits for (once per
        hold), and time the end of a quarantine."""
        wall = time.time()
        if h is not None and h.active(wall):
            self._ends = self._recheck_at = None
            if h.until is not None:
                left = max(0.0, h.until - wall)
                self._ends = time.monotonic() + left
                # Checked again a little before it ends: still bad, it is renewed in time.
                self._recheck_at = self._ends - min(RECHECK_BEFORE_S, left / 10)
            if h != self._said:
                self._said = h
                log.warning(
                    "%s: this node is held out of the job (%s); waiting, not placed, until %s.",
                    self._tag(),
                    h.describe(wall),
                    "it is released (efdl release)"
                    if h.until is None
                    else "the quarantine ends or it is released (efdl release)",
                )
            return
        self._ends = self._recheck_at = None
        if self._said is not None:
            self._said = None
            log.info(
                "%s: this node's hold was released; it is offered to the job again.", self._tag()
            )

    def due(self) -> float | None:
        """When :meth:`on_timer` has something to do (monotonic), None: nothing."""
        due = [t for t in (self._recheck_at, self._ends) if t is not None]
        return min(due) if due else None

    def on_timer(self, now: float) -> bool:
        """Do what is due at ``now``: check the node's health again before its quarantine
        ends, or say that it ended (the leader places it again: it times the end too).
        Returns whether anything was due."""
        if self._recheck_at is not None and now >= self._recheck_at:
            self._recheck_at = None
            self._health.check_soon()
            return True
        if self._ends is not None and now >= self._ends:
            self._ends = None
            h, self._said = self._said, None
            text = f"the {h.kind.value} ended ({h.reason})" if h is not None else "the hold ended"
            log.info("%s: %s; this node is offered to the job again.", self._tag(), text)
            self._record(EventKind.RELEASE, text[:900])
            return True
        return False

    def found(self, findings: list[Finding]) -> None:
        """What a round of health checks found: a fault quarantines this node (renewing a
        quarantine in force); warnings are said and recorded when they change."""
        bad = faults(findings)
        if bad:
            self.hold_out(HoldKind.QUARANTINE, f"health check failed: {reason_of(bad)}")
        warnings = [f for f in findings if f.severity is Severity.WARNING]
        texts = frozenset(f.reason for f in warnings)
        if texts and texts != self._warned:
            text = reason_of(warnings)
            log.warning("%s: health warning: %s.", self._tag(), text)
            self._record(EventKind.HEALTH, text[:900])
        self._warned = texts

    def close(self) -> None:
        self._health.close()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
