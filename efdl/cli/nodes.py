"""The node tools of a job: efdl nodes, drain, release (efdl.rendezvous.holds)."""

from __future__ import annotations

import getpass
import json
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from efdl.cli.common import etcd_options, handle_errors, job_config, job_option
from efdl.errors import EfdlError
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.holds import Hold, HoldKind, hold
from efdl.rendezvous.holds import release as release_hold
from efdl.rendezvous.reading import parse_round
from efdl.rendezvous.records import Event, EventKind, JobKeys, check_id
from efdl.rendezvous.status import StatusReport, read_status, unknown_job


def _record(store: KVStore, keys: JobKeys, kind: EventKind, node: str, text: str) -> None:
    """One event in the job's history, written now, in the job's current generation (the
    tools have no event writer)."""
    current = parse_round(store.get(keys.round), keys)
    event = Event(time.time(), kind, node, current.generation if current else 0, text)
    store.put(event.key(keys), event.to_json())


def _who() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return socket.gethostname()


@click.command()
@etcd_options
@job_option
@click.argument("node")
@click.option("--reason", help="Why, shown in efdl nodes, efdl status and the events.")
@handle_errors
def drain(
    job_id: str | None, node: str, reason: str | None, config_file: Path | None, **flags: Any
) -> None:
    """Hold NODE out of the job until released: its workers leave at their next step
    boundary (nothing committed is lost), its agent stays and waits; efdl release lets it
    back."""
    job_id, cfg = job_config(job_id, config_file, flags)
    check_id(node, "node id")
    keys = JobKeys(job_id)
    text = reason or f"drained by efdl drain ({_who()})"
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
@click.argument("node")
@handle_errors
def release(job_id: str | None, node: str, config_file: Path | None, **flags: Any) -> None:
    """Let NODE back into the job: delete its hold (a drain or a quarantine); the next round
    places it again, as any newcomer."""
    job_id, cfg = job_config(job_id, config_file, flags)
    check_id(node, "node id")
    keys = JobKeys(job_id)
    with EtcdStore(cfg.etcd_settings()) as store:
        raw = store.get(keys.hold(node))
        if not release_hold(store, keys, node):
            raise EfdlError(
                f"Node {node} is not held in job {job_id} (etcd holds no {keys.hold(node)}); "
                f"efdl nodes --job-id {job_id} lists the nodes held."
            )
        was = ""
        if raw is not None:
            try:
                was = f" (it was held: {Hold.from_json(raw.value, raw.key).describe(time.time())})"
            except EfdlError:
                was = " (its hold record did not parse)"
        _record(store, keys, EventKind.RELEASE, node, f"released by efdl release ({_who()})")
    click.echo(f"job {job_id}: node {node} is released{was}; the next round may place it.")


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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def nodes(job_id: str | None, as_json: bool, config_file: Path | None, **flags: Any) -> None:
    """List a job's nodes: members (their ranks), spares, and nodes held out (drained or
    quarantined: the kind, the reason, since when and until when, and how many workers their
    agent still runs: 0 once a drained node's GPUs are free)."""
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
