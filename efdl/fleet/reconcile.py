"""What a host daemon (``efdl node``) does to make its agents match the allocator's word. Pure:
the GPUs each job should hold on this host and the agents running in, the actions out.

A job runs on a host as one ``efdl-run`` agent per GPU (``--gpus <index>``), each a node of
the job's rendezvous with one worker. An agent's GPUs cannot change while it runs, but a job
can gain or lose agents in place; with one GPU each, every grow and every shrink is whole
agents joining or leaving, and the workers that stay never restart (an agent on several
GPUs would have to leave whole, all its workers with it, to give one GPU back: for a job
with one such agent, its whole state). So:

- an agent whose GPU the job still holds keeps running;
- an agent whose GPU the job no longer holds here is stopped (SIGTERM: a graceful leave; its
  worker finishes its step, and the job goes on without it, in place);
- each GPU the job holds that no agent has gets a new agent (it joins in place), once no
  exiting agent (of any job) still holds it.

The cost: a worker sees only its own GPU (``CUDA_VISIBLE_DEVICES``), which NCCL's
peer-to-peer path between GPUs of one host may need to see both of (measured where a
multi-GPU host is lent; docs/fleet.md).

Which GPUs a process that is not efdl's holds (:func:`foreign`) is pure too: NVML's compute
processes on each GPU, less this daemon's own agents and workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostedAgent:
    """An ``efdl-run`` agent this daemon started.

    Attributes:
        job_id: its job.
        gpus: the GPU indices it was given.
        pid: its process id.
        stopping: it was asked to leave and has not exited yet (its GPUs are still held).
    """

    job_id: str
    gpus: frozenset[int]
    pid: int
    stopping: bool = False


@dataclass(frozen=True, slots=True)
class Start:
    """Start an agent of ``job_id`` on ``gpus``."""

    job_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """Ask agent ``pid`` to leave (SIGTERM), because ``reason``."""

    pid: int
    job_id: str
    reason: str


Action = Start | Stop


def reconcile(desired: Mapping[str, Iterable[int]], agents: Sequence[HostedAgent]) -> list[Action]:
    """The actions that bring ``agents`` to ``desired`` (job id -> its GPUs on this host),
    stops first, then one new agent per GPU. A GPU still held by an exiting agent is not
    given to a new one yet: the daemon calls this again when an agent exits. (Agents on
    several GPUs, from an older daemon, are kept while all their GPUs are.)"""
    want = {job: frozenset(gpus) for job, gpus in desired.items() if gpus}
    actions: list[Action] = []
    kept: dict[str, frozenset[int]] = {}
    held = frozenset().union(*(a.gpus for a in agents if a.stopping))
    for a in sorted(agents, key=lambda a: a.pid):
        if a.stopping:
            continue
        job_gpus = want.get(a.job_id, frozenset())
        if a.gpus <= job_gpus and not (a.gpus & kept.get(a.job_id, frozenset())):
            kept[a.job_id] = kept.get(a.job_id, frozenset()) | a.gpus
            continue
        if not job_gpus:
            reason = f"job {a.job_id} holds no GPU here any more"
        else:
            lost = sorted(a.gpus - job_gpus)
            reason = f"job {a.job_id} gave up GPU(s) {','.join(map(str, lost))} here"
        actions.append(Stop(a.pid, a.job_id, reason))
        held |= a.gpus
    for job, gpus in sorted(want.items()):
        missing = gpus - kept.get(job, frozenset()) - held
        actions += [Start(job, (gpu,)) for gpu in sorted(missing)]
    return actions


def foreign(processes: Mapping[int, Iterable[int]], ours: Iterable[int]) -> frozenset[int]:
    """The GPUs (index -> the PIDs of the compute processes on it, as NVML lists them) on
    which a process runs that is none of ``ours`` (this daemon's agents and their workers)."""
    mine = set(ours)
    return frozenset(gpu for gpu, pids in processes.items() if set(pids) - mine)
