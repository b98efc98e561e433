"""This node's workers across rounds: which group runs, what each of its workers is, and
how they are started, placed, told, and stopped.

A :class:`~efdl.launcher.workers.WorkerGroup` is the processes of one generation; this is
the agent's book of them across generations: which pids are efdl-aware (they said hello:
rebuilt in place), which were told to leave, which are replacements standing by or not
ready yet, and the placements waiting for a worker that has not connected. It runs on the
agent's loop only (efdl.launcher.agent); what it decides is decided there
(efdl.launcher.react).
"""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable, Sequence
from pathlib import Path

from efdl.config import LaunchConfig
from efdl.launcher.env import JobContext, worker_env
from efdl.launcher.gpus import free_slot
from efdl.launcher.react import EndedWorker, WorkerMode, how_ended
from efdl.launcher.warm import WarmPool
from efdl.launcher.workers import Worker, WorkerExit, WorkerGroup
from efdl.output import LogSpec
from efdl.protocol.env import (
    BEAT_DIR_ENV,
    FENCE_ENV,
    GRACE_ENV,
    HANG_TIMEOUT_ENV,
    JOB_GENERATION_ENV,
    JOB_STEP_ENV,
    JOIN_TIMEOUT_ENV,
    PEER_COPIES_ENV,
    PLACEMENT_TIMEOUT_ENV,
    SOCKET_ENV,
    STANDBY_ENV,
    STRAGGLER_WINDOW_ENV,
)
from efdl.protocol.messages import Leave, Placed, Placement, Waiting
from efdl.rendezvous.outputs import Position
from efdl.rendezvous.records import Round
from efdl.worker.cache import CacheSettings
from efdl.worker.channel import ChannelServer

log = logging.getLogger(__name__)


