"""What the fleet allocator's pass over the claims may take back (efdl.fleet.allocate, rule
3): the running jobs' mins, kept for them last (:class:`Pending`), and the growth it has
served so far (:class:`Grown`)."""

from __future__ import annotations

import bisect
from typing import Protocol

from efdl.fleet.records import JobSpec


class Claimant(Protocol):
    """A job while the allocator decides (efdl.fleet.allocate's work item)."""

    level: int  # its level of attained service
    target: int  # its size after the decision, so far

    @property
    def spec(self) -> JobSpec: ...


class Pending:
    """The running jobs' mins, claimed last: kept against every claim before them but a
    waiting job's that waited ``preempt_after_s``, which may take those of the last of them
    (in :func:`_kept_key` order: not protected) that it goes before: of a lower priority, or
    of its own and a higher level."""

    def __init__(self, running: list[tuple[tuple[int, int, int, int], int]]) -> None:
        running = sorted((x for x in running if x[1] > 0), key=lambda x: x[0])
        self._keys = [k for k, _ in running]
        self._suffix = [0] * (len(running) + 1)
        for i in range(len(running) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + running[i][1]
        self.total = self._suffix[0]

    def open_to(self, priority: int, level: int) -> int:
        """What a waiting job of ``priority`` at ``level`` may take of them."""
        return self._suffix[bisect.bisect_left(self._keys, (2, -priority, level + 1, -1))]


class Grown:
    """The growth served so far in a pass, by (priority, level), each grant with its claim's
    place. A waiting job that may take running jobs' mins takes their growth first, of the
    same jobs it may take mins of (a lower priority, or its own and a higher level):
    shrinking a job goes before suspending one, and a smaller lower job's growth served
    before a larger higher job's min does not keep that min out. And a running job is not
    suspended while growth served after where its min would stand, were it waiting, would
    cover it (else, suspended, it would be served before that growth in the next decision,
    and resume: not a fixed point). Sums per bucket and a Fenwick tree over the grants in
    serving order keep each question O(log n) (5,000 jobs decide in well under a second)."""

    def __init__(self) -> None:
        self._jobs: list[Claimant] = []  # the grants in serving order: whose,
        self._steps: list[int] = []  # how many GPUs (what is left of them),
        self._places: list[tuple[object, ...]] = []  # and where their claim stands
        self._tree: list[int] = [0]  # Fenwick tree over _steps (1-based)
        self._by: dict[tuple[int, int], list[int]] = {}  # bucket -> grant indices, in order
        self._sums: dict[tuple[int, int], int] = {}

    def add(self, w: Claimant, step: int, place: tuple[object, ...]) -> None:
        i = len(self._steps)
        self._jobs.append(w)
        self._steps.append(0)
        self._places.append(place)
        self._tree.append(0)
        j = i + 1  # (a new last node: fill it from the nodes it covers)
        low = j - (j & -j)
        k = j - 1
        while k > low:
            self._tree[j] += self._tree[k]
            k -= k & -k
        key = (w.spec.priority, w.level)
        self._by.setdefault(key, []).append(i)
        self._sums[key] = self._sums.get(key, 0)
        self._change(i, step)

    def _change(self, i: int, delta: int) -> None:
        self._steps[i] += delta
        w = self._jobs[i]
        key = (w.spec.priority, w.level)
        self._sums[key] += delta
        j = i + 1
        while j < len(self._tree):
            self._tree[j] += delta
            j += j & -j

    def _prefix(self, n: int) -> int:
        """The sum of the first ``n`` grants."""
        out = 0
        while n > 0:
            out += self._tree[n]
            n -= n & -n
        return out

    def _open(self, priority: int, level: int) -> list[tuple[int, int]]:
        """The buckets a job of ``priority`` at ``level`` may take from (level -1: any of
        its own priority), the lowest priority and the highest level first."""
        return sorted(
            (k for k in self._by if k[0] < priority or (k[0] == priority and k[1] > level)),
            key=lambda k: (k[0], -k[1]),
        )

    def open_to(self, priority: int, level: int) -> int:
        return sum(self._sums[k] for k in self._open(priority, level))

    def take(self, priority: int, level: int, n: int) -> int:
        """Take up to ``n`` GPUs of growth back (the latest granted first); returns how many."""
        taken = 0
        for k in self._open(priority, level):
            grants = self._by[k]
            while grants and taken < n:
                taken += self._back(grants[-1], n - taken)
                if self._steps[grants[-1]] == 0:
                    grants.pop()
        return taken

    def after(self, place: tuple[object, ...]) -> int:
        """The growth granted to claims served after ``place``."""
        return self._prefix(len(self._steps)) - self._prefix(
            bisect.bisect_right(self._places, place)
        )

    def take_after(self, place: tuple[object, ...], n: int) -> int:
        """Take up to ``n`` GPUs back from the growth served after ``place``, the last
        served first; returns how many."""
        taken, i, first = 0, len(self._steps) - 1, bisect.bisect_right(self._places, place)
        while taken < n and i >= first:
            if self._steps[i]:
                taken += self._back(i, n - taken)
            i -= 1
        return taken

    def _back(self, i: int, n: int) -> int:
        back = min(self._steps[i], n)
        self._jobs[i].target -= back
        self._change(i, -back)
        return back
