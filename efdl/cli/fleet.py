"""The fleet's commands: efdl submit, jobs, cancel, allocator, node, kube-controller
(docs/fleet.md, docs/kubernetes.md). The fleet's modules are imported by these commands
alone."""

from __future__ import annotations

import functools
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from efdl.errors import ConfigError, EfdlError
from efdl.launcher.node import default_host
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.records import check_id

if TYPE_CHECKING:  # the fleet's modules are imported by its commands alone
    from efdl.fleet.policy import FleetPolicy
from efdl.cli.common import (
    F,
    etcd_config,
    etcd_options,
    handle_errors,
    parse_since,
    stop_on_sigterm,
)


def _fleet_policy(
    resize_interval: float,
    history_days: float,
    resume_after: float,
    preempt_after: float,
    protect: float,
    priority_first: bool,
) -> FleetPolicy:
    """The allocator's settings from its flags (efdl.fleet.allocate.FleetPolicy)."""
    from efdl.fleet.policy import FleetPolicy

    for flag, value in (
        ("--resize-interval", resize_interval),
        ("--resume-after", resume_after),
        ("--preempt-after", preempt_after),
        ("--protect", protect),
    ):
        if not value >= 0:
            raise ConfigError(f"{flag} {value} is not a number of seconds >= 0.")
    if not history_days > 0:
        raise ConfigError(f"--history-days {history_days} is not a number of days > 0.")
    return FleetPolicy(
        resize_interval,
        history_s=history_days * 86400,
        resume_after_s=resume_after,
        preempt_after_s=preempt_after,
        protect_s=protect,
        priority_first=priority_first,
    )


_POLICY_FLAGS = ("history_days", "resume_after", "preempt_after", "protect", "priority_first")


def _policy_options(fn: F) -> F:
    """The allocator's flags besides --resize-interval (each command words that one its own
    way), given to the command with it as one ``policy`` argument. Applied below
    @handle_errors, so that a bad value is reported as every other."""

    @functools.wraps(fn)
    def wrapper(*args: Any, resize_interval: float, **kwargs: Any) -> Any:
        values = [kwargs.pop(k) for k in _POLICY_FLAGS]
        return fn(*args, policy=_fleet_policy(resize_interval, *values), **kwargs)

    options = (
        click.option(
            "--history-days",
            type=float,
            default=7.0,
            show_default=True,
            help="Days the fleet's events are kept (efdl jobs --history, efdl timeline --fleet).",
        ),
        click.option(
            "--resume-after",
            type=float,
            default=600.0,
            show_default=True,
            help="Least seconds a suspended job stays suspended (no suspend-resume round trips "
            "while inference swings).",
        ),
        click.option(
            "--preempt-after",
            type=float,
            default=600.0,
            show_default=True,
            help="Seconds a waiting job waits before it suspends lower-priority jobs for their "
            "GPUs (until then it takes free GPUs and what others hold above their min).",
        ),
        click.option(
            "--protect",
            type=float,
            default=3600.0,
            show_default=True,
            help="Seconds after its start or resume in which a job is not suspended for "
            "another job.",
        ),
        click.option(
            "--priority-first",
            is_flag=True,
            help="Serve every job of a higher priority before any of a lower one (default: "
            "the smallest jobs first; priority takes GPUs after --preempt-after).",
        ),
    )
    out: Any = wrapper
    for option in reversed(options):  # (--help lists them in this order)
        out = option(out)
    return out  # type: ignore[no-any-return]


_resize_option = click.option(
    "--resize-interval",
    type=float,
    default=60.0,
    show_default=True,
    help="Least seconds between two resizes of one job.",
)


def _lease_option(what: str) -> Callable[[F], F]:
    return click.option(
        "--lease-ttl",
        "lease_ttl_s",
        type=int,
        default=10,
        show_default=True,
        help=f"Seconds until a dead {what} is replaced.",
    )


def _fleet_option(fn: F) -> F:
    return click.option(
        "--fleet",
        help="The fleet (its keys: /efdl-fleet/<fleet>/); or EFDL_FLEET; default 'default'.",
    )(fn)


