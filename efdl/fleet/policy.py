"""The fleet allocator's settings (efdl.fleet.allocate; the flags of efdl node, allocator and
kube-controller, efdl.cli.fleet)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    """The allocator's settings.

    Attributes:
        resize_interval_s: the least time between two of the allocator's changes to a running
            job's GPUs (a job that lost GPUs gets its min back at once).
        host_grace_s: how long a host whose record went keeps its GPUs with its jobs (its
            daemon restarting, or away from etcd, while its agents train on).
        history_s: how long the fleet's events are kept (the leader deletes older ones,
            hourly: efdl.fleet.registry.prune_events); decisions do not read them.
        max_wait_s: a waiting job that has waited this long (since it was submitted, or
            suspended) goes first, may take the min of any job of its priority or lower
            that is not protected, and lets nobody of its priority or lower start past it.
        resume_after_s: the least time a suspended job stays suspended (doubled for each
            suspension past its budget, ``suspends_per_h``).
        levels_gpu_s: the attained service (GPU-seconds a job has held) at which a job
            moves down one level: within a size, jobs of a lower level are served first
            (least attained service, in a few levels so that a job moves rarely).
        preempt_after_s: a waiting job suspends running ones (takes their min: of a lower
            priority, or of its own and a higher level) only once it has waited this long
            (since it was submitted, or suspended); before, it takes only what is free or
            what jobs served after it hold above their min.
        protect_s: a running job is not suspended for another job within this time of its
            start or resume (only for want of GPUs).
        suspends_per_h: a job is suspended for another job only while its suspensions stay
            within this many per hour it held GPUs (the first at any time after
            ``protect_s``).
        priority_first: serve every claim of a higher priority first (its growth before a
            lower job's start); by default the smallest jobs go first, and priority takes
            GPUs from lower jobs once a job waited ``preempt_after_s``.
    """

    resize_interval_s: float = 60.0
    host_grace_s: float = 60.0
    history_s: float = 7 * 86400.0
    max_wait_s: float = 12 * 3600.0
    resume_after_s: float = 600.0
    levels_gpu_s: tuple[float, ...] = (3600.0, 8 * 3600.0, 64 * 3600.0)
    preempt_after_s: float = 600.0
    protect_s: float = 3600.0
    priority_first: bool = False
    suspends_per_h: float = 1.0
