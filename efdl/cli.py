"""Command-line entry points: ``efdl`` (tools) and ``efdl-run`` (the node agent).

Only this module configures logging handlers and turns :class:`~efdl.errors.EfdlError`
into a one-line message and a non-zero exit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from efdl import __version__, logs
from efdl._process import skip_final_gc, sweep_private_dirs
from efdl.config import DEFAULT_JOB_ID, EtcdClientConfig, LaunchConfig, load, read_yaml
from efdl.errors import ConfigError, EfdlError
from efdl.history import follow_events, format_event, read_events, stood_still
from efdl.kubeflow import pet_params
from efdl.launcher.agent import NodeAgent, warm_pool
from efdl.launcher.gpus import cuda_ids, discover, select
from efdl.launcher.node import cpu_count, default_host, gpu_infos, local_node, resolve_slots
from efdl.rendezvous.api import Compare, Endpoint, EtcdSettings, EventType, Put
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.model import Event, JobKeys, NodeRecord, RoundStatus, check_id
from efdl.rendezvous.participant import Participant, close_job, parse_round, start_job
from efdl.rendezvous.served import (
    ServedEtcd,
    default_state_dir,
    make_job_directory,
    refusal,
    resolve,
)
from efdl.rendezvous.status import format_status, read_status, status_json

if TYPE_CHECKING:  # the fleet's modules are imported by its commands alone
    from efdl.fleet.allocate import Policy as FleetPolicy

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("efdl")


def setup_logging(verbose: bool, fmt: str = "text") -> None:
    logs.setup(verbose, fmt)


def etcd_options(fn: F) -> F:
    """The etcd client flags, shared by every command that talks to etcd."""
    options = [
        click.option("--etcd", help="etcd endpoints, host:port[,host:port...] (env EFDL_ETCD)."),
        click.option("--etcd-ca", type=click.Path(path_type=Path), help="CA file (turns on TLS)."),
        click.option("--etcd-cert", type=click.Path(path_type=Path), help="Client certificate."),
        click.option("--etcd-key", type=click.Path(path_type=Path), help="Client certificate key."),
        click.option("--etcd-user", help="etcd user; the password comes from EFDL_ETCD_PASSWORD."),
        click.option(
            "--etcd-password-file",
            type=click.Path(path_type=Path),
            help="File holding the etcd password (instead of EFDL_ETCD_PASSWORD).",
        ),
        click.option(
            "--etcd-timeout",
            "etcd_timeout_s",
            type=float,
            help="Seconds each etcd request may take, failover included (default 5).",
        ),
        click.option(
            "--job-token-file",
            type=click.Path(path_type=Path),
            help="File holding the job's token (instead of EFDL_JOB_TOKEN): the secret of the "
            "etcd a node of the job serves (static launch, --serve-etcd).",
        ),
        click.option(
            "--config",
            "config_file",
            type=click.Path(path_type=Path),
            help="YAML file of options (flags > EFDL_* env > this file > defaults).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def handle_errors(fn: F) -> F:
    """Turn an EfdlError into ``efdl: <sentence>`` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EfdlError as exc:
            click.echo(f"efdl: error: {exc}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


def _etcd_config(config_file: Path | None, flags: dict[str, Any]) -> EtcdClientConfig:
    data = read_yaml(config_file) if config_file else {}
    known = {
        k: v
        for k, v in data.items()
        if str(k).replace("-", "_").startswith("etcd")
        or str(k) in ("job-token-file", "job_token_file")
    }
    source = str(config_file) if config_file else "the config file"
    return load(EtcdClientConfig, flags, yaml_data=known, yaml_source=source)


def _job_config(
    job_id: str | None, config_file: Path | None, flags: dict[str, Any]
) -> tuple[str, EtcdClientConfig]:
    """The job a command is about (--job-id > EFDL_JOB_ID > ``job-id`` in the --config file,
    as for efdl-run) and how to reach its etcd."""
    data = read_yaml(config_file) if config_file else {}
    from_yaml = next((v for k, v in data.items() if str(k).replace("-", "_") == "job_id"), None)
    chosen = job_id or os.environ.get("EFDL_JOB_ID") or from_yaml
    if not chosen:
        raise ConfigError(
            "No job was named: give --job-id (or set EFDL_JOB_ID, or job-id in the --config file)."
        )
    return check_id(str(chosen)), _etcd_config(config_file, flags)


@contextmanager
def _store_for(
    cfg: EtcdClientConfig, standalone: bool, settings: EtcdSettings | None = None
) -> Iterator[tuple[EtcdStore, EmbeddedEtcd | None]]:
    """A client of ``cfg``'s etcd (``settings`` if resolved already), or with ``standalone``
    of an embedded etcd started here; stopped, with the client closed, on the way out."""
    server = EmbeddedEtcd().start() if standalone else None
    try:
        if server is not None:  # its own etcd: no credentials (a job token is for another)
            timeout_s = cfg.etcd_timeout_s
            settings = server.settings(request_timeout_s=timeout_s, connect_timeout_s=2 * timeout_s)
        store = EtcdStore(settings or cfg.etcd_settings())
        try:
            yield store, server
        finally:
            store.close()
    finally:
        if server:
            server.stop()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="efdl")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """efdl: elastic, fault-tolerant PyTorch training on etcd v3."""
    setup_logging(verbose)