@click.command(context_settings={"ignore_unknown_options": True})
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
    cfg = etcd_config(config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        submit_job(store, keys, spec)
    click.echo(
        f"job {spec.job_id}: queued in fleet {keys.fleet} ({spec.min_workers}-"
        f"{spec.max_workers} workers, priority {spec.priority}); see efdl jobs."
    )


@click.command()
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
    from efdl.fleet.holdings import format_history
    from efdl.fleet.registry import read_events as read_fleet_events
    from efdl.fleet.registry import read_fleet

    if not history and (job_id is not None or since is not None):
        raise ConfigError("--job-id and --since go with --history.")
    keys = fleet_keys(fleet)
    cfg = etcd_config(config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        if history:
            events, problems = read_fleet_events(store, keys, since=parse_since(since) or None)
            click.echo(format_history(events, job_id))
            for p in problems:
                click.echo(f"bad record skipped: {p}")
            return
        view = read_fleet(store, keys)
    click.echo(jobs_json(view) if as_json else format_jobs(view, time.time()))


@click.command()
@etcd_options
@_fleet_option
@click.option("--job-id", help="The job to cancel.")
@click.argument("job", required=False)
@click.option("--reason", default="cancelled by efdl cancel", help="Recorded with the job.")
@handle_errors
def cancel(
    fleet: str | None,
    job_id: str | None,
    job: str | None,
    reason: str,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Cancel a fleet job: its hosts stop its agents (a graceful leave). efdl cancel --job-id
    JOB (JOB alone, as before, also works)."""
    from efdl.fleet.commands import fleet_keys
    from efdl.fleet.registry import cancel as cancel_job

    if job_id and job and job_id != job:
        raise ConfigError(f"--job-id {job_id!r} and the job {job!r} differ; give one of them.")
    job_id = job_id or job
    if not job_id:
        raise ConfigError("No job was named: give --job-id JOB.")
    keys = fleet_keys(fleet)
    cfg = etcd_config(config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        st = cancel_job(store, keys, check_id(job_id), reason)
    click.echo(f"job {job_id}: {st.phase.value} ({st.reason}).")


@click.command()
@etcd_options
@_fleet_option
@click.option("--id", "candidate_id", help="This candidate's id (default: host name + suffix).")
@_resize_option
@_lease_option("allocator")
@handle_errors
@_policy_options
def allocator(
    fleet: str | None,
    candidate_id: str | None,
    policy: FleetPolicy,
    lease_ttl_s: int,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Stand for the fleet's allocator and allocate while leading (until SIGTERM/Ctrl-C)."""
    import contextlib
    import socket

    from efdl.fleet.commands import fleet_keys
    from efdl.fleet.leader import Allocator

    keys = fleet_keys(fleet)
    host = socket.gethostname().split(".")[0] or "allocator"
    name = check_id(candidate_id or f"{host}-{uuid.uuid4().hex[:6]}", "candidate id")
    cfg = etcd_config(config_file, flags)
    stop = stop_on_sigterm()
    with (
        EtcdStore(cfg.etcd_settings()) as store,
        LeaseSession(store, lease_ttl_s, on_expired=lambda why: stop.set()) as session,
    ):
        click.echo(f"allocator {name}: standing for fleet {keys.fleet}.", err=True)
        with contextlib.suppress(KeyboardInterrupt):
            Allocator(store, keys, name, session.lease_id, policy).run(stop)
    if session.expired:
        raise EfdlError(f"allocator {name}: its lease ended ({session.why_expired}); exiting.")


@click.command()
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
@_policy_options
def node(
    fleet: str | None,
    host_id: str | None,
    address: str | None,
    state_dir: Path | None,
    lease_ttl_s: int,
    policy: FleetPolicy,
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
    from efdl.fleet.daemon import HostDaemon
    from efdl.fleet.etcd_users import EtcdUsers
    from efdl.fleet.spawn import isolation_from_flags

    keys = fleet_keys(fleet)
    name = check_id(host_id or socket.gethostname(), "host id")
    cfg = etcd_config(config_file, flags)
    settings = cfg.etcd_settings()
    isolation = isolation_from_flags(job_uids, job_etcd_cert, job_etcd_key, cfg, settings)
    stop = stop_on_sigterm()
    state = state_dir or Path("/var/lib/efdl-node") / keys.fleet
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--state-dir {state}: cannot create it ({exc.strerror or exc}); expected a "
            "directory this daemon can write (its agents' PIDs and logs)."
        ) from None
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
            click.echo(
                f"efdl node {name}: stopped (Ctrl-C); its agents train on, and a daemon "
                "started again within the lease TTL adopts them.",
                err=True,
            )
            sys.exit(130)


_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@click.command("kube-controller")
@etcd_options
@_fleet_option
@click.option("--id", "candidate_id", help="This candidate's id (default: POD_NAME, or host name).")
@click.option(
    "--namespace",
    help="Where the jobs' pods and their template live (default: this pod's namespace, or 'efdl').",
)
@click.option(
    "--pod-template",
    default="efdl-fleet-job",
    show_default=True,
    help="The PodTemplate the jobs' pods are made from (image, EFDL_ETCD* variables, volumes).",
)
@click.option(
    "--gpu-resource", default="nvidia.com/gpu", show_default=True, help="The GPUs' resource."
)
@click.option(
    "--interval",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between two reads of the cluster and decisions.",
)
@click.option(
    "--api-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds any one call to the API server may take.",
)
@click.option(
    "--keep-ended",
    type=float,
    default=3600.0,
    show_default=True,
    help="Seconds an ended job's pods are kept, ended (kubectl logs).",
)
@_resize_option
@_lease_option("controller")
@handle_errors
@_policy_options
def kube_controller(
    fleet: str | None,
    candidate_id: str | None,
    namespace: str | None,
    pod_template: str,
    gpu_resource: str,
    interval: float,
    api_timeout: float,
    keep_ended: float,
    policy: FleetPolicy,
    lease_ttl_s: int,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Run the fleet on Kubernetes: its allocator, and its jobs as pods, one GPU each
    (docs/kubernetes.md; deploy/kubernetes/fleet.yaml). Stands for election; acts while
    leading (until SIGTERM/Ctrl-C)."""
    import contextlib
    import os
    import socket

    from efdl.fleet.commands import fleet_keys
    from efdl.fleet.kube.client import ClientApi
    from efdl.fleet.kube.cluster import KubeSettings
    from efdl.fleet.kube.controller import KubeController

    for flag, value in (("--interval", interval), ("--api-timeout", api_timeout)):
        if not value > 0:
            raise ConfigError(f"{flag} {value} is not a number of seconds > 0.")
    keys = fleet_keys(fleet)
    default_id = os.environ.get("POD_NAME") or socket.gethostname().split(".")[0]
    name = check_id(candidate_id or default_id or "controller", "candidate id")
    if namespace is None:
        try:
            namespace = _SA_NAMESPACE.read_text().strip() or "efdl"
        except OSError:
            namespace = "efdl"
    settings = KubeSettings(namespace, keys.fleet, gpu_resource, pod_template,
                            keep_ended_s=keep_ended)  # fmt: skip
    api = ClientApi(timeout_s=api_timeout)
    cfg = etcd_config(config_file, flags)
    stop = stop_on_sigterm()
    with (
        EtcdStore(cfg.etcd_settings()) as store,
        LeaseSession(store, lease_ttl_s, on_expired=lambda why: stop.set()) as session,
    ):
        click.echo(
            f"kube-controller {name}: standing for fleet {keys.fleet} (pods in namespace "
            f"{namespace}).",
            err=True,
        )
        controller = KubeController(
            store, keys, api, settings, name, session.lease_id, policy, interval_s=interval
        )
        with contextlib.suppress(KeyboardInterrupt):
            controller.run(stop)
    if session.expired:
        raise EfdlError(
            f"kube-controller {name}: its lease ended ({session.why_expired}); exiting."
        )
