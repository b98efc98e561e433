"""The allocator's nouns (efdl.fleet.allocate): a job as it sees one, its decision, and one
job while deciding."""

from __future__ import annotations

from dataclasses import dataclass, field

from efdl.fleet.placement import Held
from efdl.fleet.records import JobSpec, JobStatus


@dataclass(frozen=True, slots=True)
class Job:
    """A job as the allocator sees it: what was asked (spec) and where it stands (status)."""

    spec: JobSpec
    status: JobStatus


@dataclass(frozen=True, slots=True)
class Reason:
    """Why one job's status changed: one sentence, recorded as a fleet event."""

    job_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Allocation:
    """Each job's new status (only the jobs whose status changed) and why."""

    statuses: dict[str, JobStatus]
    reasons: tuple[Reason, ...]


@dataclass(slots=True)
class Work:
    """One job while deciding."""

    job: Job
    order: int = 0  # its place in the serving order of rule 3
    held: Held = field(default_factory=dict)
    kept: int = 0  # GPUs on lingering hosts: held, never moved
    running: bool = False  # it trains on GPUs it still holds after rule 1
    incumbent: bool = False  # recorded running (it may have lost every GPU): its min is kept
    seated: bool = False  # started in an earlier pass of this decision (kept, protected)
    facts: list[str] = field(default_factory=list)  # what befell it (rule 1), not a choice
    frozen: bool = False  # resized less than the interval ago (rule 2)
    floor: int = 0  # what the allocator may not take from it (rule 2)
    admitted: bool = False  # its min (rule 3)
    target: int = 0  # its size after this decision
    waiting: str = ""  # why it lacks its min, if it does
    hopeless: bool = False  # its min exceeds what could ever be freed for it now
    level: int = 0  # its level of attained service (rule 3)

    @property
    def id(self) -> str:
        return self.job.spec.job_id

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def size(self) -> int:
        return sum(len(ix) for ix in self.held.values())

    @property
    def movable(self) -> int:
        """What it holds that the allocator could move (not on a lingering host)."""
        return self.size - self.kept

    @property
    def low(self) -> int:
        """Its min, less what it keeps on lingering hosts: what it needs of the pool."""
        return max(0, self.spec.min_workers - self.kept)

    @property
    def high(self) -> int:
        return max(0, self.spec.max_workers - self.kept)

    @property
    def base(self) -> int:
        """Its share of the pool once its min is admitted (a frozen job keeps more)."""
        return max(self.low, self.floor)