@main.command()
@etcd_options
@click.option("--standalone", is_flag=True, help="Start an embedded etcd and check against it.")
@handle_errors
def check(standalone: bool, config_file: Path | None, **flags: Any) -> None:
    """Check that etcd works for efdl: connect, lease, CAS, watch; print each latency."""
    cfg = _etcd_config(config_file, flags)
    if not log.isEnabledFor(logging.DEBUG):  # the table is the answer; -v shows the steps
        log.setLevel(logging.WARNING)
    rows: list[tuple[str, float]] = []

    def timed(what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        rows.append((what, (time.perf_counter() - t0) * 1000))
        return result

    t_start = time.perf_counter()
    with _store_for(cfg, standalone) as (store, server):
        if server:
            rows.append(("start embedded etcd", (time.perf_counter() - t_start) * 1000))
        key = f"/efdl/_check/{uuid.uuid4().hex}"
        session = timed("grant lease (TTL 5 s)", lambda: LeaseSession(store, ttl_s=5))
        try:
            snap = store.get_prefix(key)
            watch = timed("open watch", lambda: store.watch(key, start_revision=snap.revision + 1))
            with watch:
                created = timed(
                    "create key (CAS on absence)",
                    lambda: store.txn([Compare.absent(key)], [Put(key, b"1", session.lease_id)]),
                )
                batch = timed("see it through the watch", lambda: watch.get(timeout_s=5))
                if not created.succeeded or batch is None or batch.events[0].type != EventType.PUT:
                    raise EfdlError(
                        f"{store.description} did not show our own write through a watch."
                    )
                conflict = timed(
                    "CAS with a stale revision (must fail)",
                    lambda: store.txn([Compare.mod_revision_is(key, 1)], [Put(key, b"2")]),
                )
                if conflict.succeeded:
                    raise EfdlError(f"{store.description} accepted a stale compare-and-swap.")
            timed("refresh lease", lambda: store.refresh_lease(session.lease_id))
        finally:
            timed("revoke lease", lambda: session.close(revoke=True))
        gone = store.get(key) is None
        timed("rendezvous: 2 agents form a round", lambda: _rendezvous_smoke(store))
        click.echo(f"efdl {__version__}: {store.description} works for efdl.")
        for what, ms in rows:
            click.echo(f"  {what:<40} {ms:8.1f} ms")
        click.echo(f"  {'key removed with its lease':<40} {'yes' if gone else 'NO'}")
        if not gone:
            raise EfdlError(f"{store.description} kept a key after its lease was revoked.")


def _rendezvous_smoke(store: EtcdStore) -> None:
    """Two agents, each on its own connection, join a throwaway job and agree on a round."""
    job = f"check-{uuid.uuid4().hex[:12]}"
    policy = Policy(min_workers=2, max_workers=2, settle_s=0)
    participants = []
    stores = [EtcdStore(store.settings) for _ in range(2)]
    try:
        for i, s in enumerate(stores):
            record = NodeRecord(f"check{i}", "127.0.0.1", 29500 + i, slots=1, version=__version__)
            participant = Participant(s, job, record, policy, lease_ttl_s=5)
            participant.join()
            participants.append(participant)
        deadline = time.monotonic() + 10
        generations = set()
        for a in participants:
            r = a.next_round(after=0, timeout_s=10)
            while r is not None and r.status is not RoundStatus.ACTIVE:
                # The first agent alone is below --min: a waiting round comes first.
                r = a.next_round(after=r.generation, timeout_s=deadline - time.monotonic())
            if r is None or r.world_size != 2:
                raise EfdlError(
                    f"Two agents on {store.description} did not agree on a round in 10 s."
                )
            generations.add(r.generation)
        if len(generations) != 1:
            raise EfdlError(f"Two agents on {store.description} saw different rounds.")
    finally:
        for a in participants:
            a.leave()
        for s in stores:
            s.close()
        store.delete(JobKeys(job).prefix, prefix=True)


def _job_option(fn: F) -> F:
    return click.option(
        "--job-id", help="The job (its keys: /efdl/<job-id>/); or EFDL_JOB_ID, or --config's."
    )(fn)


@main.command()
@etcd_options
@_job_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def status(job_id: str | None, as_json: bool, config_file: Path | None, **flags: Any) -> None:
    """Show a job: generation, leader, members with GPUs and ranks, spares, last rescale."""
    job_id, cfg = _job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        st = read_status(store, job_id)
        events, _ = read_events(store, job_id)
    if as_json:
        click.echo(status_json(st))
        return
    click.echo(format_status(st))
    if events:
        trained, still = stood_still(events, time.time())
        click.echo(
            f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(events[0].time))}: "
            f"trained {trained:.0f} s, stood still {still:.1f} s (the pauses of rescales and "
            "restarts, and waiting below --min)"
        )
        click.echo("last events (efdl events --job-id ... for all):")
        for e in events[-5:]:
            click.echo(f"  {format_event(e)}")


