"""``efdl node``: the daemon on each GPU host of a fleet (systemd or a DaemonSet).

It registers the host's GPUs (NVML) under its lease, stands for the fleet's allocator
(efdl.fleet.leader), and makes the host's ``efdl-run`` agents match the allocator's word
(efdl.fleet.reconcile): an agent per job and set of GPUs, started in the job's working
directory with its environment, kept apart from the other jobs (efdl.fleet.spawn: no shell,
a uid of its own, an etcd user limited to its job's keys), stopped with SIGTERM (a graceful,
in-place leave). It watches
NVML: a GPU on which a process that is not one of its agents' runs is marked ``foreign`` in
its host record at once, so the allocator takes it from the job there.

A restart of the daemon does not stop training: agents run in sessions of their own, their
PIDs and GPUs are kept in ``--state-dir``, and a new daemon adopts those still running. Its
lease is not revoked when it exits, so a restart within the lease's TTL keeps the host's
record (and its jobs' GPUs); a daemon away longer gives its host up. An agent that exits by
itself ends its job (exit 0: finished; else failed, with the agent's log named).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from efdl import __version__
from efdl.errors import StoreError
from efdl.fleet.etcd_users import AgentUsers
from efdl.fleet.host_holds import carry_quarantines
from efdl.fleet.leader import RETRY_S, Allocator
from efdl.fleet.policy import FleetPolicy
from efdl.fleet.reconcile import HostedAgent, Start, Stop, foreign, reconcile
from efdl.fleet.records import FleetGpu, FleetKeys, Host, JobSpec, JobStatus, Phase
from efdl.fleet.registry import read_fleet, status_writes
from efdl.fleet.spawn import AgentFiles, Isolation, Spawner, StartError
from efdl.launcher.gpus import discover
from efdl.rendezvous.api import Compare, KVStore
from efdl.rendezvous.lease import LeaseSession

log = logging.getLogger(__name__)

# How long an agent asked to leave may take (its grace period, 30 s by default, and some).
_STOP_GRACE_S = 90.0
# How often a daemon reads the whole fleet even when no record changed (seconds).
_RESYNC_S = 30.0


def nvml_gpus() -> dict[int, tuple[str, tuple[int, ...]]]:
    """This host's GPUs (efdl.launcher.gpus.discover): index -> (UUID, PIDs of the compute
    processes on it); {} where there is no NVIDIA driver. A GPU in MIG mode is offered
    whole: its instances' processes count as its own."""
    found: dict[int, tuple[str, tuple[int, ...]]] = {}
    for g in discover():
        uuid_, pids = found.get(g.index, ("", ()))
        found[g.index] = (uuid_ or g.uuid, pids + g.pids)
    return found


