"""The node agent: follows the job's rounds and runs this node's workers.

Everything that happens reaches the agent as an event on one queue (efdl.launcher.inbox),
handled on the main thread: a new served round, a worker exit, a signal, a lost lease, a
failed rendezvous, a worker's message. What the agent does on a round, a worker's exit and
a signal is decided by pure reactions (efdl.launcher.react) over a snapshot of its state;
this loop runs the actions they return. Its parts: the workers' book
(efdl.launcher.node_workers), the fence (efdl.launcher.fencing), the job's progress and cache
records (efdl.launcher.job_progress), what the workers tell of their training
(efdl.launcher.news), this node's hold and health checks (efdl.launcher.holding: SIGUSR2
drains the node; ``Holding.hold_out`` is the one call for whatever finds it bad or slow),
what it serves others (efdl.launcher.services).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, assert_never

from efdl import logs
from efdl._process import private_dir
from efdl.config import LaunchConfig
from efdl.launcher import ending, joining, react
from efdl.launcher.ending import AgentExit, leave_code
from efdl.launcher.env import JobContext
from efdl.launcher.fencing import WorkerFence
from efdl.launcher.hangs import HangJudge
from efdl.launcher.health import Finding, Severity
from efdl.launcher.holding import Holding
from efdl.launcher.inbox import (
    AgentEvent,
    EtcdSilent,
    HealthFound,
    HoldChanged,
    Hung,
    LeaseLost,
    Reached,
    RendezvousFailed,
    RoundSeen,
    SignalReceived,
    WorkerReports,
)
from efdl.launcher.job_progress import JobProgress
from efdl.launcher.metrics import Metrics
from efdl.launcher.news import WorkerNews
from efdl.launcher.node import interface_of
from efdl.launcher.node_workers import NodeWorkers
from efdl.launcher.react import AgentPhase, AgentView, Limits, Reaction
from efdl.launcher.restarts import RestartBudget
from efdl.launcher.services import NodeServices
from efdl.launcher.stragglers import PaceJudge
from efdl.launcher.warm import RefillTimer, WarmPool, warm_pool
from efdl.launcher.workers import WorkerExit
from efdl.protocol.messages import Hello, Paced, PeerFailed, Persisted, StateLost, Stepped
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.event_log import EventLog
from efdl.rendezvous.holds import HoldKind
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.records import Event, EventKind, NodeRecord, Round
from efdl.worker.cache import CacheSettings, SnapshotStorage
from efdl.worker.channel import ChannelServer

__all__ = ["AgentExit", "NodeAgent", "leave_code"]

log = logging.getLogger(__name__)

# The longest the agent's loop waits for a deadline before it looks again (a queue's
# timeout past threading.TIMEOUT_MAX, about 292 years, raises OverflowError).
LONGEST_TIMER_S = 3600.0

# How long a node whose workers failed (restart mode) waits for a round before asking for one:
# if a dead peer killed them, its eviction (found by probing, efdl.rendezvous.probe) brings a
# round within a fraction of a second, and one round restarts the workers once, not twice
# (the second time without warm processes).
RESTART_HOLD_S = 0.5
# The signal that drains this node (holds it out until released: efdl.launcher.holding), e.g.
# ``systemctl kill -s SIGUSR2 efdl@job``. SIGUSR1 is left to --signals-to-handle (SLURM's
# warning before a job's time runs out: a leave).
DRAIN_SIGNAL = signal.SIGUSR2


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
        self._metrics = Metrics(job_id, node.node_id)  # served with --metrics-port only
        self._services = NodeServices(cfg, node, store, self._metrics, self._describe)
        node = self._node = self._services.node
        logs.context.set(job=job_id, node=node.node_id)
        self._history = EventLog(store, job_id, node.node_id)
        ctx = JobContext(
            job_id,
            node,
            cfg.max_restarts,
            cfg.role,
            interface_of(node.host),
            tuple(gpu_ids),
            cfg.virtual_local_rank,
        )
        if warm is None:
            warm = warm_pool(cfg.warm_workers, list(args), node.slots, bool(node.gpus), node.cpus)
        self._warm = warm
        self._phase = AgentPhase.JOINING
        self._limits = Limits(
            node.slots, policy.max_workers, cfg.grace_period_s, cfg.join_timeout_s
        )
        self._refills = RefillTimer(warm, self._tag)
        self._restart_at: float | None = None  # ask for a round then (see RESTART_HOLD_S)
        self._generation = 0  # the newest generation this node acted on
        self._restarts = RestartBudget(
            cfg.max_restarts,
            quarantine_after=cfg.quarantine_after,
            window_s=cfg.quarantine_window_s,
        )
        self._finish_by: float | None = None
        self._progress = JobProgress(store, job_id, self._tag)
        self._reports = WorkerReports(
            self._events.put,
            self._history,
            self._metrics,
            self._progress,
            lambda: self._generation,
            lambda: self._workers.runs_rank0(),
        )
        # Removed when run() ends. The job id, cut short: the socket's path must stay short.
        self._run_dir = private_dir(f"{job_id[:24]}-")
        try:
            self._channel = ChannelServer(self._run_dir / "agent.sock", self._reports)
            self._workers = NodeWorkers(
                cfg,
                args,
                ctx,
                self._run_dir,
                self._channel,
                self._run_dir / "fence",
                self._cache,
                self._events,
                warm,
                lambda text: self._record(EventKind.CRASH, self._generation, text),
                self._set_down,
                self._tag,
            )
            # Until when this node's workers may commit: moved on each time the agent reaches
            # etcd (efdl.worker.fence); plain workers are stopped (SIGSTOP) past it.
            self._fence = WorkerFence(
                self._run_dir / "fence",
                cfg.fence_s(),
                self._workers,
                store,
                job_id,
                self._events.put,
                self._tag,
            )
        except BaseException:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            raise
        self._news = WorkerNews(
            self._workers,
            PaceJudge(cfg.straggler_ratio, cfg.evict_stragglers),
            policy.min_workers,
            self._metrics,
            self._progress,
            self._record,
            self._tag,
        )
        self._rdzv: Participant | None = None
        # This node's hold (drained, quarantined), watched from before it joins, and the
        # health checks that may write one.
        self._holding = Holding(
            cfg,
            store,
            job_id,
            node,
            self._events.put,
            lambda kind, text: self._record(kind, self._generation, text),
            self._tag,
        )
        # In-place workers' hangs, judged from outside them; the pids to judge, as a snapshot
        # the judge's thread can read (efdl.launcher.hangs).
        self._judged_pids: frozenset[int] = frozenset()
        self._judge = HangJudge(
            self._run_dir,
            lambda: self._judged_pids,
            lambda generation: self._workers.store_of(generation),
            lambda pid, hang: self._events.put(Hung(pid, hang)),
        ).start()

    def _describe(self) -> dict[str, object]:
        """What this agent says of itself to a probe (``efdl status``, and a leader that saw
        this node's record go); from the probe's thread, so only reads of single attributes."""
        group = self._workers.group
        return {
            "pid": os.getpid(),
            "node_id": self._node.node_id,
            "generation": self._generation,
            "workers": len(group.running()) if group is not None else 0,
            "in_place": self._workers.mode() is react.WorkerMode.IN_PLACE,
            "step": self._reports.trained,
            "step_time": self._reports.trained_at,
            "holds": self._holds(),
            "held": self._holding.text(),
        }

    def _holds(self) -> str:
        """The ``round_id`` of the round whose workers run here now; "" if none does (none
        placed, a newer round left this node out, or it leaves). Said when this node
        registers again after its lease was lost, and to a leader that asks why its record
        went: the node is then the member it was, and no round follows. From other threads,
        so only reads of single attributes."""
        if self._phase is AgentPhase.LEAVING:
            return ""
        return self._workers.holds(self._generation)

    def _tag(self) -> str:
        return f"job {self._job} node {self._node.node_id} gen {self._generation}"

    # ---------------------------------------------------------------- lifecycle

    def run(self) -> int:
        """Join, follow rounds, run workers; returns the exit code. Call from the main thread."""
        handled = {*self._cfg.signals(), DRAIN_SIGNAL}
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            self._holding.start()
            # A fault found before joining holds the node out from the start: the leader
            # never places it, and it waits as held.
            self._health_found(self._holding.check_now())
            joining.await_warm(self._store, self._job, self._warm, self._node.slots, self._tag)
            self._join()
            self._phase = AgentPhase.FOLLOWING
            self._holding.start_checks()
            while True:
                fence_at = self._fence.due()
                due = [
                    t
                    for t in (
                        self._finish_by,
                        self._refills.due,
                        self._restart_at,
                        fence_at,
                        self._holding.due(),
                    )
                    if t is not None
                ]
                wait_s = min(due) - time.monotonic() if due else None
                if wait_s is not None:  # (a deadline years away, as a hold's end may be:
                    wait_s = min(max(0.0, wait_s), LONGEST_TIMER_S)  # wake and look again)
                try:
                    event = self._events.get(timeout=wait_s)
                except queue.Empty:
                    self._on_timer(fence_at)
                    continue
                self._handle(event)
                self._judged_pids = self._workers.judged()
        except AgentExit as done:
            (log.info if done.code == 0 else log.error)("%s: %s", self._tag(), done)
            return done.code
        finally:
            self._drain_news()
            self._holding.close()
            self._workers.kill()
            if self._rdzv is not None:
                self._rdzv.leave()
            self._warm.close()
            self._judge.close()
            self._history.close(timeout_s=2.0)
            self._services.close()
            self._channel.close()
            self._fence.close()
            self._progress.close(timeout_s=2.0)
            shutil.rmtree(self._run_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_timer(self, fence_at: float | None) -> None:
        """The loop's wait ended with no event: the earliest of its deadlines is due."""
        now = time.monotonic()
        if fence_at is not None and now >= fence_at:
            self._fence.apply()
        elif self._holding.on_timer(now):
            pass
        elif self._restart_at is not None and now >= self._restart_at:
            self._restart_at = None
            if self._rdzv is not None:
                self._rdzv.request_restart()
        elif self._refills.due is not None and now >= self._refills.due:
            self._refills.fill()
        elif self._finish_by is not None and now >= self._finish_by:
            self._stop_workers()
            raise AgentExit(
                0,
                "The job finished elsewhere and this node's workers did not finish "
                f"within the grace period ({self._cfg.grace_period_s:g} s); stopped them.",
            )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(SignalReceived(signum))

    def _join(self) -> None:
        post: Callable[[AgentEvent], None] = self._events.put
        self._rdzv = Participant(
            self._store,
            self._job,
            self._node,
            self._policy,
            lease_ttl_s=self._cfg.lease_ttl_s,
            on_round=lambda r: post(RoundSeen(r)),
            on_lease_expired=lambda reason: post(LeaseLost(reason)),
            on_etcd_silent=lambda: post(EtcdSilent()),
            holds=self._holds,
            serve_tcpstore=self._services.tcpstore.serve,
            on_failure=lambda reason: post(RendezvousFailed(reason)),
            events=self._history,
            on_forgot=self._progress.publish_again,
            on_contact=self._fence.contact,
        )
        joining.register(
            self._rdzv,
            self._cfg.join_timeout_s,
            self._events,
            lambda signum, what: self._left(signum, what, False),
            self._tag,
            keep=self._drains,
        )
        rdzv = self._rdzv
        self._metrics.lease_healthy.set_function(lambda: float(rdzv.lease_healthy))
        self._metrics.held.set_function(lambda: float(self._holding.active() is not None))
        self._record(
            EventKind.JOIN,
            self._generation,
            f"joined with {self._node.slots} worker slot(s) on {self._node.host}",
        )
        if self._cache is not None:  # say whether this job starts cold or resumes from it
            self._progress.read_cache(self._cache.url)
        log.info(
            "%s: joined with %d worker slot(s) on %s (GPUs: %s).",
            self._tag(),
            self._node.slots,
            self._node.host,
            ", ".join(f"{g.index}:{g.model}" for g in self._node.gpus) or "none",
        )

    # ---------------------------------------------------------------- events

    def _view(self) -> AgentView:
        return AgentView(
            self._limits,
            self._phase,
            self._generation,
            self._workers.mode(),
            self._workers.round is not None,
            self._restarts,
            self._reports.trained,
            held=self._holding.text(),
            now=time.monotonic(),
        )

    def _handle(self, event: object) -> None:
        if isinstance(event, RoundSeen):
            self._react(react.on_round(self._view(), event.round))
        elif isinstance(event, SignalReceived) and self._drains(event.signum):
            self._holding.hold_out(
                HoldKind.DRAIN, f"{DRAIN_SIGNAL.name} to its agent (pid {os.getpid()})"
            )
        elif isinstance(event, HoldChanged):
            self._holding.changed(event.hold)
        elif isinstance(event, HealthFound):
            self._health_found(list(event.findings))
        elif isinstance(event, WorkerExit):
            self._judge.forget(event.pid)
            self._react(react.on_exit(self._view(), self._workers.ended(event)))
        elif isinstance(event, SignalReceived):
            self._react(react.on_signal(self._view(), event.signum))
        elif isinstance(event, LeaseLost):
            self._record(
                EventKind.LEASE_LOST,
                self._generation,
                f"lease lost ({event.reason}); registering again"
                + (", its workers training on" if self._holds() else ""),
            )
        elif isinstance(event, RendezvousFailed):
            raise AgentExit(1, event.reason)
        elif isinstance(event, Hello):
            if self._workers.hello(event.pid):
                log.info("%s: the replacement worker (pid %d) is ready.", self._tag(), event.pid)
        elif isinstance(event, StateLost):
            self._state_lost(event.message)
        elif isinstance(event, Hung):
            self._news.hung(event.pid, event.hang, self._generation)
        elif isinstance(event, EtcdSilent):
            # A worker whose collective failed (a peer died meanwhile) waits for the round
            # that etcd's return brings, with its state in memory, up to the join timeout.
            self._workers.tell_waiting(self._cfg.join_timeout_s)
        elif isinstance(event, Persisted):
            self._publish_cache(event)
        elif isinstance(event, Reached):
            self._fence.reopen(event.at)
        elif isinstance(event, Event):
            self._note(event)
        elif isinstance(event, Stepped):
            self._news.stepped(event)
        elif isinstance(event, Paced):
            slow = self._news.paced(event)
            if slow is not None and slow.evict:
                self._holding.hold_out(HoldKind.QUARANTINE, slow.text)
        elif isinstance(event, PeerFailed) and self._rdzv is not None:
            self._rdzv.report_failure(event.generation)

    def _react(self, reaction: Reaction) -> None:
        """Take the reaction's phase, then run its actions in order (a follow-up's reaction,
        on a fresh view, in its place)."""
        self._phase = reaction.phase
        for action in reaction.actions:
            self._run(action)

    def _run(self, action: react.Action) -> None:
        """Run one action of a reaction (efdl.launcher.react): all of the I/O is here."""
        workers = self._workers
        match action:
            case react.EnterRound(round=r):
                self._enter_round(r)
            case react.ReadProgress():
                self._progress.read()
            case react.Follow(round=r):
                workers.round = r
            case react.HandOver(round=r):
                self._react(react.hand_over(self._view(), r))
            case react.JudgeFailure():
                self._react(react.judge_failure(self._view(), action))
            case react.RebuildInPlace(round=r):
                self._rebuild_in_place(r)
            case react.StartWorkers(round=r, local_ranks=ranks):
                self._start_workers(r, ranks)
            case react.StartReplacement(local_rank=local):
                assert workers.round is not None
                self._start_workers(workers.round, (local,), standby=True)
            case react.StopWorkers(grace_s=grace_s):
                self._stop_workers(grace_s)
            case react.AwaitWorkers(timeout_s=timeout_s):
                if workers.group is not None:
                    workers.group.wait(timeout_s)
            case react.AwaitFinish():
                self._finish_by = time.monotonic() + self._cfg.grace_period_s
            case react.TellWaiting(timeout_s=timeout_s):
                workers.tell_waiting(timeout_s)
            case react.TellLeave():
                workers.tell_leave()
            case react.MarkPause():
                self._news.pauses.restarting()
            case react.NoteExit(local_rank=local, code=code):
                workers.note_exit(local, code)
            case react.Dismiss(pid=pid):
                workers.dismiss(pid)
            case react.Detach(pid=pid):
                workers.detach(pid)
            case react.DropWorkers():
                workers.drop()
            case react.ReportCrash(exit=ev, error=error):
                workers.report_crash(ev, error)
            case react.CountRestart(budget=budget):
                self._restarts = budget
            case react.HoldOut(kind=kind, reason=reason, otherwise=otherwise, ttl_s=ttl_s):
                if self._holding.hold_out(kind, reason, ttl_s) is None:
                    for fallback in otherwise:
                        self._run(fallback)
            case react.RefillSoon():
                self._refills.soon()
            case react.HoldRestart():
                self._restart_at = time.monotonic() + RESTART_HOLD_S
            case react.ReportFailure(generation=generation):
                if self._rdzv is not None:
                    self._rdzv.report_failure(generation)
            case react.LeaveRendezvous():
                self._leave_rendezvous()
            case react.Record(kind=kind, generation=generation, text=text):
                self._record(kind, generation, text)
            case react.Say(level=level, message=message):
                log.log(level, "%s: %s", self._tag(), message)
            case react.FinishJob():
                raise ending.finish_job(self._store, self._job, self._node.node_id)
            case react.EndAgent(code=code, message=message):
                raise AgentExit(code, message)
            case react.EndLeft(signum=signum, what=what, finished=finished):
                raise self._left(signum, what, finished)
            case _:
                assert_never(action)

    def _enter_round(self, r: Round) -> None:
        self._generation = r.generation
        logs.context.set(generation=r.generation)
        self._restart_at = None  # this round restarts the workers (or stops them)
        # The round in the metrics (its event is in the history already: whoever writes a
        # round writes its event, a final one in the same transaction: efdl.rendezvous
        # .lifecycle.end_job).
        self._metrics.round(r)
        self._refills.round_came()

    def _record(self, kind: EventKind, generation: int, text: str, **fields: Any) -> None:
        self._note(self._history.event(kind, generation, text, **fields))

    def _note(self, event: Event) -> None:
        """Into the job's history, and into the metrics it moves."""
        self._history.write(event)
        self._metrics.count(event)

    def _state_lost(self, message: str) -> None:
        """The job cannot go on from where it was: stop the workers and end the job."""
        self._stop_workers(grace_s=min(self._cfg.grace_period_s, 5.0))
        raise ending.fail_job(self._store, self._job, self._node.node_id, message, self._tag)

    def _publish_cache(self, ev: Persisted) -> None:
        assert self._cache is not None
        self._holding.snapshot_bytes = ev.bytes
        self._news.persisted(ev, self._cache.url, self._generation)

    # ---------------------------------------------------------------- workers

    def _rebuild_in_place(self, r: Round) -> None:
        """Place the running workers in round ``r`` (efdl.launcher.node_workers), then start
        the local ranks still missing."""
        placed, missing = self._workers.place(r, self._progress.position)
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

    def _start_workers(self, r: Round, local_ranks: Sequence[int], standby: bool = False) -> None:
        """Start workers for ``local_ranks`` of round ``r``; ``standby``: replacements that
        wait, connected, for a later round to place them."""
        self._workers.start(r, local_ranks, self._progress.position, self._restarts.used, standby)
        self._refills.started()  # warm processes to replace the ones taken

    def _stop_workers(self, grace_s: float | None = None) -> None:
        if self._workers.group is not None:
            self._fence.kill_frozen()
            self._workers.stop(self._cfg.grace_period_s if grace_s is None else grace_s)

    def _set_down(self, replacing: int) -> None:
        """The node offers ``replacing`` workers fewer until its replacements are ready."""
        if self._rdzv is not None:
            self._rdzv.set_down(replacing)

    # ---------------------------------------------------------------- holds

    def _drains(self, signum: int) -> bool:
        """Whether signal ``signum`` drains this node (SIGUSR2, unless --signals-to-handle
        makes it a leave)."""
        return signum == DRAIN_SIGNAL and DRAIN_SIGNAL not in self._cfg.signals()

    def _health_found(self, findings: list[Finding]) -> None:
        """What the health checks found: faults counted in the metrics, then held out
        (efdl.launcher.holding)."""
        for f in findings:
            if f.severity is Severity.FAULT:
                self._metrics.health_faults.labels(f.check).inc()
        self._holding.found(findings)

    # ---------------------------------------------------------------- leaving

    def _left(self, signum: int, what: str, finished: bool) -> AgentExit:
        return ending.left(self._store, self._job, self._node.node_id, signum, what, finished)

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