def _since(text: str | None) -> float:
    """--since: a duration back from now (90s, 10m, 2h, 1d) or a local time
    (2026-11-24 08:00[:00])."""
    if not text:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(text[:-1]) * units[text[-1]]
    for form in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"):
        try:
            return time.mktime(time.strptime(text, form))
        except ValueError:
            continue
    raise ConfigError(
        f"--since {text!r} is neither a duration (90s, 10m, 2h, 1d) nor a time (2026-11-24 08:00)."
    )


@main.command()
@etcd_options
@_job_option
@click.option("--since", help="Only events since: a duration (10m, 2h) or a time.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (Ctrl-C ends).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@handle_errors
def events(
    job_id: str | None,
    since: str | None,
    follow: bool,
    as_json: bool,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Print a job's history: rounds, joins, leaves, crashes, evictions, persists..."""
    job_id, cfg = _job_config(job_id, config_file, flags)
    start = _since(since)

    def show(e: Event) -> None:
        click.echo(e.to_json().decode() if as_json else format_event(e))

    with EtcdStore(cfg.etcd_settings()) as store:
        found, revision = read_events(store, job_id, since=start)
        for e in found:
            show(e)
        if not follow:
            if not found and not as_json:
                click.echo(f"job {job_id}: no events{' since ' + since if since else ''}.")
            return
        try:
            for e in follow_events(store, job_id, revision):
                show(e)
        except KeyboardInterrupt:
            return


@main.command()
@etcd_options
@_job_option
@click.option("--reason", default="stopped by efdl stop", help="Shown in the agents' logs.")
@handle_errors
def stop(job_id: str | None, reason: str, config_file: Path | None, **flags: Any) -> None:
    """End a job cleanly: every agent stops its workers and exits 0."""
    job_id, cfg = _job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        r = close_job(store, job_id, reason)
    click.echo(f"job {job_id}: generation {r.generation} is {r.status.value} ({r.reason}).")


@main.command()
@etcd_options
@_job_option
@click.option("--fleet", help="Draw this fleet instead of one job: which job held which GPU when.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="The PNG file to write (default: <job>-timeline.png or <fleet>-fleet.png here).",
)
@click.option("--since", help="Only events since: a duration (10m, 2h) or a time.")
@handle_errors
def timeline(
    job_id: str | None,
    fleet: str | None,
    out: Path | None,
    since: str | None,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Draw a job's world size over time, its events marked, its stood-still time shaded;
    or, with --fleet, which job held which GPU when."""
    from efdl.timeline import draw, draw_fleet  # matplotlib: an optional extra

    start = _since(since)
    if fleet is not None:
        from efdl.fleet.commands import fleet_keys
        from efdl.fleet.history import holdings
        from efdl.fleet.registry import read_events as read_fleet_events

        if job_id is not None:
            raise ConfigError("--fleet and --job-id draw different things; give one of them.")
        keys = fleet_keys(fleet)
        with EtcdStore(_etcd_config(config_file, flags).etcd_settings()) as store:
            events, _ = read_fleet_events(store, keys, since=start or None)
        held = holdings(events, time.time())
        out = out or Path(f"{keys.fleet}-fleet.png")
        draw_fleet(held, out, f"fleet {keys.fleet}")
        click.echo(f"fleet {keys.fleet}: {len(held)} stretches on GPUs drawn to {out}.")
        return
    job_id, cfg = _job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        found, _ = read_events(store, job_id, since=start)
    out = out or Path(f"{job_id}-timeline.png")
    draw(found, out, f"job {job_id}")
    click.echo(f"job {job_id}: {len(found)} events drawn to {out}.")


def _fleet_policy(resize_interval: float, history_days: float) -> FleetPolicy:
    """The allocator's settings from --resize-interval and --history-days
    (efdl.fleet.allocate.Policy)."""
    from efdl.fleet.allocate import Policy as FleetPolicy

    if resize_interval < 0:
        raise ConfigError(
            f"--resize-interval {resize_interval} is negative; expected seconds >= 0."
        )
    if not history_days > 0:
        raise ConfigError(f"--history-days {history_days} is not a number of days > 0.")
    return FleetPolicy(resize_interval, history_s=history_days * 86400)


_history_option = click.option(
    "--history-days",
    type=float,
    default=7.0,
    show_default=True,
    help="Days the fleet's events are kept (efdl jobs --history, efdl timeline --fleet).",
)


def _stop_on_sigterm() -> threading.Event:
    """An event that SIGTERM sets: a daemon's graceful end."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def _fleet_option(fn: F) -> F:
    return click.option(
        "--fleet",
        help="The fleet (its keys: /efdl-fleet/<fleet>/); or EFDL_FLEET; default 'default'.",
    )(fn)


@main.command(context_settings={"ignore_unknown_options": True})
@etcd_options
@_fleet_option
@click.option("--job-id", required=True, help="The job's id (its keys: /efdl/<job-id>/).")
@click.option("--min", "min_workers", type=int, required=True, help="Fewest workers to train with.")
@click.option("--max", "max_workers", type=int, help="Most workers (default: --min).")
@click.option(
    "--priority", type=int, default=0, show_default=True, help="-1000..1000; higher first."
)
@click.option("--cache-url", help="The remote cache; a job without one is never suspended.")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    help="Directory holding the code on every host (default: this one).",
)
@click.option("--env", multiple=True, help="NAME=VALUE for the workers (repeatable).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@handle_errors
def submit(
    fleet: str | None,
    job_id: str,
    min_workers: int,
    max_workers: int | None,
    priority: int,
    cache_url: str | None,
    workdir: Path | None,
    env: tuple[str, ...],
    command: tuple[str, ...],
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Put a job into the fleet: efdl submit --job-id X --min 2 --max 8 -- train.py ARGS."""
    from efdl.fleet.commands import fleet_keys, spec_from_flags
    from efdl.fleet.registry import submit as submit_job

    keys = fleet_keys(fleet)
    spec = spec_from_flags(
        check_id(job_id), command, workdir, min_workers, max_workers, priority, cache_url, env
    )
    cfg = _etcd_config(config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        submit_job(store, keys, spec)
    click.echo(
        f"job {spec.job_id}: queued in fleet {keys.fleet} ({spec.min_workers}-"
        f"{spec.max_workers} workers, priority {spec.priority}); see efdl jobs."
    )


@main.command()
@etcd_options
@_fleet_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--history", is_flag=True, help="Each job's GPUs over time (every status change) instead."
)
@click.option("--job-id", help="With --history: only this job.")
@click.option("--since", help="With --history: only since a duration (10m, 2h) or a time.")
@handle_errors
def jobs(
    fleet: str | None,
    as_json: bool,
    history: bool,
    job_id: str | None,
    since: str | None,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Show the fleet's jobs (priority, phase, GPUs, where or why) and hosts."""
    from efdl.fleet.commands import fleet_keys, format_jobs, jobs_json
    from efdl.fleet.history import format_history
    from efdl.fleet.registry import read_events as read_fleet_events
    from efdl.fleet.registry import read_fleet

    if not history and (job_id is not None or since is not None):
        raise ConfigError("--job-id and --since go with --history.")
    keys = fleet_keys(fleet)
    cfg = _etcd_config(config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        if history:
            events, problems = read_fleet_events(store, keys, since=_since(since) or None)
            click.echo(format_history(events, job_id))
            for p in problems:
                click.echo(f"bad record skipped: {p}")
            return
        view = read_fleet(store, keys)
    click.echo(jobs_json(view) if as_json else format_jobs(view, time.time()))


@main.command()
@etcd_options
@_fleet_option
@click.argument("job_id")
@click.option("--reason", default="cancelled by efdl cancel", help="Recorded with the job.")
@handle_errors
def cancel(
    fleet: str | None, job_id: str, reason: str, config_file: Path | None, **flags: Any
) -> None:
    """Cancel a fleet job: its hosts stop its agents (a graceful leave)."""
    from efdl.fleet.commands import fleet_keys
    from efdl.fleet.registry import cancel as cancel_job

    keys = fleet_keys(fleet)
    cfg = _etcd_config(config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        st = cancel_job(store, keys, check_id(job_id), reason)
    click.echo(f"job {job_id}: {st.phase.value} ({st.reason}).")


@main.command()
@etcd_options
@_fleet_option
@click.option("--id", "candidate_id", help="This candidate's id (default: host name + suffix).")
@click.option(
    "--resize-interval",
    type=float,
    default=60.0,
    show_default=True,
    help="Least seconds between two resizes of one job.",
)
@_history_option
@click.option(
    "--lease-ttl",
    "lease_ttl_s",
    type=int,
    default=10,
    show_default=True,
    help="Seconds until a dead allocator is replaced.",
)
@handle_errors
def allocator(
    fleet: str | None,
    candidate_id: str | None,
    resize_interval: float,
    history_days: float,
    lease_ttl_s: int,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Stand for the fleet's allocator and allocate while leading (until SIGTERM/Ctrl-C)."""
    import contextlib
    import socket

    from efdl.fleet.commands import fleet_keys
    from efdl.fleet.leader import Allocator

    policy = _fleet_policy(resize_interval, history_days)
    keys = fleet_keys(fleet)
    host = socket.gethostname().split(".")[0] or "allocator"
    name = check_id(candidate_id or f"{host}-{uuid.uuid4().hex[:6]}", "candidate id")
    cfg = _etcd_config(config_file, flags)
    stop = _stop_on_sigterm()
    with (
        EtcdStore(cfg.etcd_settings()) as store,
        LeaseSession(store, lease_ttl_s, on_expired=lambda why: stop.set()) as session,
    ):
        click.echo(f"allocator {name}: standing for fleet {keys.fleet}.", err=True)
        with contextlib.suppress(KeyboardInterrupt):
            Allocator(store, keys, name, session.lease_id, policy).run(stop)
    if session.expired:
        raise EfdlError(f"allocator {name}: its lease ended ({session.why_expired}); exiting.")


@main.command()
@etcd_options
@_fleet_option
@click.option("--host-id", help="This host's id in the fleet (default: its host name).")
@click.option(
    "--host", "address", help="The address peers reach this host at (default: the route to etcd)."
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    help="Where the daemon keeps its agents' PIDs and logs (default: /var/lib/efdl-node/<fleet>).",
)
@click.option(
    "--lease-ttl",
    "lease_ttl_s",
    type=int,
    default=10,
    show_default=True,
    help="Seconds until a host whose daemon is away is given up.",
)
@click.option(
    "--resize-interval",
    type=float,
    default=60.0,
    show_default=True,
    help="Least seconds between two resizes of one job (when this host allocates).",
)
@_history_option
@click.option("--no-allocator", is_flag=True, help="Never stand for the fleet's allocator.")
@click.option(
    "--job-uids",
    envvar="EFDL_JOB_UIDS",
    help="FIRST-LAST: run each job as a uid of its own from this range (needs root); "
    "'shared': as this daemon's user. Required when the daemon runs as root.",
)
@click.option(
    "--job-etcd-cert",
    type=click.Path(path_type=Path),
    help="Client certificate the jobs' agents present to etcd (never the daemon's own).",
)
@click.option("--job-etcd-key", type=click.Path(path_type=Path), help="Its key.")
@handle_errors
def node(
    fleet: str | None,
    host_id: str | None,
    address: str | None,
    state_dir: Path | None,
    lease_ttl_s: int,
    resize_interval: float,
    history_days: float,
    no_allocator: bool,
    job_uids: str | None,
    job_etcd_cert: Path | None,
    job_etcd_key: Path | None,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Run this GPU host in a fleet: register its GPUs, run the agents placed on it."""
    import socket

    from efdl.fleet.commands import fleet_keys
    from efdl.fleet.etcd_users import EtcdUsers
    from efdl.fleet.node import HostDaemon
    from efdl.fleet.spawn import isolation_from_flags

    policy = _fleet_policy(resize_interval, history_days)
    keys = fleet_keys(fleet)
    name = check_id(host_id or socket.gethostname(), "host id")
    cfg = _etcd_config(config_file, flags)
    settings = cfg.etcd_settings()
    isolation = isolation_from_flags(job_uids, job_etcd_cert, job_etcd_key, cfg, settings)
    stop = _stop_on_sigterm()
    state = state_dir or Path("/var/lib/efdl-node") / keys.fleet
    users = EtcdUsers(settings)  # its agents' etcd users, where etcd has auth on
    with users as store:
        daemon = HostDaemon(
            store,
            keys,
            name,
            address or default_host(settings.endpoints),
            settings.endpoint_list,
            state,
            lease_ttl_s=lease_ttl_s,
            allocator=not no_allocator,
            policy=policy,
            isolation=isolation,
            users=users,
        )
        click.echo(f"efdl node {name}: in fleet {keys.fleet} (state in {state}).", err=True)
        try:
            daemon.run(stop)
        except KeyboardInterrupt:
            stop.set()


_RDZV_ETCD = ("etcd", "etcd-v2", "etcd-v3", "efdl")
_RDZV_STORE = ("c10d", "static")  # torchrun's rendezvous on a node's TCPStore
_IGNORED = {
    "monitor_interval": "workers are watched without polling",
    "start_method": "workers are started with exec",
    "run_path": "each worker runs SCRIPT as `python SCRIPT` in a process of its own, as "
    "--run-path's runpy.run_path does",
    "logs_specs": "worker output goes where --log-dir, --redirects, --tee and "
    "--local-ranks-filter say; LogsSpecs plugins are not loaded",
    "numa_binding": "workers are not bound to NUMA nodes (bind them with --no-python numactl "
    "... or in the script)",
    "event_log_handler": "efdl's events go to etcd: `efdl events JOB` lists them",
}


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="efdl-run")
@etcd_options
@click.option("--standalone", is_flag=True, default=None, help="Embedded etcd, this node only.")
@click.option("--job-id", "--rdzv-id", "--rdzv_id", "job_id", help="The job's id.")
@click.option("--min", "min_workers", type=int, help="Fewest workers to train with.")
@click.option("--max", "max_workers", type=int, help="Most workers; more nodes wait as spares.")
@click.option("--nnodes", help="torchrun's MIN:MAX nodes (times --nproc-per-node workers).")
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    help="Workers here: N, gpu, cpu or auto (default: one per GPU, else 1).",
)
@click.option(
    "--gpus",
    help="GPUs for the job: all (default: those visible), free (no compute process on them), "
    "or indices/UUIDs such as 2,5.",
)
@click.option("--node-id", help="This node's id in the job (default: host name + suffix).")
@click.option(
    "--host",
    "--local-addr",
    "--local_addr",
    "host",
    help="Address peers use to reach this node; the store binds to it.",
)
@click.option(
    "--store-port",
    "store_port",
    type=int,
    help="Fixed port for the c10d store (default: any free port).",
)
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    help="torchrun's static rendezvous (--nnodes > 1, no etcd): the address where the node "
    "of --node-rank 0 serves the job's etcd (default 127.0.0.1).",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=int,
    help="Its port (default 29500); on one node, the c10d store's port.",
)
@click.option(
    "--node-rank",
    "--node_rank",
    "node_rank",
    type=int,
    help="torchrun's static launch: 0 serves the rendezvous (ranks come from it).",
)
@click.option(
    "--serve-etcd",
    is_flag=True,
    default=None,
    help="Serve the job's etcd here (embedded, on --etcd's first endpoint, an address of "
    "this host); the job lives as long as this node does.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    help="Where the etcd this node serves keeps its data, kept for a restart of this node "
    "(default: $XDG_STATE_HOME/efdl, else ~/.local/state/efdl).",
)
@click.option("--lease-ttl", "lease_ttl_s", type=int, help="Seconds until a dead node is noticed.")
@click.option("--settle", "settle_s", type=float, help="Seconds to batch joins into one round.")
@click.option(
    "--join-timeout",
    "join_timeout_s",
    type=float,
    help="Seconds the job may wait below --min before it fails.",
)
@click.option(
    "--max-restarts",
    "--max_restarts",
    "max_restarts",
    type=int,
    help="Restarts of failed workers on this node before it gives up (a failure that repeats "
    "the last one's error with no step trained between is not restarted).",
)
@click.option(
    "--warm-workers",
    "warm_workers",
    type=int,
    help="Worker processes kept started ahead of need, torch imported (default: one per "
    "worker slot on a GPU node or one with 4+ cores per slot, else none; 0: none). About "
    "300 MB of host memory each.",
)
@click.option(
    "--grace-period",
    "--shutdown-timeout",
    "--shutdown_timeout",
    "grace_period_s",
    type=float,
    help="Seconds from SIGTERM to SIGKILL for workers and for leaving.",
)
@click.option(
    "--hang-timeout",
    "hang_timeout_s",
    type=float,
    help="Seconds an in-place worker may make no step while a peer waits on it before it is "
    "replaced (default: 90% of the collective timeout, at least 5 of the longest steps).",
)
@click.option(
    "--fence-timeout",
    "fence_timeout_s",
    type=float,
    help="Seconds this node's workers train on while their agent cannot reach etcd; then "
    "they stop committing, state in memory, until it can (default: 90, at least 3 lease "
    "TTLs). A generation cut off from etcd whole is replaced this long after its lease went.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    help="text (default) or json: one object per line with time, job, node, generation, rank.",
)
@click.option(
    "--metrics-port",
    type=int,
    help="Serve Prometheus metrics on --host at this port (default: off; 0: any free port).",
)
@click.option(
    "--log-dir",
    "--log_dir",
    "log_dir",
    type=click.Path(path_type=Path),
    help="Keep per-rank log files here.",
)
@click.option(
    "--tee",
    "-t",
    "tee",
    help="Show these streams on the console, each line labelled [rankN]:, also where they "
    "are redirected: 1 stdout, 2 stderr, 3 both, or per local rank (0:1,1:2).",
)
@click.option(
    "--redirects",
    "-r",
    "redirects",
    help="Send these streams to the --log-dir files only: 1 stdout, 2 stderr, 3 both, or "
    "per local rank (0:1,1:2).",
)
@click.option(
    "--local-ranks-filter",
    "--local_ranks_filter",
    "local_ranks_filter",
    help="Show only these local ranks' output on the console (e.g. 0 or 0,1).",
)
@click.option(
    "--rank-prefix",
    is_flag=True,
    default=None,
    help="Label each worker line on the console with its rank, [rankN]: (default: lines as "
    "the worker printed them, as torchrun shows them).",
)
@click.option(
    "--duplicate-stdout-filters",
    "--duplicate_stdout_filters",
    "duplicate_stdout_filters",
    help="Copy stdout lines containing any of these comma-separated strings to "
    "LOG_DIR/JOB/filtered_stdout.log (needs --log-dir).",
)
@click.option(
    "--duplicate-stderr-filters",
    "--duplicate_stderr_filters",
    "duplicate_stderr_filters",
    help="The same for stderr (LOG_DIR/JOB/filtered_stderr.log).",
)
@click.option(
    "--signals-to-handle",
    "--signals_to_handle",
    "signals_to_handle",
    help="Signals on which this node leaves the job gracefully (e.g. add SIGUSR1 for SLURM).",
)
@click.option(
    "--virtual-local-rank",
    "--virtual_local_rank",
    "virtual_local_rank",
    is_flag=True,
    default=None,
    help="Every worker sees LOCAL_RANK=0 and only its own GPU (as cuda:0).",
)
@click.option("--role", help="ROLE_NAME of the workers.")
@click.option(
    "--cache-url",
    help="Persist committed state here (directory or fsspec URL, e.g. s3://bucket/job).",
)
@click.option(
    "--cache-every-steps", type=int, help="Persist every N commits (default 0: not by count)."
)
@click.option(
    "--cache-every",
    "cache_every_s",
    type=float,
    help="Persist when this many seconds passed since the last (default 60; 0: not by time).",
)
@click.option("--cache-keep", type=int, help="Complete snapshots to keep (default 2).")
@click.option(
    "--new-run",
    is_flag=True,
    default=None,
    help="Start a new run of a job that finished, was stopped or failed (keeps its cache).",
)
@click.option("-m", "--module", "module", is_flag=True, help="Run SCRIPT as a module (python -m).")
@click.option(
    "--no-python",
    "--no_python",
    "no_python",
    is_flag=True,
    help="SCRIPT is an executable, not a Python file.",
)
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", hidden=True)
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", hidden=True)
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", hidden=True)
@click.option("--monitor-interval", "--monitor_interval", "monitor_interval", hidden=True)
@click.option("--start-method", "--start_method", "start_method", hidden=True)
@click.option("--run-path", "--run_path", "run_path", is_flag=True, default=None, hidden=True)
@click.option("--logs-specs", "--logs_specs", "logs_specs", hidden=True)
@click.option("--numa-binding", "--numa_binding", "numa_binding", hidden=True)
@click.option("--event-log-handler", "--event_log_handler", "event_log_handler", hidden=True)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@handle_errors
def run_main(
    script: str,
    script_args: tuple[str, ...],
    config_file: Path | None,
    module: bool,
    no_python: bool,
    verbose: bool,
    **flags: Any,
) -> None:
    """Run SCRIPT on this node as part of an elastic job (a drop-in for torchrun).

    \b
    efdl-run --etcd etcd-1:2379 --job-id resnet --min 2 --max 8 train.py --lr 0.1
    efdl-run --standalone --nproc-per-node 2 train.py
    """
    setup_logging(verbose)
    cfg = launch_config(flags, config_file, os.environ)
    if cfg.log_format != "text":
        setup_logging(verbose, cfg.log_format)
    args = _worker_command(script, script_args, module, no_python)
    code = launch(cfg, args)
    skip_final_gc()  # its workers are gone: so should it be, at once
    sys.exit(code)


def launch_config(
    flags: dict[str, Any], config_file: Path | None, env: Mapping[str, str]
) -> LaunchConfig:
    """efdl-run's options (as click parsed them, torchrun's spellings included) with its
    config file and environment, as one config; torchrun's options that efdl does not need
    are dropped with a line saying what it does instead."""
    params = pet_params(flags, env)
    rdzv_backend = params.pop("rdzv_backend")
    rdzv_endpoint = params.pop("rdzv_endpoint")
    rdzv_conf = params.pop("rdzv_conf")
    for name, why in _IGNORED.items():
        if params.pop(name, None) is not None:
            log.info("Ignoring --%s: %s.", name.replace("_", "-"), why)
    _rendezvous_flags(rdzv_backend, rdzv_endpoint, params)
    if rdzv_conf:
        _apply_rdzv_conf(rdzv_conf, params)
    data = read_yaml(config_file) if config_file else {}
    cfg = load(LaunchConfig, params, env=env, yaml_data=data, yaml_source=str(config_file or ""))
    if cfg.standalone and not params.get("standalone") and not data.get("standalone"):
        log.info("No etcd was given and the job is one node: running it standalone.")
    if cfg.standalone and not cfg.job_id:
        # As torchrun: a run of its own, which no other standalone run on this host shares
        # (a script's checkpoint named after TORCHELASTIC_RUN_ID is this run's alone).
        cfg = dataclasses.replace(cfg, job_id=f"standalone-{uuid.uuid4().hex[:12]}")
        log.info("Standalone run %s (a fresh id: give --job-id to resume a run later).", cfg.job_id)
    if cfg.job_id == DEFAULT_JOB_ID and not cfg.standalone:
        log.info(
            "No --job-id was given: the job is %r, torchrun's default run id (every job on "
            "this etcd without one is the same job).",
            DEFAULT_JOB_ID,
        )
    given = params.get("etcd") or env.get("EFDL_ETCD") or data.get("etcd")
    static = not cfg.standalone and cfg.etcd != given  # torchrun's static rendezvous
    for name in ("master_addr", "master_port", "node_rank"):
        if getattr(cfg, name) is not None and given:
            log.info(
                "Ignoring --%s: the rendezvous runs on the etcd given (--etcd), which ranks "
                "the nodes and tells them the store's address.",
                name.replace("_", "-"),
            )
    if static:
        log.info(
            "No etcd was given for a job of several nodes: as torchrun's static rendezvous, "
            "%s at %s (--master-addr:--master-port).",
            "this node serves the job's etcd" if cfg.serve_etcd else "the node of rank 0 serves it",
            cfg.etcd,
        )
        if not cfg.serve_etcd:  # the serving node checks where it listens, when it does
            at = Endpoint.parse(cfg.etcd or "")
            refused = refusal(
                at.target, resolve(at.host, at.port), cfg.job_token(env) is not None, False
            )
            if refused:
                raise ConfigError(refused)
    for stream in ("stdout", "stderr"):
        if cfg.log_dir is None and getattr(cfg, f"duplicate_{stream}_filters"):
            log.info(
                "Ignoring --duplicate-%s-filters: the copies go under --log-dir, and none is set.",
                stream,
            )
    return cfg


def _rendezvous_flags(backend: str | None, endpoint: str | None, params: dict[str, Any]) -> None:
    """torchrun's --rdzv-backend and --rdzv-endpoint, as efdl's flags (into ``params``).

    Every etcd backend's endpoint is an etcd's, which efdl speaks v3 to. ``c10d`` and
    ``static`` are torchrun's store-based rendezvous: with ``--etcd`` efdl's runs there;
    without, their endpoint is a node's address, not an etcd, and one node runs standalone.
    """
    if backend is None or backend in _RDZV_ETCD:
        if backend not in (None, "etcd-v3", "efdl"):
            log.info(
                "--rdzv-backend %s: efdl's rendezvous speaks etcd's v3 API to that etcd "
                "(etcd 3.6 has no v2 API).",
                backend,
            )
        if endpoint and not params.get("etcd"):
            params["etcd"] = endpoint
        return
    if backend in _RDZV_STORE:
        if params.get("etcd") or not endpoint:
            where = "the etcd at --etcd" if params.get("etcd") else "a static rendezvous"
            log.info("--rdzv-backend %s: efdl's rendezvous runs on %s.", backend, where)
            return
        # c10d's store is served by the node at the endpoint: efdl's etcd is, there.
        at = Endpoint.parse(endpoint if ":" in endpoint.strip("[]") else f"{endpoint}:29400")
        params["master_addr"] = params.get("master_addr") or at.host
        params["master_port"] = params.get("master_port") or at.port
        if params.get("node_rank") is None:
            params["node_rank"] = 0 if _can_serve(at.host, at.port) else 1
        log.info(
            "--rdzv-backend %s --rdzv-endpoint %s: the node that can listen there serves the "
            "job's etcd (%s).",
            backend,
            endpoint,
            "this one" if params["node_rank"] == 0 else "not this one",
        )
        return
    raise ConfigError(
        f"--rdzv-backend {backend!r} is not efdl's: efdl's rendezvous is etcd v3. Pass "
        "--etcd host:port (or --rdzv-backend etcd --rdzv-endpoint host:2379), or --standalone."
    )


def _apply_rdzv_conf(text: str, flags: dict[str, Any]) -> None:
    """torchrun's --rdzv-conf k=v,...: the keys that mean something here."""
    mapping = {
        "join_timeout": "join_timeout_s",
        "timeout": "join_timeout_s",
        "last_call_timeout": "settle_s",
        "lease_ttl": "lease_ttl_s",
    }
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--rdzv-conf item {item!r} is not key=value.")
        if key in mapping:
            if flags.get(mapping[key]) is None:  # an explicit efdl flag wins
                flags[mapping[key]] = value
        else:
            log.info("Ignoring --rdzv-conf %s: it has no meaning for efdl.", key)


def _worker_command(
    script: str, script_args: tuple[str, ...], module: bool, no_python: bool
) -> list[str]:
    if module:
        return [sys.executable, "-m", script, *script_args]
    if no_python:
        if not shutil.which(script):
            raise ConfigError(f"The program {script!r} (--no-python) was not found.")
        return [script, *script_args]
    if not Path(script).is_file():
        raise ConfigError(f"The training script {script!r} does not exist.")
    return [sys.executable, script, *script_args]


def launch(cfg: LaunchConfig, args: list[str]) -> int:
    """Run the node agent for ``cfg``; with --standalone, around an embedded etcd."""
    logs.context.set(job=cfg.job_id or "", node=cfg.node_id or "")
    for path in sweep_private_dirs():
        log.info("Removed %s, left by an efdl process that was killed.", path)
    gpus = select(discover(), os.environ.get("CUDA_VISIBLE_DEVICES"), cfg.gpus)
    slots, _ = resolve_slots(cfg.nproc_per_node, gpu_infos(gpus))
    warm = warm_pool(cfg, args, slots, bool(gpus), cpu_count())  # importing while etcd starts
    try:
        job_id = check_id(cfg.job_id or DEFAULT_JOB_ID)
        # A node started while etcd is away waits for it as long as the job may wait for
        # its members, saying so (it joins once etcd is back).
        wait_s = max(2 * cfg.etcd_timeout_s, cfg.join_timeout_s)
        settings = None if cfg.standalone else cfg.etcd_settings(connect_timeout_s=wait_s)
        host = cfg.host or (default_host(settings.endpoints) if settings else "127.0.0.1")
        node = local_node(cfg.node_id, host, cfg.store_port, cfg.nproc_per_node, gpus)
        node = dataclasses.replace(node, fence_s=cfg.fence_s())  # efdl.state.fence
        policy = _policy(cfg, node.slots)
        logs.context.set(node=node.node_id)
        with (
            _served_etcd(cfg, settings) as served,
            _store_for(cfg, cfg.standalone, settings) as (
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


def _can_serve(host: str, port: int) -> bool:
    """Whether this node can listen at host:port now (an address of its own, the port free):
    torchrun's c10d backend makes such a node the store's host."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(address)
    except OSError:
        return False
    return True


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


def _show_defaults(command: click.Command, *configs: type) -> None:
    """Add each option's default, from the config dataclasses where the layering keeps it
    (a flag's own default is None: not given), to its --help text."""
    defaults = {
        f.name: f.default
        for cls in configs
        for f in dataclasses.fields(cls)
        if f.default not in (None, False, "", dataclasses.MISSING)
    }
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in defaults:
            continue
        if param.help and "default" not in param.help:
            param.help = f"{param.help} [default: {defaults[param.name]}]"


_show_defaults(run_main, LaunchConfig, EtcdClientConfig)


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
