"""The node tools of a job: efdl nodes, drain, release (efdl.rendezvous.holds); with
--fleet, the same for a fleet's hosts (efdl.fleet.host_holds)."""

from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from efdl.cli.common import etcd_config, etcd_options, handle_errors, job_config, job_option
from efdl.config import EtcdClientConfig
from efdl.errors import ConfigError, EfdlError
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.holds import Hold, HoldKeys, HoldKind, hold
from efdl.rendezvous.holds import release as release_hold
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import Event, EventKind, JobKeys, check_id
from efdl.rendezvous.status import StatusReport, read_status, unknown_job

if TYPE_CHECKING:
    from efdl.fleet.records import FleetKeys


def _record(store: KVStore, keys: JobKeys, kind: EventKind, node: str, text: str) -> None:
    """One event in the job's history, written now, in the job's current generation (the
    tools have no event writer)."""
    current = parse_round(store.get(keys.round), keys)
    event = Event(time.time(), kind, node, current.generation if current else 0, text)
    store.put(event.key(keys), event.to_json())


_fleet_option = click.option(
    "--fleet",
    help="NODE is a host of this fleet (efdl node --host-id): hold it out of every job of the "
    "fleet (its GPUs go to no job) instead of a node out of one job.",
)


def _fleet_mode(
    fleet: str | None, job_id: str | None, config_file: Path | None, flags: dict[str, Any]
) -> tuple[FleetKeys, EtcdClientConfig] | None:
    """The fleet and its etcd with --fleet (never with --job-id), else None."""
    if fleet is None:
        return None
    if job_id is not None:
        raise ConfigError(
            f"--fleet {fleet} and --job-id {job_id}: give one (a host of a fleet, or a node of "
            "a job)."
        )
    from efdl.fleet.records import FleetKeys

    return FleetKeys(fleet), etcd_config(config_file, flags)


def _who() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return socket.gethostname()


@click.command()
@etcd_options
@job_option
@_fleet_option
@click.argument("node")
@click.option("--reason", help="Why, shown in efdl nodes, efdl status and the events.")
@handle_errors
def drain(
    job_id: str | None,
    fleet: str | None,
    node: str,
    reason: str | None,
    config_file: Path | None,
    **flags: Any,
) -> None:
    """Hold NODE out of the job until released: its workers leave at their next step
    boundary (nothing committed is lost), its agent stays and waits; efdl release lets it
    back. With --fleet, NODE is a host: every job on it shrinks off it in place (or is
    suspended, where it cannot keep its min elsewhere) and none is placed there."""
    text = reason or f"drained by efdl drain ({_who()})"
    if (fleet_mode := _fleet_mode(fleet, job_id, config_file, flags)) is not None:
        _drain_host(*fleet_mode, check_id(node, "host id"), text)
        return
    job_id, cfg = job_config(job_id, config_file, flags)
    check_id(node, "node id")
    keys = JobKeys(job_id)
    with EtcdStore(cfg.etcd_settings()) as store:
        unknown = unknown_job(store, job_id)
        if unknown:
            raise EfdlError(unknown)
        h = hold(store, keys, node, HoldKind.DRAIN, text, None)
        _record(store, keys, EventKind.HOLD, node, f"drain: {h.reason}")
        live = store.get(keys.node(node)) is not None
    click.echo(f"job {job_id}: node {node} is drained ({h.reason}).")
    if live:
        click.echo(
            "  The next round leaves it out: its workers leave at their next step boundary "
            f"and its agent waits. efdl nodes --job-id {job_id} shows it; efdl release {node} "
            "lets it back."
        )
    else:
        click.echo(
            f"  No node {node} runs in the job now: the drain holds it out when it starts "
            "(its agent waits, not placed, until released)."
        )


@click.command()
@etcd_options
@job_option
@_fleet_option
@click.argument("node")
@handle_errors
def release(
    job_id: str | None, fleet: str | None, node: str, config_file: Path | None, **flags: Any
) -> None:
    """Let NODE back into the job: delete its hold (a drain or a quarantine); the next round
    places it again, as any newcomer. With --fleet, NODE is a host the fleet may use again."""
    if (fleet_mode := _fleet_mode(fleet, job_id, config_file, flags)) is not None:
        _release_host(*fleet_mode, check_id(node, "host id"))
        return
    job_id, cfg = job_config(job_id, config_file, flags)
    check_id(node, "node id")
    keys = JobKeys(job_id)
    with EtcdStore(cfg.etcd_settings()) as store:
        was = _release(store, keys, node, f"Node {node} is not held in job {job_id}",
                       f"--job-id {job_id}")  # fmt: skip
        _record(store, keys, EventKind.RELEASE, node, f"released by efdl release ({_who()})")
    click.echo(f"job {job_id}: node {node} is released{was}; the next round may place it.")


def _drain_host(keys: FleetKeys, cfg: EtcdClientConfig, host: str, text: str) -> None:
    with EtcdStore(cfg.etcd_settings()) as store:
        h = hold(store, keys, host, HoldKind.DRAIN, text, None)
        live = store.get(keys.host(host)) is not None
    click.echo(f"fleet {keys.fleet}: host {host} is drained ({h.reason}).")
    click.echo(
        "  The allocator's next decision takes its GPUs from every job on it (they shrink in "
        "place, or are suspended where they cannot keep their min) and places none there. "
        f"efdl nodes --fleet {keys.fleet} shows it; efdl release --fleet {keys.fleet} {host} "
        "lets it back."
        if live
        else f"  No host {host} is in fleet {keys.fleet} now: the drain holds it out when its "
        "daemon starts."
    )


