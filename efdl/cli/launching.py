"""The launch around efdl-run's node agent: an embedded (--standalone) or served
(--serve-etcd) etcd, the job's start, the agent, and what an unnamed standalone run leaves."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from efdl import __version__, logs
from efdl._process import TEMP_PREFIX, sweep_private_dirs
from efdl.cli.common import log, store_for
from efdl.config import DEFAULT_JOB_ID, LaunchConfig
from efdl.errors import ConfigError, EfdlError
from efdl.launcher.agent import NodeAgent
from efdl.launcher.gpus import cuda_ids, discover, select
from efdl.launcher.node import cpu_count, default_host, gpu_infos, local_node, resolve_slots
from efdl.launcher.warm import warm_pool
from efdl.rendezvous.api import EtcdSettings, EventType
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lifecycle import start_job
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import JobKeys, check_id
from efdl.rendezvous.served import (
    ServedEtcd,
    default_state_dir,
    make_job_directory,
    refusal,
    resolve,
)

# An unnamed standalone run's job id: a run of its own, which no later run can resume.
FRESH_PREFIX = "standalone-"
_FRESH = re.compile(rf"^{FRESH_PREFIX}[0-9a-f]{{12}}$")


def launch(cfg: LaunchConfig, args: list[str]) -> int:
    """Run the node agent for ``cfg``; with --standalone, around an embedded etcd."""
    logs.context.set(job=cfg.job_id or "", node=cfg.node_id or "")
    for path in sweep_private_dirs():
        log.debug("Removed %s, the private directory of an efdl process that is gone.", path)
    gpus = select(discover(), os.environ.get("CUDA_VISIBLE_DEVICES"), cfg.gpus)
    slots, _ = resolve_slots(cfg.nproc_per_node, gpu_infos(gpus))
    warm = warm_pool(
        cfg.warm_workers, args, slots, bool(gpus), cpu_count()
    )  # importing while etcd starts
    try:
        job_id = check_id(cfg.job_id or DEFAULT_JOB_ID)
        # A node started while etcd is away waits for it as long as the job may wait for
        # its members, saying so (it joins once etcd is back).
        wait_s = max(2 * cfg.etcd_timeout_s, cfg.join_timeout_s)
        settings = None if cfg.standalone else cfg.etcd_settings(connect_timeout_s=wait_s)
        host = cfg.host or (default_host(settings.endpoints) if settings else "127.0.0.1")
        node = local_node(cfg.node_id, host, cfg.store_port, cfg.nproc_per_node, gpus)
        node = dataclasses.replace(node, fence_s=cfg.fence_s())  # efdl.worker.fence
        policy = _policy(cfg, node.slots)
        logs.context.set(node=node.node_id)
        with (
            _served_etcd(cfg, settings) as served,
            store_for(cfg, cfg.standalone, settings) as (
                store,
                _,
            ),
        ):
            start_job(store, job_id, cfg.new_run, timeout_s=cfg.join_timeout_s)
            log.info(
                "efdl %s: job %s on %s: %d-%d workers; this node %s offers %d.",
                __version__,
                job_id,
                store.description,
                policy.min_workers,
                policy.max_workers,
                node.node_id,
                node.slots,
            )
            ids = cuda_ids(gpus[: len(node.gpus)], os.environ.get("CUDA_DEVICE_ORDER"))
            code = NodeAgent(cfg, args, store, node, policy, job_id, ids, warm).run()
            if served:
                _await_departures(store, job_id, cfg.lease_ttl_s + cfg.grace_period_s + 5)
                served.job_ended = _job_ended(store, job_id)
            return code
    finally:
        warm.close()  # the agent's run closes it; this is for a start that failed before
        if cfg.standalone and _FRESH.match(cfg.job_id or ""):
            _remove_run_files(cfg.job_id or "", Path(tempfile.gettempdir()))


def _remove_run_files(job_id: str, temp: Path) -> None:
    """An unnamed standalone run ends: what its script left in the temp directory under a
    name holding its id (a checkpoint for its restarts: digits-<id>.pt) serves no later run,
    which has an id of its own (as torchrun's --standalone): removed, saying so."""
    try:
        left = [
            p for p in temp.iterdir() if job_id in p.name and not p.name.startswith(TEMP_PREFIX)
        ]
    except OSError:
        return
    for path in left:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            log.warning("Could not remove %s (%s).", path, exc.strerror or exc)
            continue
        log.info(
            "Removed %s: named after this run (%s), which no later run resumes (give --job-id "
            "to resume a run).",
            path,
            job_id,
        )


@contextmanager
def _served_etcd(cfg: LaunchConfig, settings: EtcdSettings | None) -> Iterator[ServedEtcd | None]:
    """With --serve-etcd, the job's etcd, embedded, on the first endpoint (its address
    resolved: etcd listens on an IP), with auth on if a job token is given (refused on an
    address other hosts reach without one), its data in the job's directory under
    --state-dir; stopped on the way out, its data removed if the job ended."""
    if not cfg.serve_etcd or settings is None:
        yield None
        return
    at = settings.endpoints[0]
    token = cfg.job_token()
    addresses = resolve(at.host, at.port)
    refused = refusal(at.target, addresses, token is not None, serving=True)
    if refused:
        raise ConfigError(refused)
    if not addresses:
        raise ConfigError(
            f"Cannot serve the job's etcd at {at.target}: {at.host!r} does not resolve."
        )
    state = cfg.state_dir or default_state_dir(os.environ)
    job_id = check_id(cfg.job_id or DEFAULT_JOB_ID)
    served = ServedEtcd(at, addresses[0], make_job_directory(state, job_id, at.port), token)
    served.start()
    try:
        yield served
    finally:
        served.stop()


def _job_ended(store: EtcdStore, job_id: str) -> bool:
    """Whether job ``job_id``'s round says it ended (finished, stopped, failed); False if
    etcd cannot say."""
    keys = JobKeys(job_id)
    try:
        r = parse_round(store.get(keys.round), keys)
    except EfdlError:
        return False
    return r is not None and r.status.final


def _await_departures(store: EtcdStore, job_id: str, timeout_s: float) -> None:
    """This node serves the job's etcd and is done: wait (up to ``timeout_s``) for the other
    nodes to read how the job ended and leave (their records go), for they need etcd until
    then. Watched, not polled."""
    keys = JobKeys(job_id)
    deadline = time.monotonic() + timeout_s
    try:
        snap = store.get_prefix(keys.nodes)
        left = {kv.key for kv in snap.kvs}
        if not left:
            return
        log.info(
            "Waiting up to %.0f s for the job's %d other node(s) to leave before stopping the "
            "etcd this node serves.",
            timeout_s,
            len(left),
        )
        with store.watch(keys.nodes, prefix=True, start_revision=snap.revision + 1) as watch:
            while left and (remaining := deadline - time.monotonic()) > 0:
                batch = watch.get(timeout_s=remaining)
                if batch is None:
                    continue
                if batch.reset:
                    left.clear()
                for ev in batch.events:
                    (left.add if ev.type is EventType.PUT else left.discard)(ev.kv.key)
    except EfdlError:
        return  # etcd is going with this node anyway
    if left:
        log.warning(
            "The job's other nodes did not leave within %.0f s; stopping its etcd.", timeout_s
        )


def _policy(cfg: LaunchConfig, slots: int) -> Policy:
    if cfg.min_workers is None and cfg.max_workers is None:
        if cfg.nnodes:
            lo, hi = cfg.node_range()
            low, high = lo * slots, hi * slots
        else:
            low = high = slots  # torchrun's default: this node alone
    else:
        low = cfg.min_workers or 1
        high = cfg.max_workers or 1_000_000
    return Policy(low, high, cfg.settle_s, cfg.join_timeout_s)