@dataclass(slots=True)
class _Running:
    """An agent this daemon runs (or adopted), and how to tell when it ends."""

    agent: HostedAgent  # its pid: the wrapper's (efdl.fleet.wrap), whose child is the agent
    files: AgentFiles
    proc: subprocess.Popen[bytes] | None = None  # None: adopted from an earlier daemon
    stop_by: float = 0.0  # asked to leave: killed if still running at this monotonic time

    def exited(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is not None
        try:
            return psutil.Process(self.agent.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def exit_code(self) -> int | None:
        """The agent's exit code (from the file its wrapper writes), None if unknown."""
        try:
            return int(Path(self.files.exit).read_text().strip())
        except (OSError, ValueError):
            return None


class HostDaemon:
    """One host of a fleet; :meth:`run` until ``stop`` is set.

    Args:
        store: the fleet's etcd.
        keys: the fleet.
        host_id: this host's id (its host name).
        address: where peers reach it (passed to its agents as --host).
        etcd: the endpoints its agents are given (--etcd).
        state_dir: where it keeps its agents' PIDs and logs (survives a restart).
        lease_ttl_s: its lease (a host away longer is given up).
        poll_s: how often it reads NVML and checks its agents.
        allocator: stand for the fleet's allocator too.
        policy: the allocator's settings, if it leads.
        nvml: NVML reader (a stand-in in tests).
        isolation: how jobs are kept apart (``--job-uids``, the jobs' etcd certificate).
        users: etcd's user management, to give each agent a user of its own (None: the
            store cannot; jobs are then not isolated in etcd, and the log says so).
    """

    def __init__(
        self,
        store: KVStore,
        keys: FleetKeys,
        host_id: str,
        address: str,
        etcd: str,
        state_dir: Path,
        lease_ttl_s: int = 10,
        poll_s: float = 1.0,
        allocator: bool = True,
        policy: FleetPolicy | None = None,
        nvml: Callable[[], dict[int, tuple[str, tuple[int, ...]]]] = nvml_gpus,
        isolation: Isolation | None = None,
        users: AgentUsers | None = None,
    ) -> None:
        self._store, self._keys = store, keys
        self.host_id, self._address = host_id, address
        self._state = state_dir
        self._spawn = Spawner(host_id, address, etcd, state_dir, isolation or Isolation(), users)
        self._ttl, self._poll_s = lease_ttl_s, poll_s
        self._allocator, self._policy = allocator, policy or FleetPolicy()
        self._nvml = nvml
        self._inbox: queue.Queue[object] = queue.Queue()
        self._agents: dict[int, _Running] = {}
        self._host: Host | None = None

    # ---------------------------------------------------------------- the loop

    def run(self, stop: threading.Event) -> None:
        """Serve this host until ``stop`` (or its lease ends). etcd failing is waited out:
        the agents train on meanwhile (etcd is not on their training path either).

        Raises:
            ConfigError: jobs cannot be kept apart as asked (efdl.fleet.spawn.Spawner.prepare).
        """
        self._spawn.prepare()
        self._adopt()
        self._spawn.forget_orphans([r.files for r in self._agents.values()])
        session = LeaseSession(self._store, self._ttl, on_expired=lambda why: stop.set())
        threads: list[threading.Thread] = []
        try:
            with contextlib.suppress(StoreError):  # before the allocator: this host is here
                self._register(session.lease_id)
            if self._allocator:
                alloc = Allocator(
                    self._store, self._keys, self.host_id, session.lease_id, self._policy
                )
                t = threading.Thread(target=alloc.run, args=(stop,), daemon=True, name="allocator")
                t.start()
                threads.append(t)
            while not stop.is_set():
                try:
                    self._serve(session.lease_id, stop)
                except StoreError as exc:
                    log.warning(
                        "Host %s: etcd failed (%s); trying again in %.0f s (the agents train on).",
                        self.host_id, exc, RETRY_S,
                    )  # fmt: skip
                    self._host = None  # register again
                    stop.wait(RETRY_S)
        finally:
            stop.set()  # (a Ctrl-C ends the loop without it, and the allocator waits on it)
            session.close(revoke=False)  # a restart within the TTL keeps this host's record
            for t in threads:
                t.join(timeout=30)
            self._save()

    def _serve(self, lease: int, stop: threading.Event) -> None:
        """Watch the jobs and NVML, and reconcile, until ``stop`` or an etcd failure."""
        snap = self._store.get_prefix(self._keys.jobs)
        with self._store.watch(
            self._keys.jobs, prefix=True, start_revision=snap.revision + 1, sink=self._inbox.put
        ):
            changed, synced = True, time.monotonic()
            while not stop.is_set():
                self._register(lease)  # a GPU a foreign process took, at once
                changed |= self._reap() or time.monotonic() - synced > _RESYNC_S
                if changed:
                    self._step()
                    changed, synced = False, time.monotonic()
                with contextlib.suppress(queue.Empty):
                    item = self._inbox.get(timeout=self._poll_s)
                    if isinstance(item, StoreError):
                        raise item
                    changed = True
                    while not self._inbox.empty():
                        self._inbox.get_nowait()

    def _step(self) -> None:
        """Read the fleet; start and stop agents to match it."""
        view = read_fleet(self._store, self._keys)
        desired = {
            j.spec.job_id: dict(j.status.gpus).get(self.host_id, ())
            for j in view.jobs
            if j.status.phase is Phase.RUNNING
        }
        specs = {j.spec.job_id: j.spec for j in view.jobs}
        agents = [r.agent for r in self._agents.values()]
        # A job quarantined one of this host's agents: no job is placed here until it ends.
        carry_quarantines(
            self._store, self._keys, self.host_id, {a.job_id for a in agents}, view.holds
        )
        self._spawn.retry_releases()
        for action in reconcile(desired, agents):
            if isinstance(action, Stop):
                self._stop(action)
            elif isinstance(action, Start) and action.job_id in specs:
                self._start(specs[action.job_id], action.gpus)
        self._save()

    # ---------------------------------------------------------------- the host record

    def _register(self, lease: int) -> None:
        gpus = self._nvml()
        ours = self._our_pids()
        busy = foreign({i: pids for i, (_, pids) in gpus.items()}, ours)
        host = Host(
            self.host_id,
            self._address,
            tuple(FleetGpu(i, u, i in busy) for i, (u, _) in sorted(gpus.items())),
            __version__,
        )
        if host != self._host:
            taken = sorted(
                busy - {g.index for g in (self._host.gpus if self._host else ()) if g.foreign}
            )
            if taken:
                log.warning("Host %s: GPU(s) %s taken by other processes.", self.host_id, taken)
            self._store.put(self._keys.host(self.host_id), host.to_json(), lease=lease)
            self._host = host

    def _our_pids(self) -> set[int]:
        pids: set[int] = set()
        for r in self._agents.values():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(r.agent.pid)
                pids.add(p.pid)
                pids.update(c.pid for c in p.children(recursive=True))
        return pids

    # ---------------------------------------------------------------- agents

    def _start(self, spec: JobSpec, gpus: tuple[int, ...]) -> None:
        tag = f"{spec.job_id}-g{gpus[0]}-{uuid.uuid4().hex[:4]}"
        log_path = self._spawn.logs / f"{tag}.log"
        held = {
            r.files.uid: r.agent.job_id for r in self._agents.values() if r.files.uid is not None
        }
        try:
            uid = self._spawn.pick_uid(spec.job_id, held)
            started = self._spawn.start(spec, gpus, uid, log_path)
        except StartError as exc:
            log.error(
                "Host %s: could not start an agent of job %s on GPU(s) %s: %s.",
                self.host_id, spec.job_id, ",".join(map(str, gpus)), exc,
            )  # fmt: skip
            if exc.lasting:
                self._end_job(spec.job_id, Phase.FAILED, f"on {self.host_id}, {exc}")
            return
        except StoreError as exc:
            log.warning(
                "Host %s: could not make an etcd user for an agent of job %s (%s); trying "
                "again at the next reconciliation.",
                self.host_id, spec.job_id, exc,
            )  # fmt: skip
            return
        pid = started.proc.pid
        agent = HostedAgent(spec.job_id, frozenset(gpus), pid)
        self._agents[pid] = _Running(agent, started.files, started.proc)
        as_uid = f" as uid {uid}" if uid is not None else ""
        log.info(
            "Host %s: started an agent of job %s on GPU(s) %s%s (pid %d, log %s).",
            self.host_id, spec.job_id, ",".join(map(str, gpus)), as_uid, pid, log_path,
        )  # fmt: skip

    def _stop(self, action: Stop) -> None:
        r = self._agents[action.pid]
        log.info("Host %s: stopping agent %d: %s.", self.host_id, action.pid, action.reason)
        # The agent (the wrapper's child) leaves; the wrapper waits for it and records its exit.
        _signal_agent(action.pid, signal.SIGTERM)
        r.agent = HostedAgent(r.agent.job_id, r.agent.gpus, r.agent.pid, stopping=True)
        r.stop_by = time.monotonic() + _STOP_GRACE_S

    def _reap(self) -> bool:
        """Forget the agents that exited (one that exited by itself ends its job); True if
        any did."""
        gone = False
        for pid, r in list(self._agents.items()):
            if not r.exited():
                if r.stop_by and time.monotonic() > r.stop_by:
                    log.warning(
                        "Host %s: agent %d of job %s did not leave within %.0f s; killing it.",
                        self.host_id, pid, r.agent.job_id, _STOP_GRACE_S,
                    )  # fmt: skip
                    _signal_agent(pid, signal.SIGKILL, tree=True)
                    r.stop_by = 0.0
                continue
            del self._agents[pid]
            gone = True
            if r.proc is not None:
                r.proc.wait()
            code = r.exit_code()
            with contextlib.suppress(OSError):
                os.unlink(r.files.exit)
            last = not any(o.agent.job_id == r.agent.job_id for o in self._agents.values())
            self._spawn.finish(r.files, last_of_job=last)
            if r.agent.stopping:
                continue
            phase = Phase.FINISHED if code == 0 else Phase.FAILED
            reason = (
                f"its agent on {self.host_id} finished (exit 0)"
                if code == 0
                else f"its agent on {self.host_id} exited with code {code} (log: {r.files.log})"
            )
            self._end_job(r.agent.job_id, phase, reason)
        return gone

    def _end_job(self, job_id: str, phase: Phase, reason: str) -> None:
        key = self._keys.status(job_id)
        kv = self._store.get(key)
        if kv is None:
            return
        old = JobStatus.from_json(kv.value, kv.key)
        if old.phase is not Phase.RUNNING:
            return
        log.info("Host %s: job %s %s: %s.", self.host_id, job_id, phase.value, reason)
        status = JobStatus(phase, (), time.time(), reason)
        self._store.txn(
            [Compare.mod_revision_is(key, kv.mod_revision)],
            status_writes(self._keys, job_id, status),
        )

    # ---------------------------------------------------------------- surviving a restart

    def _save(self) -> None:
        rows = [
            {
                "pid": r.agent.pid,
                "job_id": r.agent.job_id,
                "gpus": sorted(r.agent.gpus),
                "stopping": r.agent.stopping,
                "started": _start_time(r.agent.pid),
                **r.files.row(),
            }
            for r in self._agents.values()
        ]
        tmp = self._state / "agents.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as out:
            out.write(json.dumps(rows))
        os.replace(tmp, self._state / "agents.json")

    def _adopt(self) -> None:
        """Take over the agents an earlier daemon left running."""
        path = self._state / "agents.json"
        if not path.exists():
            return
        try:
            rows = json.loads(path.read_text())
        except ValueError:
            log.warning("Host %s: %s is not valid JSON; adopting no agents.", self.host_id, path)
            return
        for row in rows:
            pid = int(row["pid"])
            if _start_time(pid) != row.get("started"):  # gone, or the PID was reused
                continue
            agent = HostedAgent(
                str(row["job_id"]), frozenset(row["gpus"]), pid, bool(row["stopping"])
            )
            self._agents[pid] = _Running(agent, AgentFiles.from_row(row))
            log.info("Host %s: adopted agent %d of job %s.", self.host_id, pid, agent.job_id)


def _signal_agent(wrapper_pid: int, sig: int, tree: bool = False) -> None:
    """Signal the agent under its wrapper ``wrapper_pid`` (efdl.fleet.wrap; an older daemon's
    shell alike), or the wrapper while it has no child yet (it passes the signal on); with
    ``tree``: the wrapper, the agent and its workers."""
    with contextlib.suppress(psutil.Error):
        wrapper = psutil.Process(wrapper_pid)
        targets = (
            [wrapper, *wrapper.children(recursive=True)]
            if tree
            else wrapper.children() or [wrapper]
        )
        for p in targets:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
