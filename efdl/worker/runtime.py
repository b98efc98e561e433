"""This worker's place in the job: its placement, its process groups, its agent.

``init_process_group`` joins the first generation; :class:`Runtime` (one per process:
:func:`get_runtime`) joins later ones (in place), leaves broken ones, and tells the agent's
news to the training loop.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

from efdl._process import exit_left, free_port
from efdl.protocol.env import (
    COLLECTIVE_TIMEOUT_ENV,
    JOIN_TIMEOUT_ENV,
    PLACEMENT_TIMEOUT_ENV,
    SOCKET_ENV,
    STANDBY_ENV,
)
from efdl.protocol.messages import Agreed, PeerFailed, Placement, Rescaled
from efdl.worker import ready
from efdl.worker.breaker import Breaker
from efdl.worker.channel import AgentChannel, placement_from_env
from efdl.worker.device import device, nccl_aborter, nccl_options
from efdl.worker.failure import Failure, classify
from efdl.worker.hang import HangWatch

log = logging.getLogger(__name__)
# The collective timeout unless the script or EFDL_COLLECTIVE_TIMEOUT sets one (torch's).
COLLECTIVE_TIMEOUT_S = 600.0
# How many CUDA events the step verdicts cycle through (Runtime.step_event).
_STEP_EVENTS = 16
# torch's switch for gloo groups that connect each pair of ranks at its first use.
_GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
# Whether this torch has that switch (2.7 and later): its gloo device factory takes lazy_init.
LAZY_GLOO = "lazy_init" in (dist.ProcessGroupGloo.create_default_device.__doc__ or "")


class Runtime:
    """This worker's view of the job: its placement, its groups, its agent."""

    def __init__(self) -> None:
        self.channel: AgentChannel | None = None
        self.placement: Placement | None = None
        self.backend = "gloo"
        # torch's own default (10 minutes): a dead or hung peer is found sooner by other means
        # (a closed connection, its lease and the breaker, the hang judge); this bounds what
        # nothing else ends, and must let a rank's long legitimate work (a checkpoint save)
        # through, since the hang timeout is most of it.
        self.timeout = datetime.timedelta(
            seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, str(COLLECTIVE_TIMEOUT_S)))
        )
        # How long to wait for the next placement after leaving a generation, and how long a
        # generation may take to gather all its ranks: set by the agent from its settings.
        self.placement_timeout_s = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "60"))
        self.join_timeout_s = float(os.environ.get(JOIN_TIMEOUT_ENV, "600"))
        self.side: Any = None  # the CPU (gloo) group for control: agreement, sizes, CPU state
        self.gate = ready.ReadinessGate(self.timeout, self.join_timeout_s)
        self.breaker = Breaker()
        self.hang: HangWatch | None = None  # started with the agent's channel
        self.in_elastic_fn = False  # the main thread runs the @elastic function
        # When the others began to wait for this rank in its group (monotonic): at its join,
        # or, for a newcomer that declared at its training function's entry, never.
        self.held_up_since: float | None = None
        # A newcomer's declaration, put off until its training function's entry (defer_join).
        self._undeclared: tuple[Placement, Any] | None = None
        self._connected = -1  # the generation whose groups' pairs are all connected
        # For the agent's history and metrics: the last commit (time, generation) and when
        # local rank 0 last reported progress.
        self._last_commit: tuple[float, int] | None = None
        self._reported_at = 0.0
        self._no_error_state = False  # ProcessGroupNCCL.get_error() failed once: not asked again
        self._events: collections.deque[Any] = collections.deque(maxlen=_STEP_EVENTS)

    @property
    def elastic(self) -> bool:
        return self.channel is not None

    def init_group(self, p: Placement, defer: bool = False) -> None:
        """Join generation ``p``'s groups. Every rank first declares itself on the
        generation's store and waits until all have, except with ``defer`` (a newcomer to a
        job that trains: defer_join): its declaration waits for its training function's
        entry (:meth:`enter`), and the others train on meanwhile. The gloo groups connect
        their pairs at first use (:func:`_lazy_gloo`), so making them waits for nobody."""
        if self.channel is not None:  # the agent serves it; a newer round may replace it
            channel = self.channel
            store = ready.connect(p, self.timeout, lambda: channel.superseded(p.generation))
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = ready.connect(p, self.timeout)
        else:  # no launcher's store (plain env://): rank 0 serves it, as torch does
            store = dist.TCPStore(  # type: ignore[attr-defined]
                p.master_addr, p.master_port, p.world_size, p.rank == 0, self.timeout
            )
        if self.elastic and not defer:
            self.gate.declare_and_wait(p, store)
        nccl = self.backend == "nccl"
        hook = sys.excepthook
        with self.breaker.recording(p.generation), _lazy_gloo():
            dist.init_process_group(
                self.backend,
                store=store,
                rank=p.rank,
                world_size=p.world_size,
                timeout=self.timeout,
                **(nccl_options() if nccl else {}),
            )
            # Bounded like the rest: an agreement that waits on a dead peer must fail, not hang.
            self.side = dist.new_group(backend="gloo", timeout=self.timeout)
        if self.elastic:
            # torch wraps the excepthook at every init to prefix "[rank<r>]: " with the rank of
            # that group: nested and stale after rebuilds. The agent prefixes the current rank.
            sys.excepthook = hook
        if nccl:  # a hung NCCL peer is cut loose by aborting the communicators
            default = dist.distributed_c10d._get_default_group()
            self.breaker.on_cut(p.generation, nccl_aborter(default))
        if self.hang is not None:  # its own client of the store, with short timeouts
            quick = datetime.timedelta(seconds=2)
            self.hang.joined(lambda: ready.connect(p, quick), self.side, p.generation)
        self.placement = p
        self._undeclared = (p, store) if defer else None
        self.held_up_since = None if self._undeclared else time.monotonic()

    def defer_join(self, p: Placement) -> bool:
        """Whether a newcomer joining ``p`` declares itself at its training function's entry
        rather than now: when the job has trained (the others train on while it builds its
        model), its groups are gloo (made lazily: NCCL communicators are made eagerly with
        the others', so an NCCL newcomer declares now), and this torch makes gloo groups
        lazily."""
        return self.elastic and p.job_step > 0 and self.backend == "gloo" and LAZY_GLOO

    def enter(self) -> bool:
        """At the training function's entry, before the sync: a newcomer that put off its
        declaration makes it now and waits until every rank has (the others pause then);
        then every pair of this generation's gloo groups is connected, with the sockets
        recorded for the breaker (lazy groups open them at first use). False: a newer
        generation replaced the one this newcomer joined before it declared (rebuild)."""
        pending, self._undeclared = self._undeclared, None
        if pending is not None:
            joined, store = pending
            if self.channel is not None and self.channel.superseded(joined.generation):
                return False  # a round came during its setup: the others went on to that one
            try:
                self.gate.declare_and_wait(joined, store)
            except RuntimeError:
                if self.channel is not None and self.channel.superseded(joined.generation):
                    return False
                raise
        p = self.placement
        if p is None or p.generation == self._connected or not dist.is_initialized():
            return True
        with self.breaker.recording(p.generation):
            dist.barrier(group=self.side)  # gloo's barrier sends between every pair
            if self.backend == "gloo":
                dist.barrier()
        self._connected = p.generation
        return True

    def join(self, p: Placement, defer: bool = False) -> Placement | None:
        """Join ``p``'s group (``defer``: see :meth:`init_group`). If that fails because a
        newer generation replaced ``p`` (its store is closed when the next one is served: a
        node joined or left meanwhile), join the newer one. Returns the placement joined;
        None if asked to leave meanwhile."""
        while True:
            try:
                self.init_group(p, defer)
                return p
            except RuntimeError as exc:  # dist.DistError too
                if self.channel is None:
                    raise
                self.destroy_group(abort=True)
                newer = self.channel.wait(p.generation, self.timeout.total_seconds())
                if newer is None:
                    if self.channel.leave_requested:
                        return None
                    raise
                log.warning(
                    "Joining generation %d failed (%s); generation %d replaced it: joining that.",
                    p.generation,
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                    newer.generation,
                )
                p = newer

    def destroy_group(self, abort: bool = False) -> None:
        """Leave the current groups. ``abort``: they broke (a peer died); an operation may
        still wait on the dead peer until the collective timeout, and a plain destroy would
        wait for it, so abort them. A gloo group (the CPU side group too) is kept alive until
        then: its destructor joins its worker threads, which are the ones waiting (found with
        a 3-rank job where a node died: 15 s in the destructor); its memory is the CPU's and
        small. A sound gloo group is kept too, and dropped on a thread of its own: its
        destructor takes about 10 ms even with nothing pending, which the whole job would
        stand still for in the pause (the training group's went when the old DDP wrapper
        did). An NCCL group is dropped at once: the abort has ended its kernels, and its
        communicators' GPU memory must not be held beside the next generation's.

        torch documents ``_abort_process_group()`` for ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``,
        because the watchdog may abort the communicators itself; efdl keeps ``2`` (the
        watchdog aborts on an error or timeout and the process lives), so that a collective
        of the script's own on a dead peer raises instead of hanging, and an abort of
        communicators the watchdog already aborted does nothing more
        (tests/gpu/test_gpu.py aborts from a side thread, then here)."""
        if self.hang is not None:
            self.hang.left()
        if not dist.is_initialized():
            return
        try:
            groups = list(dist.distributed_c10d._world.pg_names)
            _drop_later([g for g in groups if _backend_of(g) != "nccl"], self.timeout)
            if abort:
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead peer may not shut down cleanly
            log.warning("Destroying the old process group failed (%s); going on.", exc)
        self.breaker.forget()
        self.side = None

    def _cut(self) -> bool:
        """Whether efdl cut this rank's current generation itself (efdl.worker.breaker)."""
        p = self.placement
        return p is not None and self.breaker.was_cut(p.generation)

    def classify(self, exc: BaseException) -> Failure:
        """What ``exc``, raised in this rank's step, means (efdl.worker.failure), with efdl's
        own record of a cut."""
        return classify(exc, self._cut())

    def errored(self) -> bool:
        """Whether this rank's training group reported a communication error: efdl cut it,
        or (NCCL) ``ProcessGroupNCCL.get_error()`` is not SUCCESS (efdl.worker.verdict)."""
        if self._cut():
            return True
        if self.backend != "nccl" or not dist.is_initialized():
            return False
        backend = dist.distributed_c10d._get_default_group()._get_backend(device())
        get_error = getattr(backend, "get_error", None)  # torch >= 2.7
        if get_error is None or self._no_error_state:
            return False
        try:
            return bool(get_error() != ErrorType.SUCCESS)
        except Exception as exc:  # never let the check itself break training
            self._no_error_state = True
            log.warning(
                "ProcessGroupNCCL.get_error() failed (%s): step verdicts see only efdl's own "
                "cuts from now on.",
                exc,
            )
            return False

    def step_event(self) -> Any:
        """A CUDA event after the work enqueued so far (NCCL: a step's collectives may still
        run when commit() is called); None where collectives block (gloo)."""
        if self.backend != "nccl":
            return None
        # A ring of events, each re-recorded in its turn: making a CUDA event per step cost
        # 0.1-0.2 ms of host time per step on an H200 when it was tried; the verdict with the
        # ring costs about 9 us (docs/benchmarks.md, the step verdict on NCCL). Re-recording one
        # that an older step still waits on only moves its point later, so that step is
        # verified later, never before its work ended.
        full = len(self._events) == _STEP_EVENTS
        event = self._events.popleft() if full else torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._events.append(event)
        return event

    @contextlib.contextmanager
    def hang_paused(self) -> Iterator[None]:
        """The main thread waits on purpose (fenced): its peers' wait is not its hang."""
        if self.hang is None:
            yield
            return
        with self.hang.paused():
            yield

    def trains(self) -> None:
        """The state is synced and the training function is called: the hang watch's clock
        starts (efdl.worker.hang)."""
        if self.hang is not None:
            self.hang.trains()

    def committed(self, step: int) -> None:
        """A step was committed: the breaker sees progress; rank 0 tells the agent how long
        training stood still when this is the first commit of a new generation."""
        self.breaker.stepped()
        if self.hang is not None:
            self.hang.committed(step)
        p, channel = self.placement, self.channel
        if channel is None or p is None:
            return
        now = time.monotonic()
        last, self._last_commit = self._last_commit, (now, p.generation)
        if last is not None and last[1] != p.generation and p.rank == 0:
            channel.notify(Rescaled(p.generation, p.world_size, step, now - last[0]))

    def agreed(self, step: int, floor: int) -> None:
        """Commit ``step`` read the agreement that every rank of the generation started at
        its commit before: every rank holds ``floor`` or newer (efdl.worker.state). Local rank
        0 reports both to its agent at most once a second (the job's progress record: a
        generation whose holders are all behind ``floor`` must not go on from them)."""
        p, channel = self.placement, self.channel
        if channel is None or p is None or p.local_rank != 0:
            return
        now = time.monotonic()
        if now - self._reported_at >= 1.0:
            self._reported_at = now
            channel.notify(Agreed(step, floor, p.generation))

    def report(self, exc: BaseException) -> None:
        """The generation was left because of ``exc``: if a peer's connection closed, tell
        the agent at once, so that the job's nodes are probed for a dead agent (its node then
        leaves the job before its lease expires; efdl.rendezvous.probe), and close this
        rank's connections of the generation."""
        p, channel = self.placement, self.channel
        if channel is None or p is None:
            return
        if self.classify(exc) is Failure.PEER:
            channel.notify(PeerFailed(p.generation))
            # And end this generation's connections now: a rank whose neighbours in the
            # collective still live would otherwise wait on them (until the breaker cuts it,
            # after the next generation is ready); this way every rank fails, and reports, at
            # once.
            self.breaker.cut(p.generation + 1)

    def trains_older_than(self, generation: int) -> bool:
        """Whether the main thread still trains a generation older than ``generation``."""
        p = self.placement
        return self.in_elastic_fn and p is not None and p.generation < generation

    def on_round(self, p: Placement) -> None:
        """A new placement came: count this rank in, and open the pause once every rank is
        (then, if this worker is stuck in a collective with a hung peer, cut it loose)."""
        channel = self.channel
        assert channel is not None

        def go() -> None:
            channel.open(p.generation)
            self.breaker.watch(p.generation, lambda: self.trains_older_than(p.generation))

        self.gate.watch(p, lambda: channel.superseded(p.generation), go)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    """This process's one :class:`Runtime`, made at the first call.

    Per process, like torch.distributed's default group: a worker takes part in one job, in
    one generation at a time, and every part of efdl.worker (the state, the training loop,
    the channel's thread) must see the same placement, groups and agent."""
    global _runtime
    rt = _runtime
    if rt is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime()
            rt = _runtime
    return rt