def _release_host(keys: FleetKeys, cfg: EtcdClientConfig, host: str) -> None:
    with EtcdStore(cfg.etcd_settings()) as store:
        was = _release(store, keys, host, f"Host {host} is not held in fleet {keys.fleet}",
                       f"--fleet {keys.fleet}")  # fmt: skip
    click.echo(f"fleet {keys.fleet}: host {host} is released{was}; the allocator may use it.")


def _release(store: KVStore, keys: HoldKeys, held: str, not_held: str, where: str) -> str:
    """Delete ``held``'s hold (a job's node, a fleet's host); what it was, for the message.

    Raises:
        EfdlError: nothing held it (``not_held``, and where ``efdl nodes`` lists the holds).
    """
    raw = store.get(keys.hold(held))
    if not release_hold(store, keys, held):
        raise EfdlError(
            f"{not_held} (etcd holds no {keys.hold(held)}); efdl nodes {where} lists the holds."
        )
    if raw is None:
        return ""
    try:
        return f" (it was held: {Hold.from_json(raw.value, raw.key).describe(time.time())})"
    except EfdlError:
        return " (its hold record did not parse)"


def _list_hosts(keys: FleetKeys, cfg: EtcdClientConfig, as_json: bool) -> None:
    from efdl.fleet.registry import read_fleet

    with EtcdStore(cfg.etcd_settings()) as store:
        view = read_fleet(store, keys)
    now = time.time()
    live = {h.host_id: h for h in view.hosts}
    rows = []
    for host_id in sorted(set(live) | set(view.holds)):
        h, hold_ = live.get(host_id), view.holds.get(host_id)
        held = hold_ is not None and hold_.active(now)
        rows.append(
            {
                "host": host_id,
                "state": ("held" if h else "held (no daemon)") if held else "serving",
                "gpus": len(h.gpus) if h else 0,
                "usable": len(h.usable()) if h else 0,
                "hold": {**asdict(hold_), "kind": hold_.kind.value} if hold_ else None,
                "detail": hold_.describe(now) if hold_ else "",
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    click.echo(f"fleet {keys.fleet}: {len(rows)} host(s)")
    for r in rows:
        click.echo(f"  {r['host']:<40} {r['state']:<16} {r['usable']}/{r['gpus']} GPU(s) usable")
        if r["detail"]:
            click.echo(f"    {r['detail']}")


def node_rows(st: StatusReport, now: float) -> list[dict[str, Any]]:
    """Every node of the job, live or held: its state (member, spare, held) and details."""
    members = {m.node_id: m for m in st.members}
    rows = []
    for node_id in sorted(set(st.nodes) | set(st.holds)):
        view = st.nodes.get(node_id)
        h = st.holds.get(node_id)
        m = members.get(node_id)
        if h is not None:
            state = "held" if view is not None else "held (no agent)"
        elif m is not None:
            state = "member"
        else:
            state = "spare"
        row: dict[str, Any] = {
            "node": node_id,
            "state": state,
            "host": view.record.host if view else "",
            "slots": view.record.slots if view else 0,
            "ranks": f"{m.first_rank}-{m.first_rank + m.workers - 1}" if m else "",
            "hold": {**asdict(h), "kind": h.kind.value} if h is not None else None,
            "detail": h.describe(now) if h is not None else "",
            "agent": live.describe(now) if (live := st.live.get(node_id)) is not None else "",
            "workers": (live.said or {}).get("workers") if live is not None else None,
        }
        if h is not None and m is not None:
            row["detail"] += " (leaving: a member of the current round still)"
        rows.append(row)
    return rows


@click.command()
@etcd_options
@job_option
@_fleet_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def nodes(
    job_id: str | None, fleet: str | None, as_json: bool, config_file: Path | None, **flags: Any
) -> None:
    """List a job's nodes: members (their ranks), spares, and nodes held out (drained or
    quarantined: the kind, the reason, since when and until when, and how many workers their
    agent still runs: 0 once a drained node's GPUs are free). With --fleet, the fleet's hosts
    and those held out."""
    if (fleet_mode := _fleet_mode(fleet, job_id, config_file, flags)) is not None:
        _list_hosts(*fleet_mode, as_json)
        return
    job_id, cfg = job_config(job_id, config_file, flags)
    with EtcdStore(cfg.etcd_settings()) as store:
        st = read_status(store, job_id)  # each agent asked: what it runs now
        if not st.known and not st.holds:
            raise EfdlError(unknown_job(store, job_id) or f"No job {job_id!r}.")
    rows = node_rows(st, time.time())
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not rows:
        click.echo(f"job {job_id}: no nodes.")
        return
    click.echo(f"job {job_id}: {len(rows)} node(s)")
    for r in rows:
        where = f"{r['host']} {r['slots']} slot(s)" if r["host"] else "-"
        ranks = f" ranks {r['ranks']}" if r["ranks"] else ""
        click.echo(f"  {r['node']:<24} {r['state']:<16} {where}{ranks}")
        if r["detail"]:
            click.echo(f"    {r['detail']}")
        if r["agent"] and r["state"] != "member":
            click.echo(f"    agent: {r['agent']}")
