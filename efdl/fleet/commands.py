"""What ``efdl submit``, ``efdl jobs``, ``efdl cancel`` and ``efdl allocator`` print and do
(efdl.cli parses the flags and reaches etcd; this module turns them into records and lines)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from efdl.errors import ConfigError
from efdl.fleet.records import FleetKeys, JobSpec, describe
from efdl.fleet.registry import FleetView

FLEET_ENV = "EFDL_FLEET"


def fleet_keys(name: str | None) -> FleetKeys:
    """--fleet > EFDL_FLEET > ``default``."""
    return FleetKeys(name or os.environ.get(FLEET_ENV) or "default")


def spec_from_flags(
    job_id: str,
    command: Sequence[str],
    workdir: Path | None,
    min_workers: int,
    max_workers: int | None,
    priority: int,
    cache_url: str | None,
    env: Sequence[str],
) -> JobSpec:
    """The spec ``efdl submit`` writes; every bad flag is a ConfigError naming it."""
    pairs = []
    for item in env:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item!r} is not NAME=VALUE.")
        pairs.append((name, value))
    where = (workdir or Path.cwd()).absolute()
    if workdir is not None and not where.is_dir():
        raise ConfigError(
            f"--workdir {str(workdir)!r} is not a directory here; expected the directory that "
            "holds the code on every host."
        )
    spec = JobSpec(
        job_id=job_id,
        argv=tuple(command),
        workdir=str(where),
        min_workers=min_workers,
        max_workers=max_workers if max_workers is not None else min_workers,
        priority=priority,
        cache_url=cache_url or "",
        env=tuple(sorted(pairs)),
        submitted=time.time(),
    )
    script = command[0] if command else ""
    if script.endswith(".py") and not (where / script).is_file():  # (a program is on PATH)
        raise ConfigError(
            f"The training script {script!r} is not in {where}; expected a file there (the "
            "directory that holds the code on every host: --workdir, else this one)."
        )
    return spec


def format_jobs(view: FleetView, now: float) -> str:
    """``efdl jobs``: one line per job, highest priority first, then the hosts."""
    used = {h.host_id: 0 for h in view.hosts}
    lines = [
        f"{'JOB':24} {'PRIO':>4} {'PHASE':10} {'GPUS':>9} {'SINCE':>8}  WHERE / WHY",
    ]
    order = sorted(view.jobs, key=lambda j: (-j.spec.priority, j.spec.submitted, j.spec.job_id))
    for j in order:
        st = j.status
        for host, indices in st.gpus:
            if host in used:
                used[host] += len(indices)
        size = f"{st.size}/{j.spec.min_workers}-{j.spec.max_workers}"
        since = _ago(now - st.changed) if st.changed else "-"
        where = describe(st.gpus) if st.gpus else st.reason
        lines.append(
            f"{j.spec.job_id:24} {j.spec.priority:>4} {st.phase.value:10} {size:>9} {since:>8}  "
            f"{where}"
        )
    if not view.jobs:
        lines.append("(no jobs)")
    total = sum(len(h.gpus) for h in view.hosts)
    foreign = sum(1 for h in view.hosts for g in h.gpus if g.foreign)
    lines.append(
        f"{len(view.hosts)} hosts, {total} GPUs: {sum(used.values())} training, "
        f"{foreign} held by other processes, {total - foreign - sum(used.values())} free"
    )
    lines += [f"bad record skipped: {p}" for p in view.problems]
    return "\n".join(lines)


def jobs_json(view: FleetView) -> str:
    """``efdl jobs --json``: one object."""
    return json.dumps(
        {
            "hosts": [json.loads(h.to_json()) for h in view.hosts],
            "jobs": [
                {"spec": json.loads(j.spec.to_json()), "status": json.loads(j.status.to_json())}
                for j in view.jobs
            ],
            "problems": list(view.problems),
        },
        sort_keys=True,
    )


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
