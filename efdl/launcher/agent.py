"""The node agent: follows the job's rounds and runs this node's workers (restart mode).

Everything that happens reaches the agent as an event on one queue, handled on the main
thread: a new served round, a worker exit, a signal, a lost lease, a failed rendezvous.
On every new round the agent stops its workers and starts them again with the new ranks,
as torchrun does.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from efdl import logs
from efdl._process import private_dir
from efdl.config import LaunchConfig
from efdl.errors import EfdlError, StoreError
from efdl.launcher.env import JobContext, worker_env
from efdl.launcher.gpus import free_slot
from efdl.launcher.hangs import HangJudge
from efdl.launcher.metrics import Metrics
from efdl.launcher.node import interface_of
from efdl.launcher.publish import LatestPublisher
from efdl.launcher.restarts import RestartBudget, Verdict
from efdl.launcher.tcpstore import TCPStoreServer, preload
from efdl.launcher.warm import WarmPool, warm_pool
from efdl.launcher.workers import WorkerExit, WorkerGroup
from efdl.protocol.env import (
    BEAT_DIR_ENV,
    FENCE_ENV,
    GRACE_ENV,
    HANG_TIMEOUT_ENV,
    JOB_GENERATION_ENV,
    JOB_STEP_ENV,
    JOIN_TIMEOUT_ENV,
    PLACEMENT_TIMEOUT_ENV,
    SOCKET_ENV,
    STANDBY_ENV,
)
from efdl.protocol.messages import (
    Agreed,
    Hello,
    Leave,
    PeerFailed,
    Persisted,
    Placed,
    Placement,
    Rescaled,
    ResumedFromCache,
    StateLost,
    Stepped,
    ToAgent,
    Waiting,
)
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.lifecycle import end_job
from efdl.rendezvous.outputs import Position, guarded_put
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.probe import ProbeListener, Reply, ask
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import (
    CacheRecord,
    Event,
    EventKind,
    JobKeys,
    NodeRecord,
    Progress,
    RecordError,
    Round,
    RoundStatus,
)
from efdl.state.cache import CacheSettings, SnapshotStorage
from efdl.state.channel import ChannelServer
from efdl.state.fence import FenceWriter
from efdl.state.hang import POLL_S, Hang

log = logging.getLogger(__name__)

# How long after starting workers, and after the newest round, the warm pool is filled again:
# a warm process importing torch takes CPU from the workers' own start and rebuild.
REFILL_AFTER_S = 5.0
WARM_WAIT_S = 60.0  # the longest a node joining a running job waits for its warm processes
# How long a node whose workers failed (restart mode) waits for a round before asking for one:
# if a dead peer killed them, its eviction (found by probing, efdl.rendezvous.probe) brings a
# round within a fraction of a second, and one round restarts the workers once, not twice
# (the second time without warm processes).
RESTART_HOLD_S = 0.5


@dataclass(frozen=True, slots=True)
class _RoundSeen:
    round: Round


@dataclass(frozen=True, slots=True)
class _Signal:
    signum: int


@dataclass(frozen=True, slots=True)
class _LeaseLost:
    """etcd said this node's lease has expired; the rendezvous registers it again."""

    reason: str


@dataclass(frozen=True, slots=True)
class _EtcdSilent:
    """etcd has not answered for a lease TTL: no round can come until it does."""


@dataclass(frozen=True, slots=True)
class _Reached:
    """The agent reached etcd again (monotonic ``at``) after its workers' fence closed."""

    at: float


@dataclass(frozen=True, slots=True)
class _Failed:
    reason: str


@dataclass(frozen=True, slots=True)
class _Hung:
    """An in-place worker made no step for the hang timeout while a peer waited on it
    (efdl.launcher.hangs)."""

    pid: int
    hang: Hang


def _position(record: type[CacheRecord] | type[Progress]) -> Callable[[bytes, str], Position]:
    """Where a record of this kind stands: (generation, step)."""
    return lambda raw, key: record.from_json(raw, key).position


