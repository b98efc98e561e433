"""The job tools: efdl check, status, events, stop, timeline."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from efdl import __version__
from efdl.cli.common import (
    etcd_config,
    etcd_options,
    handle_errors,
    job_config,
    job_option,
    log,
    parse_since,
    store_for,
)
from efdl.errors import ConfigError, EfdlError
from efdl.history import follow_events, format_event, read_events, stood_still
from efdl.rendezvous.api import Compare, EventType, Put
from efdl.rendezvous.decide import Policy
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.lease import LeaseSession
from efdl.rendezvous.lifecycle import close_job
from efdl.rendezvous.participant import Participant
from efdl.rendezvous.records import Event, JobKeys, NodeRecord, RoundStatus
from efdl.rendezvous.status import (
    format_status,
    no_such_job,
    read_status,
    status_json,
    unknown_job,
)


@click.command()
@etcd_options
@click.option("--standalone", is_flag=True, help="Start an embedded etcd and check against it.")
@handle_errors
def check(standalone: bool, config_file: Path | None, **flags: Any) -> None:
    """Check that etcd works for efdl: connect, lease, CAS, watch; print each latency."""
    cfg = etcd_config(config_file, flags)
    if not log.isEnabledFor(logging.DEBUG):  # the table is the answer; -v shows the steps
        log.setLevel(logging.WARNING)
    rows: list[tuple[str, float]] = []

    def timed(what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        rows.append((what, (time.perf_counter() - t0) * 1000))
        return result

    t_start = time.perf_counter()
    with store_for(cfg, standalone) as (store, server):
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


@click.command()
@etcd_options
@job_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def status(job_id: str | None, as_json: bool, config_file: Path | None, **flags: Any) -> None:
    """Show a job: generation, leader, members with GPUs and ranks, spares, last rescale."""
    job_id, cfg = job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        st = read_status(store, job_id)
        if not st.known:
            raise EfdlError(no_such_job(store, job_id))
        events, _ = read_events(store, job_id)
    if as_json:
        click.echo(status_json(st))
        return
    click.echo(format_status(st))
    if events:
        end = st.round.created if st.round is not None and st.round.status.final else None
        trained, still = stood_still(events, end or time.time())
        click.echo(
            f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(events[0].time))}: "
            f"trained {trained:.0f} s, stood still {still:.1f} s (the pauses of rescales and "
            "restarts, and waiting below --min)"
        )
        click.echo("last events (efdl events --job-id ... for all):")
        for e in events[-5:]:
            click.echo(f"  {format_event(e)}")


@click.command()
@etcd_options
@job_option
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
    job_id, cfg = job_config(job_id, config_file, flags)
    start = parse_since(since)

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


@click.command()
@etcd_options
@job_option
@click.option("--reason", default="stopped by efdl stop", help="Shown in the agents' logs.")
@handle_errors
def stop(job_id: str | None, reason: str, config_file: Path | None, **flags: Any) -> None:
    """End a job cleanly: every agent stops its workers and exits 0."""
    job_id, cfg = job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        unknown = unknown_job(store, job_id)
        if unknown:  # (a stop would leave a closed job of that name, refusing a later run)
            raise EfdlError(unknown)
        r = close_job(store, job_id, reason)
    click.echo(f"job {job_id}: generation {r.generation} is {r.status.value} ({r.reason}).")


@click.command()
@etcd_options
@job_option
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

    start = parse_since(since)
    if fleet is not None:
        from efdl.fleet.commands import fleet_keys
        from efdl.fleet.holdings import holdings
        from efdl.fleet.registry import read_events as read_fleet_events

        if job_id is not None:
            raise ConfigError("--fleet and --job-id draw different things; give one of them.")
        keys = fleet_keys(fleet)
        with EtcdStore(etcd_config(config_file, flags).etcd_settings()) as store:
            events, _ = read_fleet_events(store, keys, since=start or None)
        held = holdings(events, time.time())
        out = out or Path(f"{keys.fleet}-fleet.png")
        draw_fleet(held, out, f"fleet {keys.fleet}")
        click.echo(f"fleet {keys.fleet}: {len(held)} stretches on GPUs drawn to {out}.")
        return
    job_id, cfg = job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        found, _ = read_events(store, job_id, since=start)
    out = out or Path(f"{job_id}-timeline.png")
    draw(found, out, f"job {job_id}")
    click.echo(f"job {job_id}: {len(found)} events drawn to {out}.")