class NodeWorkers:
    """This node's worker group and its book of workers (see the module docstring).

    Args:
        cfg: the launch configuration.
        args: the worker command line.
        ctx: what every worker of this node shares across rounds.
        run_dir: the agent's private directory (error files, beats).
        channel: the agent's end of the workers' channel.
        fence_path: the fence's file (efdl.worker.fence).
        cache: the remote cache's settings, None without one.
        events: the agent's queue, for the workers' exits.
        warm: the warm processes to start workers in.
        on_crash: records a worker's failure (a sentence) in the job's history.
        on_down: told how many replacements are not ready yet (the node offers that many
            workers fewer).
        tag: says the job, node and generation, for the log.
    """

    def __init__(
        self,
        cfg: LaunchConfig,
        args: Sequence[str],
        ctx: JobContext,
        run_dir: Path,
        channel: ChannelServer,
        fence_path: Path,
        cache: CacheSettings | None,
        events: queue.Queue[object],
        warm: WarmPool,
        on_crash: Callable[[str], None],
        on_down: Callable[[int], None],
        tag: Callable[[], str],
    ) -> None:
        self._cfg = cfg
        self._args = list(args)
        self._ctx = ctx
        self._run_dir = run_dir
        self._channel = channel
        self._fence_path = fence_path
        self._cache = cache
        self._logs: LogSpec = cfg.log_spec(ctx.job_id)
        self._events = events
        self._warm = warm
        self._on_crash = on_crash
        self._on_down = on_down
        self._tag = tag
        self.group: WorkerGroup | None = None
        self.round: Round | None = None  # the newest active round that placed this node
        self.in_place: set[int] = set()  # pids of workers that rebuild in place
        self.leaving: set[int] = set()  # pids told to leave at the next step boundary
        # Replacements of in-place workers that died: those not placed in a round yet, and
        # those not ready yet (no hello: the node offers that many workers fewer).
        self.standby: set[int] = set()
        self.replacing: set[int] = set()
        self.unsent: dict[int, Placement] = {}  # placements for workers not connected yet

    # ---------------------------------------------------------------- what runs

    def running(self) -> list[Worker]:
        group = self.group
        return group.running() if group is not None else []

    def find(self, pid: int) -> Worker | None:
        """The running worker ``pid``, None if it is not one."""
        return next((w for w in self.running() if w.pid == pid), None)

    def holds(self, generation: int) -> str:
        """The ``round_id`` of the round its workers run if that round is ``generation``'s
        and they run; "" otherwise. From other threads: reads of single attributes."""
        r, group = self.round, self.group
        if r is None or group is None or r.generation != generation:
            return ""
        return r.round_id if group.running() else ""

    def store_of(self, generation: int) -> tuple[str, int] | None:
        """The c10d store of ``generation`` if it is the round the workers run (from the
        hang judge's thread: reads of single attributes)."""
        r = self.round
        if r is None or r.generation != generation or not r.store_port:
            return None
        return r.store_host, r.store_port

    def runs_rank0(self) -> bool:
        """Whether this node's workers include rank 0 (from the channel's threads)."""
        r = self.round
        return r is not None and r.member is not None and r.member.first_rank == 0

    def mode(self) -> WorkerMode:
        """What the running workers are: none, plain, or all efdl-aware (rebuilt in place)."""
        running = self.running()
        if not running:
            return WorkerMode.NONE
        if all(w.pid in self.in_place for w in running):
            return WorkerMode.IN_PLACE
        return WorkerMode.PLAIN

    def plain(self) -> list[Worker]:
        """The running workers that are not efdl-aware (the fence stops those)."""
        return [w for w in self.running() if w.pid not in self.in_place]

    def judged(self) -> frozenset[int]:
        """The running efdl-aware workers' pids, whose hangs are judged from outside."""
        return frozenset(w.pid for w in self.running() if w.pid in self.in_place)

    def ended(self, ev: WorkerExit) -> EndedWorker:
        """What the agent knew of the worker of exit ``ev`` (its error read if it failed)."""
        group = self.group
        if group is None or ev.pid not in group.pids:
            return EndedWorker(ev, False, False, False, False, False, False)
        worker = next(w for w in group.workers if w.pid == ev.pid)
        codes = {**group.exited, ev.local_rank: ev.code}
        return EndedWorker(
            ev,
            ours=True,
            leaving=ev.pid in self.leaving,
            standing_by=ev.pid in self.standby,
            in_place=ev.pid in self.in_place,
            all_ended=all(w.proc.poll() is not None for w in group.workers),
            all_clean=all(c == 0 for c in codes.values()),
            error=worker.error_summary() if ev.code != 0 else "",
        )

    # ---------------------------------------------------------------- start and place

    def start(
        self,
        r: Round,
        local_ranks: Sequence[int],
        progress: Position,
        restarts_used: int,
        standby: bool = False,
    ) -> list[int]:
        """Start workers for ``local_ranks`` of round ``r``, told the job's ``progress``
        (generation, step) and this node's ``restarts_used``; ``standby``: replacements of
        failed in-place workers, which wait, connected, for a later round to place them.
        Returns their pids."""
        member = r.member
        assert member is not None
        held = self.group.gpu_slots() if self.group is not None else set()
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
                restarts_used,
                self._run_dir
                / f"gen{r.generation}"
                / f"error-rank{member.first_rank + local}.json",
                slots[local],
            )
            for local in local_ranks
        }
        cfg = self._cfg
        for env in envs.values():
            env[SOCKET_ENV] = str(self._channel.path)
            env[FENCE_ENV] = str(self._fence_path)
            env[BEAT_DIR_ENV] = str(self._run_dir)
            env[GRACE_ENV] = f"{cfg.grace_period_s:g}"
            env[PLACEMENT_TIMEOUT_ENV] = f"{cfg.placement_timeout_s():g}"
            env[JOIN_TIMEOUT_ENV] = f"{cfg.join_timeout_s:g}"
            env[JOB_GENERATION_ENV] = str(progress[0])
            env[JOB_STEP_ENV] = str(progress[1])
            if cfg.hang_timeout_s is not None:
                env[HANG_TIMEOUT_ENV] = f"{cfg.hang_timeout_s:g}"
            env[STRAGGLER_WINDOW_ENV] = str(cfg.straggler_window)
            if self._cache is not None:
                env.update(self._cache.to_env())
            if cfg.peer_copies:
                env[PEER_COPIES_ENV] = str(cfg.peer_copies)
            if standby:
                env[STANDBY_ENV] = "1"
        if self.group is None:
            self.group = WorkerGroup(r.generation, [])
        pids = self.group.spawn(
            self._args, envs, r.generation, self._logs, self._events, slots, self._warm
        )
        if standby:
            self.in_place.update(pids)
            self.standby.update(pids)
            self.replacing.update(pids)
            self._on_down(len(self.replacing))
        else:
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

    def place(self, r: Round, progress: Position) -> tuple[list[int], list[int]]:
        """Tell the running workers their place in round ``r`` (survivors in their local
        rank order, then replacements standing by) and send the ones not needed any more
        away at the next step boundary; a replacement not placed yet waits. Returns the
        pids placed and the local ranks still missing."""
        group = self.group
        assert group is not None
        member = r.member
        wanted = member.workers if member else 0
        running = [w for w in group.running() if w.pid not in self.leaving]
        running.sort(key=lambda w: (w.pid in self.standby, w.local_rank))
        placed: list[int] = []
        for w in running:
            if member is not None and len(placed) < wanted:
                w.local_rank = len(placed)
                w.rank = member.first_rank + w.local_rank
                self.standby.discard(w.pid)
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
                    progress[1],
                    progress[0],
                )
                if not self._channel.send(w.pid, Placed(placement)):
                    self.unsent[w.pid] = placement  # a replacement still starting
                placed.append(w.pid)
            elif w.pid not in self.standby:
                self.leaving.add(w.pid)
                self._channel.send(w.pid, Leave())
        group.generation = r.generation
        return placed, list(range(len(placed), wanted))

    def hello(self, pid: int) -> bool:
        """Worker ``pid`` connected: it rebuilds in place, and gets the place a round may
        already have for it. Returns whether it is a replacement, ready now (its slot is
        offered again)."""
        self.in_place.add(pid)
        placement = self.unsent.pop(pid, None)
        if placement is not None:
            self._channel.send(pid, Placed(placement))
        if pid not in self.replacing:
            return False
        self.replacing.discard(pid)
        self._on_down(len(self.replacing))
        return True

    # ---------------------------------------------------------------- tell

    def tell_waiting(self, timeout_s: float) -> None:
        """Tell every running efdl-aware worker that the job waits, up to ``timeout_s``."""
        for w in self.running():
            if w.pid in self.in_place:
                self._channel.send(w.pid, Waiting(timeout_s))

    def tell_leave(self) -> None:
        """Tell every running worker to leave at its next step boundary (pause with
        everyone, commit, exit)."""
        for w in self.running():
            self.leaving.add(w.pid)
            self._channel.send(w.pid, Leave())

    # ---------------------------------------------------------------- exits and stops

    def note_exit(self, local_rank: int, code: int) -> None:
        if self.group is not None:
            self.group.exited[local_rank] = code

    def dismiss(self, pid: int) -> None:
        """Worker ``pid`` left as asked (or stood by, unplaced, and was sent away)."""
        self.leaving.discard(pid)
        self.standby.discard(pid)
        if self.group is not None:
            self.group.remove(pid)
            if not self.group.workers:
                self.forget()

    def detach(self, pid: int) -> None:
        """In-place worker ``pid`` failed: its peers go on without it."""
        if self.group is not None:
            self.group.remove(pid)
        self.standby.discard(pid)
        self.replacing.discard(pid)
        self.unsent.pop(pid, None)

    def report_crash(self, ev: WorkerExit, error: str) -> None:
        """Log the failure of exit ``ev`` with its ``error`` (the exception, then the
        stack), and record the crash in the job's history."""
        first_line, *stack = error.splitlines() or [""]
        log.error(
            "%s: worker rank %d (local rank %d, pid %d) failed with %s%s.%s",
            self._tag(),
            ev.rank,
            ev.local_rank,
            ev.pid,
            how_ended(ev.code),
            f": {first_line}" if first_line else "",
            "\n" + "\n".join(stack) if stack else "",
        )
        self._crashed(ev.rank, ev.pid, ev.code)

    def _crashed(self, rank: int, pid: int, code: int) -> None:
        self._on_crash(f"worker rank {rank} (pid {pid}) failed with {how_ended(code)}")

    def stop(self, grace_s: float) -> None:
        """Stop every worker (each gets ``grace_s`` to exit) and forget the group. A worker
        that failed before this stop, its exit not handled yet (a round came first: its
        peers' failure made it), is a crash all the same: the history says so."""
        group = self.group
        if group is None:
            return
        for w in group.workers:
            code = w.proc.poll()
            if code and w.local_rank not in group.exited and w.pid not in self.leaving:
                group.exited[w.local_rank] = code
                self._crashed(w.rank, w.pid, code)
        group.stop(grace_s)
        self.forget()

    def forget(self) -> None:
        """The group is gone (stopped or killed): so are its replacements."""
        self.group = None
        self.standby.clear()
        self.unsent.clear()
        if self.replacing:
            self.replacing.clear()
            self._on_down(0)

    def drop(self) -> None:
        """Every worker ended by itself: the node has no group any more."""
        self.group = None

    def kill(self) -> None:
        """Kill every worker at once (the agent ends)."""
        if self.group is not None:
            self.group.kill()