def _how(code: int) -> str:
    """How a worker process ended, from its exit status (negative: the signal)."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def leave_code(signum: int, ended: bool, others: int) -> int:
    """The exit code of a node that left its job on signal ``signum``: 0 when the job has
    ended (finished, stopped or failed: its own code is said by the nodes that saw it) or
    ``others`` nodes carry it on; else 128 + ``signum`` (unfinished work nobody carries on)."""
    return 0 if ended or others > 0 else 128 + signum


class AgentExit(EfdlError):
    """The agent ends with ``code``; the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class NodeAgent:
    """Runs ``args`` (the worker command) on this node for job ``job_id``.

    Args:
        cfg: the launch configuration.
        args: the worker command line (python, script, script args).
        store: the etcd store.
        node: this node's record (slots, GPUs, host).
        policy: the job's admission rules.
        job_id: the job.
        gpu_ids: the GPUs behind ``node``'s slots as workers' ``CUDA_VISIBLE_DEVICES`` names
            them (efdl.launcher.gpus.cuda_ids); empty on a CPU host.
    """

    def __init__(
        self,
        cfg: LaunchConfig,
        args: Sequence[str],
        store: KVStore,
        node: NodeRecord,
        policy: Policy,
        job_id: str,
        gpu_ids: Sequence[str] = (),
        warm: WarmPool | None = None,
    ) -> None:
        self._cfg = cfg
        self._args = list(args)
        self._store = store
        self._policy = policy
        self._job = job_id
        self._events: queue.Queue[object] = queue.Queue()
        url = cfg.cache_for(job_id)
        self._cache = (
            CacheSettings(url, cfg.cache_every_steps, cfg.cache_every_s, cfg.cache_keep)
            if url
            else None
        )
        if self._cache is not None:
            # A bad URL, a missing fsspec backend, no credentials or permission: fail now,
            # before anything is started.
            SnapshotStorage(self._cache.url).check()
        # Listens while this process lives: a refused connection tells the others it died.
        try:
            self._probe: ProbeListener | None = ProbeListener(node.host, self._describe)
            node = replace(node, probe_port=self._probe.port)
        except OSError as exc:
            log.warning("Cannot listen on %s for liveness probes (%s).", node.host, exc)
            self._probe = None
        self._node = node
        logs.context.set(job=job_id, node=node.node_id)
        self._history = EventLog(store, job_id, node.node_id)
        self._metrics = Metrics(job_id, node.node_id)  # served with --metrics-port only
        if cfg.metrics_port is not None:
            try:
                port = self._metrics.serve(node.host, cfg.metrics_port)
            except OSError as exc:
                self._history.close(0)
                raise AgentExit(
                    1, f"Cannot serve metrics on {node.host}:{cfg.metrics_port}: {exc}."
                ) from None
            log.info("Serving Prometheus metrics at http://%s:%d/metrics.", node.host, port)
            if isinstance(store, EtcdStore):
                store.on_request = self._metrics.etcd_request.observe
        self._server = TCPStoreServer(node.host, cfg.store_port)
        preload()
        self._ctx = JobContext(
            job_id,
            node,
            cfg.max_restarts,
            cfg.role,
            interface_of(node.host),
            tuple(gpu_ids),
            cfg.virtual_local_rank,
        )
        self._logs = cfg.log_spec(job_id)
        self._group: WorkerGroup | None = None
        if warm is None:
            warm = warm_pool(cfg.warm_workers, self._args, node.slots, bool(node.gpus), node.cpus)
        self._warm = warm
        self._refill_at: float | None = None
        self._restart_at: float | None = None  # ask for a round then (see RESTART_HOLD_S)
        # A worker failed: refill the pool as soon as the next workers start, for a second
        # round is likely near (a dead node's lease expiring after its peers' failures).
        self._refill_soon = False
        self._generation = 0  # the newest generation this node acted on
        self._restarts = RestartBudget(cfg.max_restarts)
        self._trained: int | None = None  # the last step local rank 0 reported committed
        # Restart mode's measure of a pause: when this node's workers last stepped (wall
        # clock), and, while workers restarted for a round have not stepped yet, the last
        # step before it (see _stepped).
        self._last_step = 0.0
        self._pause_from: float | None = None
        self._trained_at = 0.0  # when (wall clock)
        self._finishing = False
        self._departing = False  # leaving the job (SIGTERM): no round is held for this node
        self._finish_by: float | None = None
        self._in_place: set[int] = set()  # pids of workers that rebuild in place
        self._leaving: set[int] = set()  # pids told to leave at the next step boundary
        # Replacements of in-place workers that died: those not placed in a round yet, and
        # those not ready yet (no hello: the node offers that many workers fewer).
        self._standby: set[int] = set()
        self._replacing: set[int] = set()
        self._unsent: dict[int, Placement] = {}  # placements for workers not connected yet
        self._round: Round | None = None  # the newest active round that placed this node
        keys = JobKeys(job_id)
        # Both records are written only over older ones: a generation replaced while cut off
        # from etcd publishes nothing over its successor's (efdl.rendezvous.outputs).
        self._cache_record = LatestPublisher(
            guarded_put(store, keys.cache, _position(CacheRecord), "cache record"),
            "cache record",
        )
        # The job's newest committed step (generation, step): what this node knows of it
        # (etcd's progress record, read at each round, and its own workers' commits), and,
        # while this node runs rank 0, its publication (see Progress).
        self._job_progress: tuple[int, int] = (0, 0)
        self._cache_known: CacheRecord | None = None  # the newest cache record this node knows
        self._progress = LatestPublisher(
            guarded_put(store, keys.progress, _position(Progress), "progress record"),
            "progress record",
        )
        # Removed when run() ends. The job id, cut short: the socket's path must stay short.
        self._run_dir = private_dir(f"{job_id[:24]}-")
        try:
            self._channel = ChannelServer(
                self._run_dir / "agent.sock",
                self._on_worker_message,
            )
            # Until when this node's workers may commit: moved on each time the agent reaches
            # etcd (efdl.state.fence); plain workers are stopped (SIGSTOP) past it.
            self._fence = FenceWriter(self._run_dir / "fence", cfg.fence_s())
        except BaseException:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            raise
        self._frozen: set[int] = set()  # plain workers stopped by the fence
        self._rdzv: Participant | None = None
        # In-place workers' hangs, judged from outside them; the pids to judge, as a snapshot
        # the judge's thread can read (efdl.launcher.hangs).
        self._judged_pids: frozenset[int] = frozenset()
        self._judge = HangJudge(
            self._run_dir,
            lambda: self._judged_pids,
            self._store_of,
            lambda pid, hang: self._events.put(_Hung(pid, hang)),
        ).start()

    def _describe(self) -> dict[str, object]:
        """What this agent says of itself to a probe (``efdl status``, and a leader that saw
        this node's record go); from the probe's thread, so only reads of single attributes."""
        group = self._group
        return {
            "pid": os.getpid(),
            "node_id": self._node.node_id,
            "generation": self._generation,
            "workers": len(group.running()) if group is not None else 0,
            "in_place": self._rebuilds_in_place(),
            "step": self._trained,
            "step_time": self._trained_at,
            "holds": self._holds(),
        }

    def _holds(self) -> str:
        """The ``round_id`` of the round whose workers run here now; "" if none does (none
        placed, a newer round left this node out, or it leaves). Said when this node
        registers again after its lease was lost, and to a leader that asks why its record
        went: the node is then the member it was, and no round follows. From other threads,
        so only reads of single attributes."""
        r, group = self._round, self._group
        if self._departing or r is None or group is None or r.generation != self._generation:
            return ""
        return r.round_id if group.running() else ""

    def _on_worker_message(self, msg: ToAgent) -> None:
        """A worker's message (on a channel thread): most go to the loop as they are."""
        if isinstance(msg, Hello | Persisted | Stepped | PeerFailed | StateLost):
            self._events.put(msg)
        elif isinstance(msg, Agreed):
            self._trained, self._trained_at = msg.step, time.time()
            self._metrics.progress(msg.step)  # thread-safe: no need for the main thread
            # Every rank of the generation committed `agreed`.
            self._job_progress = max(self._job_progress, (msg.generation, msg.agreed))
            r = self._round
            if r is not None and r.member is not None and r.member.first_rank == 0:
                record = Progress(msg.agreed, msg.generation, time.time())
                self._progress.offer(record.to_json())
        elif isinstance(msg, ResumedFromCache):
            text = f"resumed from the cache's snapshot of step {msg.step}"
            self._events.put(
                self._history.event(EventKind.RESUME, self._generation, text, step=msg.step)
            )
        elif isinstance(msg, Rescaled):
            text = f"training went on at world size {msg.world_size}"
            event = self._history.event(
                EventKind.RESCALE, msg.generation, text, msg.world_size, msg.step, msg.stood_still
            )
            self._events.put(event)

    def _tag(self) -> str:
        return f"job {self._job} node {self._node.node_id} gen {self._generation}"

    # ---------------------------------------------------------------- lifecycle

    def run(self) -> int:
        """Join, follow rounds, run workers; returns the exit code. Call from the main thread."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in self._cfg.signals()}
        try:
            self._await_warm()
            self._join()
            while True:
                fence_at = self._fence_due()
                due = [
                    t
                    for t in (self._finish_by, self._refill_at, self._restart_at, fence_at)
                    if t is not None
                ]
                wait_s = min(due) - time.monotonic() if due else None
                try:
                    event = self._events.get(timeout=None if wait_s is None else max(0.0, wait_s))
                except queue.Empty:
                    if fence_at is not None and time.monotonic() >= fence_at:
                        self._apply_fence()
                        continue
                    if self._restart_at is not None and time.monotonic() >= self._restart_at:
                        self._restart_at = None
                        if self._rdzv is not None:
                            self._rdzv.request_restart()
                        continue
                    if self._refill_at is not None and time.monotonic() >= self._refill_at:
                        self._refill_at = None
                        self._refill()
                        continue
                    self._stop_workers()
                    raise AgentExit(
                        0,
                        "The job finished elsewhere and this node's workers did not finish "
                        f"within the grace period ({self._cfg.grace_period_s:g} s); stopped them.",
                    ) from None
                self._handle(event)
                group = self._group
                self._judged_pids = frozenset(
                    w.pid for w in (group.running() if group else ()) if w.pid in self._in_place
                )
        except AgentExit as done:
            (log.info if done.code == 0 else log.error)("%s: %s", self._tag(), done)
            return done.code
        finally:
            self._drain_news()
            if self._group is not None:
                self._group.kill()
            if self._rdzv is not None:
                self._rdzv.leave()
            self._warm.close()
            self._judge.close()
            self._history.close(timeout_s=2.0)
            self._metrics.close()
            self._server.close()
            if self._probe is not None:
                self._probe.close()
            self._channel.close()
            self._fence.close()
            self._cache_record.close(timeout_s=2.0)
            self._progress.close(timeout_s=2.0)
            shutil.rmtree(self._run_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _contact(self, at: float) -> None:
        """From the lease's thread: this agent reached etcd at monotonic ``at``. While the
        fence is open this moves it on; once it has closed, the agent's loop first checks
        that the round its workers run is still the job's (:meth:`_reopen_fence`)."""
        if self._fence.open():
            self._fence.reached(at)
        else:
            self._events.put(_Reached(at))

    def _reopen_fence(self, at: float) -> None:
        """The fence closed, and etcd answers again: let the workers commit again if the
        round they run is still the job's (one read of the round key). If a newer round
        replaced it (even one this node has already acted on: its old workers may not have
        left yet), they stay fenced: that round's news (a placement, or leave) reaches them
        from this loop, and nothing of the old generation commits meanwhile."""
        if self._fence.open():
            self._fence.reached(at)
            return
        group, r = self._group, self._round
        if group is not None and group.running():
            keys = JobKeys(self._job)
            try:
                current = parse_round(self._store.get(keys.round), keys)
            except StoreError as exc:  # the next contact tries again
                log.warning("%s: could not read the round to lift the fence: %s", self._tag(), exc)
                return
            if r is None or current is None or current.round_id != r.round_id:
                log.warning(
                    "%s: etcd answers again, but round %s is not the one this node's workers "
                    "run (%s): they stay fenced until its news reaches them.",
                    self._tag(),
                    current.generation if current is not None else "(none)",
                    r.generation if r is not None else "none",
                )
                return
        self._fence.reached(at)
        log.warning("%s: etcd answers again; the workers' fence is open.", self._tag())
        self._apply_fence()

    def _store_of(self, generation: int) -> tuple[str, int] | None:
        """The c10d store of ``generation`` if it is the round this node's workers run (from
        the hang judge's thread: reads of single attributes)."""
        r = self._round
        if r is None or r.generation != generation or not r.store_port:
            return None
        return r.store_host, r.store_port

    def _fence_due(self) -> float | None:
        """When to look at the fence next (plain workers only: efdl-aware ones stop at their
        own commits): when it closes, or, while it holds them stopped, twice a second."""
        group = self._group
        if group is None or not any(w.pid not in self._in_place for w in group.running()):
            return None
        if self._frozen:
            return time.monotonic() + 0.5
        return self._fence.deadline

    def _apply_fence(self) -> None:
        """Stop this node's plain workers (SIGSTOP, state in memory) while the agent has not
        reached etcd for the fence timeout, and let them go on (SIGCONT) once it has; a round
        that replaced them stops them for good meanwhile."""
        group = self._group
        if group is None:
            return
        plain = [w for w in group.running() if w.pid not in self._in_place]
        if not self._fence.open() and not self._frozen and plain:
            for w in plain:
                w.signal_group(signal.SIGSTOP)
                self._frozen.add(w.pid)
            log.warning(
                "%s: this agent has not reached etcd for %.0f s (--fence-timeout): its "
                "workers %s are stopped (SIGSTOP, state in memory) until it does, since a "
                "leader may replace a generation cut off from etcd.",
                self._tag(),
                self._cfg.fence_s(),
                [w.pid for w in plain],
            )
        elif self._frozen and self._fence.open():
            for w in group.running():
                if w.pid in self._frozen:
                    w.signal_group(signal.SIGCONT)
            log.warning("%s: etcd answers again; workers %s go on.", self._tag(), self._frozen)
            self._frozen.clear()

    def _await_warm(self) -> None:
        """Joining a job that trains by restarts: let this node's warm processes finish
        importing torch first, so that the round that admits it does not stop all the
        others while they do. A job that trains in place (its rank 0 node says so) is
        joined at once: its workers train on until this node's have entered their training
        functions (efdl.state.ready). A new job's nodes join at once too: their imports
        overlap the rendezvous."""
        if not self._warm.size:
            return
        keys = JobKeys(self._job)
        try:
            current = parse_round(self._store.get(keys.round), keys)
            # Its rank 0 alive (a job whose nodes all left, preempted, still has its last
            # active round; the nodes resuming it start together).
            raw = self._store.get(keys.node(current.head)) if current is not None else None
        except StoreError:
            return  # joining says what is wrong with etcd
        if current is None or current.status is not RoundStatus.ACTIVE or raw is None:
            return
        if _trains_in_place(raw.value, keys.node(current.head)):
            log.info(
                "%s: the job trains in place (generation %d): joining at once; its workers "
                "train on while this node's start.",
                self._tag(),
                current.generation,
            )
            return
        log.info(
            "%s: the job trains (generation %d); joining once this node's %d warm worker "
            "process(es) have imported torch (at most %.0f s).",
            self._tag(),
            current.generation,
            self._node.slots,
            WARM_WAIT_S,
        )
        if not self._warm.wait_loaded(self._node.slots, WARM_WAIT_S):
            log.warning(
                "%s: the warm worker processes are not ready after %.0f s; joining anyway.",
                self._tag(),
                WARM_WAIT_S,
            )

    def _refill(self) -> None:
        started = self._warm.fill()
        if started:
            log.info(
                "%s: started %d warm worker process(es) (pids %s).",
                self._tag(),
                len(started),
                started,
            )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(_Signal(signum))

    def _join(self) -> None:
        post: Callable[[object], None] = self._events.put
        self._rdzv = Participant(
            self._store,
            self._job,
            self._node,
            self._policy,
            lease_ttl_s=self._cfg.lease_ttl_s,
            on_round=lambda r: post(_RoundSeen(r)),
            on_lease_expired=lambda reason: post(_LeaseLost(reason)),
            on_etcd_silent=lambda: post(_EtcdSilent()),
            holds=self._holds,
            serve_tcpstore=self._server.serve,
            on_failure=lambda reason: post(_Failed(reason)),
            events=self._history,
            on_forgot=self._publish_again,
            on_contact=self._contact,
        )
        self._register(self._rdzv)
        rdzv = self._rdzv
        self._metrics.lease_healthy.set_function(lambda: float(rdzv.lease_healthy))
        self._record(
            EventKind.JOIN,
            self._generation,
            f"joined with {self._node.slots} worker slot(s) on {self._node.host}",
        )
        self._log_cache()
        log.info(
            "%s: joined with %d worker slot(s) on %s (GPUs: %s).",
            self._tag(),
            self._node.slots,
            self._node.host,
            ", ".join(f"{g.index}:{g.model}" for g in self._node.gpus) or "none",
        )

    def _register(self, rdzv: Participant) -> None:
        """Register this node; while etcd does not answer, try again (saying so every ten
        seconds) for up to the join timeout, and leave at once on SIGTERM or SIGINT."""
        deadline = time.monotonic() + self._cfg.join_timeout_s
        said_at = 0.0
        while True:
            try:
                rdzv.join()
                return
            except StoreError as exc:
                now = time.monotonic()
                if now >= deadline:
                    raise AgentExit(
                        1,
                        f"Could not join job {self._job} within the join timeout "
                        f"({self._cfg.join_timeout_s:g} s): {exc}",
                    ) from None
                if now - said_at >= 10.0:
                    said_at = now
                    log.warning(
                        "%s: cannot join yet (%s); trying again for up to %.0f s more.",
                        self._tag(),
                        exc,
                        deadline - now,
                    )
            try:
                event = self._events.get(timeout=1.0)
            except queue.Empty:
                continue
            if isinstance(event, _Signal):
                name = signal.Signals(event.signum).name
                raise self._left(event.signum, f"Left on {name} before joining the job")

    # ---------------------------------------------------------------- events

    def _handle(self, event: object) -> None:
        if isinstance(event, _RoundSeen):
            self._on_round(event.round)
        elif isinstance(event, WorkerExit):
            self._on_exit(event)
        elif isinstance(event, _Signal):
            self._leave(event.signum)
        elif isinstance(event, _LeaseLost):
            self._record(
                EventKind.LEASE_LOST,
                self._generation,
                f"lease lost ({event.reason}); registering again"
                + (", its workers training on" if self._holds() else ""),
            )
        elif isinstance(event, _Failed):
            raise AgentExit(1, event.reason)
        elif isinstance(event, Hello):
            self._on_hello(event.pid)
        elif isinstance(event, StateLost):
            self._state_lost(event.message)
        elif isinstance(event, _Hung):
            self._hung(event)
        elif isinstance(event, _EtcdSilent) and self._group is not None:
            # A worker whose collective failed (a peer died meanwhile) waits for the round
            # that etcd's return brings, with its state in memory, up to the join timeout.
            for w in self._group.running():
                if w.pid in self._in_place:
                    self._channel.send(w.pid, Waiting(self._cfg.join_timeout_s))
        elif isinstance(event, Persisted):
            self._publish_cache(event)
        elif isinstance(event, _Reached):
            self._reopen_fence(event.at)
        elif isinstance(event, Event):
            self._note(event)
        elif isinstance(event, Stepped):
            self._stepped(event)
        elif isinstance(event, PeerFailed) and self._rdzv is not None:
            self._rdzv.report_failure(event.generation)

    def _stepped(self, ev: Stepped) -> None:
        """A worker of this node stepped. The first step of workers restarted for a round
        ends the time training stood still (restart mode: plain scripts say nothing else of
        their steps), from the last step before the event; the node of rank 0 records it,
        as in-place rank 0 records a rescale's."""
        group, r = self._group, self._round
        if group is None or all(w.pid != ev.pid for w in group.running()):
            return  # a worker of a generation that is gone
        self._last_step = max(self._last_step, ev.time)
        pause, self._pause_from = self._pause_from, None  # set only after steps: see _on_round
        if pause is None or ev.pid in self._in_place or r is None or r.member is None:
            return
        if r.member.first_rank != 0:
            return  # the node of rank 0 says it, once
        still = max(0.0, ev.time - pause)
        text = f"training went on at world size {r.world_size} (workers restarted)"
        self._record(EventKind.RESCALE, r.generation, text, world_size=r.world_size, seconds=still)

    def _record_crash(self, rank: int, pid: int, code: int) -> None:
        text = f"worker rank {rank} (pid {pid}) failed with {_how(code)}"
        self._record(EventKind.CRASH, self._generation, text)

    def _record(self, kind: EventKind, generation: int, text: str, **fields: Any) -> None:
        self._note(self._history.event(kind, generation, text, **fields))

    def _note(self, event: Event) -> None:
        """Into the job's history, and into the metrics it moves."""
        self._history.write(event)
        self._metrics.count(event)

    def _hung(self, ev: _Hung) -> None:
        """Kill a hung worker (its peers wait on it): its exit then replaces it in place,
        as any lost worker (the job shrinks, then grows back)."""
        group = self._group
        worker = next((w for w in group.running() if w.pid == ev.pid), None) if group else None
        if worker is None:
            return
        h = ev.hang
        frozen = (
            f"; it has been frozen for {h.frozen_s:.0f} s (its own threads do not run: a C call "
            "that holds the GIL, or a stopped process)"
            if h.frozen_s >= 3 * POLL_S
            else ""
        )
        since = (
            f"since its state was synced at step {h.step}" if h.first else f"after step {h.step}"
        )
        text = (
            f"worker rank {worker.rank} (pid {ev.pid}) made no step for {h.stalled_s:.0f} s "
            f"{since} while a peer waited on it in a collective of group {h.group} (hang "
            f"timeout {h.timeout_s:.0f} s){frozen}"
        )
        log.error("%s: %s: killing it.", self._tag(), text)
        self._record(EventKind.HANG, self._generation, text, step=h.step)
        worker.signal_group(signal.SIGKILL)

    def _state_lost(self, message: str) -> None:
        """The job cannot go on from where it was: end it (every agent exits non-zero with
        the reason), rather than let restarts start it over from step 0."""
        self._stop_workers(grace_s=min(self._cfg.grace_period_s, 5.0))
        try:
            end_job(
                self._store,
                self._job,
                RoundStatus.FAILED,
                message.rstrip("."),
                by=self._node.node_id,
            )
        except StoreError as exc:
            log.error("%s: could not end the job in etcd: %s", self._tag(), exc)
        raise AgentExit(1, message)

    def _read_progress(self) -> None:
        """Learn the job's newest committed step from etcd (a node that joins a job that
        trained, or that runs a generation made of newcomers only); kept if etcd fails."""
        keys = JobKeys(self._job)
        try:
            kv = self._store.get(keys.progress)
        except StoreError as exc:
            log.warning("%s: could not read the job's progress record: %s", self._tag(), exc)
            return
        if kv is None:
            return
        try:
            position = Progress.from_json(kv.value, keys.progress).position
        except RecordError as exc:
            log.error("%s: ignoring a bad progress record: %s", self._tag(), exc)
            return
        self._job_progress = max(self._job_progress, position)

    def _on_hello(self, pid: int) -> None:
        """A worker connected: it rebuilds in place. A replacement is ready now: offer its
        slot again, and give it the place a round may already have for it."""
        self._in_place.add(pid)
        placement = self._unsent.pop(pid, None)
        if placement is not None:
            self._channel.send(pid, Placed(placement))
        if pid in self._replacing:
            self._replacing.discard(pid)
            if self._rdzv is not None:
                self._rdzv.set_down(len(self._replacing))
            log.info("%s: the replacement worker (pid %d) is ready.", self._tag(), pid)

    def _log_cache(self) -> None:
        """Say whether this job starts cold or resumes from its cache."""
        if self._cache is None:
            return
        keys = JobKeys(self._job)
        try:
            kv = self._store.get(keys.cache)
        except StoreError as exc:
            log.warning("%s: could not read the cache record: %s", self._tag(), exc)
            return
        record = None
        if kv is not None:
            try:
                record = CacheRecord.from_json(kv.value, keys.cache)
            except RecordError as exc:
                log.error("%s: ignoring a bad cache record: %s", self._tag(), exc)
        self._cache_known = record
        if record is None:
            log.info(
                "%s: no snapshot published for this job yet (cache %s).",
                self._tag(),
                self._cache.url,
            )
        else:
            log.info(
                "%s: the job's newest snapshot is step %d (epoch %s, world size %d) in %s; "
                "a job with no live member resumes from it.",
                self._tag(),
                record.step,
                record.epoch,
                record.world_size,
                record.url,
            )

    def _publish_again(self) -> None:
        """etcd forgot what it held (from the rendezvous thread): publish the job's progress
        and cache records again from what this node knows of them (each written only over an
        older one, so the node that knows most wins), lest a job restarted later start over
        from step 0, or ignore its cache, without a word."""
        generation, step = self._job_progress
        if step > 0:
            self._progress.offer(Progress(step, generation, time.time()).to_json())
        cache = self._cache_known
        if cache is not None:
            self._cache_record.offer(cache.to_json())
        log.warning(
            "%s: etcd forgot what it held; published this node's view of the job again "
            "(progress: generation %d, step %d; cache: %s).",
            self._tag(),
            generation,
            step,
            f"step {cache.step}" if cache is not None else "none known",
        )

    def _publish_cache(self, ev: Persisted) -> None:
        assert self._cache is not None
        record = CacheRecord(
            ev.step, ev.epoch, ev.world_size, self._cache.url, time.time(), ev.generation
        )
        self._cache_known = record
        self._cache_record.offer(record.to_json())
        self._record(
            EventKind.PERSIST,
            self._generation,
            f"persisted {ev.bytes / 1e6:.1f} MB to {self._cache.url}",
            world_size=ev.world_size,
            step=ev.step,
            seconds=ev.seconds,
        )
        self._metrics.persisted(ev.step, ev.bytes, ev.seconds)

    def _on_round(self, r: Round) -> None:
        if r.generation <= self._generation:
            return
        self._generation = r.generation
        logs.context.set(generation=r.generation)
        self._restart_at = None  # this round restarts the workers (or stops them)
        self._observe(r)
        if self._refill_at is not None and not self._refill_soon:  # imports would slow it
            self._refill_at = max(self._refill_at, time.monotonic() + REFILL_AFTER_S)
        if r.status is RoundStatus.CLOSED:
            self._stop_workers()
            raise AgentExit(0, f"The job was stopped ({r.reason}).")
        if r.status is RoundStatus.FAILED:
            self._stop_workers()
            raise AgentExit(1, f"The job failed: {r.reason}.")
        if r.status is RoundStatus.FINISHED:
            self._finishing = True
            if self._group is None or not self._group.running():
                raise AgentExit(0, f"The job finished ({r.reason}).")
            log.info(
                "%s: the job finished elsewhere; waiting for this node's workers.", self._tag()
            )
            self._finish_by = time.monotonic() + self._cfg.grace_period_s
            return
        if r.status is RoundStatus.WAITING:
            if not self._rebuilds_in_place():
                self._stop_workers()
            elif self._group is not None:  # their wait for a placement may last this long
                for w in self._group.running():
                    self._channel.send(w.pid, Waiting(self._cfg.join_timeout_s))
            log.info("%s: the job waits: %s.", self._tag(), r.reason)
            return  # in-place workers wait for the next round with their state in memory
        member = r.member
        # Its workers are told how far the job got (a generation of newcomers only must not
        # start over from step 0, nor stale holders roll it back): one small read per round,
        # by spares too, so that a spare placed after etcd forgot the record still knows.
        self._read_progress()
        if member is not None:
            self._round = r
        if self._rebuilds_in_place():
            self._rebuild_in_place(r)
            return
        self._stop_workers()
        if self._last_step > 0:  # training stands still from its last step to the next
            self._pause_from = self._last_step
        if member is None:
            if r.world_size + self._node.slots > self._policy.max_workers:
                log.info(
                    "%s: this node is a spare (the job has %d workers; --max %d).",
                    self._tag(),
                    r.world_size,
                    self._policy.max_workers,
                )
            else:  # a round decided before this node joined: the next one adds it
                log.info(
                    "%s: round %d (world size %d) was decided without this node; waiting for "
                    "the round that adds it.",
                    self._tag(),
                    r.generation,
                    r.world_size,
                )
            return
        self._start_workers(r, range(member.workers))

    def _observe(self, r: Round) -> None:
        """The round in the metrics (its event is in the history already: whoever writes a
        round writes its event, a final one in the same transaction: efdl.rendezvous
        .lifecycle.end_job)."""
        self._metrics.round(r)

    def _rebuilds_in_place(self) -> bool:
        """Whether this node's workers are efdl-aware and all alive to be told of a round."""
        group = self._group
        if group is None:
            return False
        running = group.running()
        return bool(running) and all(w.pid in self._in_place for w in running)

    def _rebuild_in_place(self, r: Round) -> None:
        """Tell the running workers their new place (survivors in their local rank order,
        then replacements standing by); start local ranks still missing; send the ones not
        needed any more away at the next step boundary. A replacement not placed yet waits."""
        group = self._group
        assert group is not None
        member = r.member
        wanted = member.workers if member else 0
        running = [w for w in group.running() if w.pid not in self._leaving]
        running.sort(key=lambda w: (w.pid in self._standby, w.local_rank))
        placed: list[int] = []
        for w in running:
            if member is not None and len(placed) < wanted:
                w.local_rank = len(placed)
                w.rank = member.first_rank + w.local_rank
                self._standby.discard(w.pid)
                placement = Placement(
                    r.generation,
                    member.first_rank + w.local_rank,
                    r.world_size,
                    w.local_rank,
                    wanted,
                    member.group_rank,
                    r.nodes,
                    r.store_host,
                    r.store_port,
                    self._job_progress[1],
                    self._job_progress[0],
                )
                if not self._channel.send(w.pid, Placed(placement)):
                    self._unsent[w.pid] = placement  # a replacement still starting
                placed.append(w.pid)
            elif w.pid not in self._standby:
                self._leaving.add(w.pid)
                self._channel.send(w.pid, Leave())
        group.generation = r.generation
        missing = list(range(len(placed), wanted))
        if missing:
            self._start_workers(r, missing)
        log.info(
            "%s: round %d in place: %s (placed pids %s, started local ranks %s, world size %d).",
            self._tag(),
            r.generation,
            r.reason,
            placed,
            missing,
            r.world_size,
        )

    def _start_workers(
        self, r: Round, local_ranks: range | list[int], standby: bool = False
    ) -> list[int]:
        """Start workers for ``local_ranks`` of round ``r``; ``standby``: replacements that
        wait, connected, for a later round to place them. Returns their pids."""
        member = r.member
        assert member is not None
        held = self._group.gpu_slots() if self._group is not None else set()
        slots: dict[int, int | None] = dict.fromkeys(local_ranks)
        for local in local_ranks if self._ctx.gpu_ids else ():
            # A survivor keeps its GPU; a newcomer takes one that no running worker holds.
            slot = free_slot(local, held, len(self._ctx.gpu_ids))
            slots[local] = slot
            held.add(slot)
        envs = {
            local: worker_env(
                self._base_env(),
                self._ctx,
                r,
                local,
                # This node's restarts after its own workers' failures, as torchrun's agents
                # count them (a round for another node's failure or a join counts nowhere).
                self._restarts.used,
                self._run_dir
                / f"gen{r.generation}"
                / f"error-rank{member.first_rank + local}.json",
                slots[local],
            )
            for local in local_ranks
        }
        for env in envs.values():
            env[SOCKET_ENV] = str(self._channel.path)
            env[FENCE_ENV] = str(self._fence.path)
            env[BEAT_DIR_ENV] = str(self._run_dir)
            env[GRACE_ENV] = f"{self._cfg.grace_period_s:g}"
            env[PLACEMENT_TIMEOUT_ENV] = f"{self._cfg.placement_timeout_s():g}"
            env[JOIN_TIMEOUT_ENV] = f"{self._cfg.join_timeout_s:g}"
            env[JOB_GENERATION_ENV] = str(self._job_progress[0])
            env[JOB_STEP_ENV] = str(self._job_progress[1])
            if self._cfg.hang_timeout_s is not None:
                env[HANG_TIMEOUT_ENV] = f"{self._cfg.hang_timeout_s:g}"
            if self._cache is not None:
                env.update(self._cache.to_env())
            if standby:
                env[STANDBY_ENV] = "1"
        if self._group is None:
            self._group = WorkerGroup(r.generation, [])
        pids = self._group.spawn(
            self._args, envs, r.generation, self._logs, self._events, slots, self._warm
        )
        # Warm processes to replace the ones taken, once these workers are past their own
        # start (their imports and the warm ones' would share the node's cores).
        self._refill_at = time.monotonic() + (0.0 if self._refill_soon else REFILL_AFTER_S)
        self._refill_soon = False
        if not standby:
            log.info(
                "%s: round %d: ranks %d-%d of %d (%s).",
                self._tag(),
                r.generation,
                member.first_rank,
                member.first_rank + member.workers - 1,
                r.world_size,
                r.reason,
            )
        return pids

    @staticmethod
    def _base_env() -> dict[str, str]:
        return dict(os.environ)

    def _stop_workers(self, grace_s: float | None = None) -> None:
        if self._group is not None:
            # A worker the fence stopped is killed, not woken: woken to take a signal, it
            # would run on a moment in a generation that may have been replaced.
            for w in self._group.running():
                if w.pid in self._frozen:
                    w.signal_group(signal.SIGKILL)
            self._frozen.clear()
            # A worker that failed before this stop, its exit not handled yet (a round came
            # first: its peers' failure made it), is a crash all the same: the history says so.
            for w in self._group.workers:
                code = w.proc.poll()
                if code and w.local_rank not in self._group.exited and w.pid not in self._leaving:
                    self._group.exited[w.local_rank] = code
                    self._record_crash(w.rank, w.pid, code)
            self._group.stop(self._cfg.grace_period_s if grace_s is None else grace_s)
            self._forget_group()

    def _forget_group(self) -> None:
        """The group is gone (stopped or killed): so are its replacements."""
        self._group = None
        self._standby.clear()
        self._unsent.clear()
        if self._replacing:
            self._replacing.clear()
            if self._rdzv is not None:
                self._rdzv.set_down(0)

    def _on_exit(self, ev: WorkerExit) -> None:
        self._judge.forget(ev.pid)
        group = self._group
        if group is None or ev.pid not in group.pids:
            return  # a worker of a group we stopped on purpose
        if ev.pid in self._leaving or (ev.pid in self._standby and ev.code == 0):
            # It left at a step boundary, as asked, or a replacement was sent away before a
            # round placed it.
            self._leaving.discard(ev.pid)
            self._standby.discard(ev.pid)
            group.remove(ev.pid)
            if not group.workers:
                self._forget_group()
            return
        group.exited[ev.local_rank] = ev.code
        if ev.code != 0:
            self._worker_failed(group, ev)
        elif all(w.proc.poll() is not None for w in group.workers) and all(
            c == 0 for c in group.exited.values()
        ):
            self._group = None
            if self._finishing:
                raise AgentExit(0, "This node's workers finished; the job is done.")
            try:
                end_job(
                    self._store,
                    self._job,
                    RoundStatus.FINISHED,
                    f"the workers of node {self._node.node_id} finished",
                    by=self._node.node_id,
                )
            except StoreError as exc:
                raise AgentExit(
                    0,
                    "This node's workers finished; the job's end could not be written to "
                    f"etcd ({exc}): the other nodes end when their own workers finish.",
                ) from None
            raise AgentExit(0, "This node's workers finished; the job is done.")

    def _worker_failed(self, group: WorkerGroup, ev: WorkerExit) -> None:
        worker = next(w for w in group.workers if w.pid == ev.pid)
        how = _how(ev.code)
        error = worker.error_summary()
        first_line, *stack = error.splitlines() or [""]
        failed = f"Worker rank {ev.rank} failed with {how}{': ' + first_line if first_line else ''}"
        log.error(
            "%s: worker rank %d (local rank %d, pid %d) failed with %s%s.%s",
            self._tag(),
            ev.rank,
            ev.local_rank,
            ev.pid,
            how,
            f": {first_line}" if first_line else "",
            "\n" + "\n".join(stack) if stack else "",
        )
        self._record_crash(ev.rank, ev.pid, ev.code)
        in_place = ev.pid in self._in_place and self._round is not None
        if in_place:  # the others roll back and go on; only this one is replaced
            group.remove(ev.pid)
            self._standby.discard(ev.pid)
            self._replacing.discard(ev.pid)
            self._unsent.pop(ev.pid, None)
        else:
            self._stop_workers(grace_s=min(self._cfg.grace_period_s, 5.0))
        if self._finishing:
            raise AgentExit(1, f"Worker rank {ev.rank} failed with {how} after the job finished.")
        verdict = self._restarts.decide(ev.code, error, self._trained)
        if verdict is Verdict.REPEATED:
            raise AgentExit(
                1,
                f"{failed}, the same error as the last failure, with no step trained since: a "
                "restart would fail the same way, so this node leaves the job (fix the error "
                "and start it again).",
            )
        if verdict is Verdict.EXHAUSTED:
            raise AgentExit(
                1,
                f"{failed}; this node has used all {self._cfg.max_restarts} restarts "
                "(--max-restarts), so it leaves the job.",
            )
        self._refill_soon = True
        self._record(
            EventKind.RESTART,
            self._generation,
            f"{'replacing the worker in place' if in_place else 'restarting the workers'} "
            f"(restart {self._restarts.used} of {self._cfg.max_restarts})",
        )
        log.warning(
            "%s: %s (restart %d of %d).",
            self._tag(),
            "replacing the failed worker; the others go on without it"
            if in_place
            else "restarting the workers",
            self._restarts.used,
            self._cfg.max_restarts,
        )
        assert self._rdzv is not None
        if not in_place:
            # A peer's death may be what killed it (restart mode): have the nodes probed, and
            # ask for a round of the same members only if none comes meanwhile.
            self._rdzv.report_failure(self._generation)
            self._restart_at = time.monotonic() + RESTART_HOLD_S
            return
        # Shrink, then grow: the node offers one worker fewer until the replacement, started
        # now, says it is ready; it waits for a round that places it.
        assert self._round is not None
        pids = self._start_workers(self._round, [ev.local_rank], standby=True)
        self._in_place.update(pids)
        self._standby.update(pids)
        self._replacing.update(pids)
        self._rdzv.set_down(len(self._replacing))

    def _leave(self, signum: int) -> None:
        self._departing = True
        name = signal.Signals(signum).name
        self._record(EventKind.LEAVE, self._generation, f"leaving on {name}")
        log.info(
            "%s: %s: leaving gracefully (grace period %.0f s).",
            self._tag(),
            name,
            self._cfg.grace_period_s,
        )
        if self._rebuilds_in_place():
            assert self._group is not None
            for w in self._group.running():  # pause with everyone, commit, exit
                self._leaving.add(w.pid)
                self._channel.send(w.pid, Leave())
            # Leave the rendezvous at once: the others' new round makes them pause at the
            # same step boundary as ours (the pause agreement takes the max of all flags),
            # so nobody waits for our workers' interpreters to exit.
            self._leave_rendezvous()
            self._group.wait(self._cfg.grace_period_s)
        self._stop_workers()
        self._leave_rendezvous()
        raise self._left(signum, f"Left the job on {name}")

    def _left(self, signum: int, what: str) -> AgentExit:
        """How this node's leave on ``signum`` ends: 0 when the job goes on without it (or has
        ended), else 128 + the signal's number, as a shell reports a process that a signal
        stopped: a scheduler (SLURM, a Kubernetes Job) takes it for unfinished work to run
        again, not for a finished job. Read after this node's record went (its lease was
        revoked), so of nodes leaving together at least the last one says so."""
        keys = JobKeys(self._job)
        try:
            r = parse_round(self._store.get(keys.round), keys)
            others = [
                kv
                for kv in self._store.get_prefix(keys.nodes).kvs
                if kv.key != keys.node(self._node.node_id)
            ]
        except StoreError as exc:
            code = leave_code(signum, False, 0)
            return AgentExit(
                code, f"{what}; etcd did not say whether the job goes on ({exc}): exit {code}."
            )
        ended = self._finishing or (r is not None and r.status.final)
        code = leave_code(signum, ended, len(others))
        if code == 0:
            return AgentExit(
                0, f"{what}; the job goes on without it." if others and not ended else f"{what}."
            )
        return AgentExit(
            code,
            f"{what}; no other node carries the job on and it has not finished: exit {code}, "
            "for a scheduler to run it again.",
        )

    def _drain_news(self) -> None:
        """The agent exits: publish what its workers said on their way out (the step they
        persisted at the pause, the last rescale), which the loop has not handled."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, Persisted | Event):
                self._handle(event)

    def _leave_rendezvous(self) -> None:
        if self._rdzv is not None:
            self._rdzv.leave()
            self._rdzv = None


def _trains_in_place(raw: bytes, key: str) -> bool:
    """Whether the node of record ``raw`` (at ``key``) says that its workers rebuild in
    place, asked at its probe port (efdl.rendezvous.probe); False when it cannot say."""
    try:
        record = NodeRecord.from_json(raw, key)
    except EfdlError:
        return False
    if not record.probe_port:
        return False
    reply, said = ask(record.host, record.probe_port)
    return reply is Reply.ANSWERED and said is not None and said.get("in_place") is True