def _backend_of(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # not a group torch knows any more
        return "?"


@contextlib.contextmanager
def _lazy_gloo() -> Iterator[None]:
    """gloo groups made in here connect each pair of ranks at its first use
    (``TORCH_GLOO_LAZY_INIT``), not all at once when made: a newcomer's groups are made
    while the others still train in the old ones. Every rank of a generation makes its
    groups in here (a lazy rank and an eager one cannot connect: torch crashes); the user's
    own groups stay as torch makes them."""
    old = os.environ.get(_GLOO_LAZY_ENV)
    os.environ[_GLOO_LAZY_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_GLOO_LAZY_ENV, None)
        else:
            os.environ[_GLOO_LAZY_ENV] = old


def _drop_later(groups: list[Any], timeout: datetime.timedelta) -> None:
    """Hold ``groups`` until any pending operations of theirs have timed out, then drop them
    on a daemon thread (torch's group destructors release the GIL), so that their
    destructors never block training."""

    def drop() -> None:
        time.sleep(timeout.total_seconds() + 5)
        groups.clear()

    threading.Thread(target=drop, name="efdl-old-groups", daemon=True).start()


def _warm_up() -> None:
    """Import what the first optimizer of any script imports lazily (``torch._dynamo``, over a
    second here), so that a newcomer does it before the survivors pause for it, not after."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # only an optimisation
        log.debug("Warm-up import failed: %s", exc)


def init_process_group(backend: str = "gloo", timeout_s: float | None = None) -> None:
    """``dist.init_process_group`` for efdl: joins this generation's group and, when started by
    ``efdl-run``, tells the agent that this worker rebuilds in place (no restarts).

    Args:
        backend: ``gloo`` or ``nccl``.
        timeout_s: bound on collectives and on joining a group (default 600 s, torch's, or
            ``EFDL_COLLECTIVE_TIMEOUT``). A dead peer surfaces sooner (its connections close),
            and a hung one is cut loose once the next generation is ready; this bounds what
            nothing else ends. Longer than the slowest legitimate collective, and than any
            one rank's work the others wait for (a checkpoint rank 0 saves): the hang timeout
            is 90% of it. (Moving state to a newcomer is cut into messages
            that each take a fraction of it, however large the state.)
    """
    rt = get_runtime()
    rt.backend = backend
    if timeout_s is not None:
        rt.timeout = datetime.timedelta(seconds=timeout_s)
    path = os.environ.get(SOCKET_ENV)
    if backend == "nccl":
        torch.cuda.set_device(device())
        if path:
            # On an NCCL error or a collective timeout, ProcessGroupNCCL's watchdog aborts the
            # communicators (2: CleanUpOnly) and the pending and next operations raise; the
            # process lives on to rebuild in place. torchrun's 1 (and torch's default, 3) end
            # the process instead: right for restart mode, fatal to in-place recovery.
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    if "RANK" not in os.environ and path is None:  # plain `python train.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    placement = placement_from_env()
    rt.gate = ready.ReadinessGate(rt.timeout, rt.join_timeout_s)
    standby = os.environ.get(STANDBY_ENV) == "1"
    if path and (placement.generation > 1 or standby):
        _warm_up()  # a newcomer: get the slow first-use imports done before counting in
    if path:
        rt.channel = AgentChannel(path, placement.local_rank, on_round=rt.on_round)
        if rt.hang is None:
            rt.hang = HangWatch.from_env(rt.timeout.total_seconds(), lambda: rt.in_elastic_fn)
            atexit.register(rt.hang.close)
        rt.hang.set_collective_timeout(rt.timeout.total_seconds())
        if standby:  # a replacement: ready, waiting for a place
            log.info(
                "Standing by (generation %d) for a round that places this worker.",
                placement.generation,
            )
            placed = rt.channel.wait(placement.generation, rt.join_timeout_s)
            if placed is None:
                exit_left()  # sent away (or the agent is gone) before it was placed
            placement = placed
    if rt.join(placement, rt.defer_join(placement)) is None:
        exit_left()  # the agent sent this worker away before it ever trained
