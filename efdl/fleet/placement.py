"""Where a job's GPUs go once the allocator has counted them (efdl.fleet.allocate, rule 5):
the free GPUs indexed by how many each host has free, a job's growth on its own hosts first
and then on the host that fits it most tightly, a shrink from the hosts where it has the
fewest."""

from __future__ import annotations

import heapq

# A job's GPUs while deciding: host id -> GPU indices.
Held = dict[str, set[int]]


class FreeIndex:
    """The free GPUs by how many each host has free, to find the host that fits a need
    most tightly (or has the most) without a scan of every host: a heap of host ids per
    count, entries dropped lazily once their host's count has changed."""

    def __init__(self, free: Held, shared: set[str]) -> None:
        self.free = free
        self._shared = shared
        self._by_count: dict[tuple[bool, int], list[str]] = {}
        self._most = 0
        for host in sorted(free):
            self._file(host)

    def _file(self, host: str) -> None:
        n = len(self.free[host])
        if n:
            heapq.heappush(self._by_count.setdefault((host in self._shared, n), []), host)
            self._most = max(self._most, n)

    def _first(self, shared: bool, n: int) -> str | None:
        heap = self._by_count.get((shared, n))
        while heap and len(self.free[heap[0]]) != n:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def tightest(self, n: int) -> str | None:
        """The host with the fewest free GPUs that are at least ``n`` (the first by id), one
        that inference does not use first."""
        for shared in (False, True):
            for count in range(n, self._most + 1):
                if (host := self._first(shared, count)) is not None:
                    return host
        return None

    def fullest(self) -> str | None:
        """The host with the most free GPUs (the first by id), or None if none has any."""
        best: tuple[int, bool, str] | None = None
        for shared in (False, True):
            for count in range(self._most, 0, -1):
                if (host := self._first(shared, count)) is not None:
                    if best is None or (-count, shared, host) < best:
                        best = (-count, shared, host)
                    break
        return best[2] if best else None

    def take(self, host: str, n: int) -> list[int]:
        chosen = sorted(self.free[host])[:n]
        self.free[host].difference_update(chosen)
        self._file(host)
        return chosen


def take(held: Held, index: FreeIndex, n: int) -> None:
    """Give a job holding ``held`` ``n`` free GPUs more: on its own hosts first (most free
    first), then on the host that fits the rest most tightly, else on the hosts with the most
    free."""
    free = index.free
    own = sorted((h for h in held if free.get(h)), key=lambda h: (-len(free[h]), h))
    for host in own:
        if n <= 0:
            return
        chosen = index.take(host, n)
        held[host].update(chosen)
        n -= len(chosen)
    while n > 0:
        found = index.tightest(n) or index.fullest()
        if found is None:
            return  # (cannot happen: targets never exceed the pool)
        chosen = index.take(found, n)
        held.setdefault(found, set()).update(chosen)
        n -= len(chosen)


def give_back(held: Held, free: Held, n: int, staying: set[str]) -> None:
    """Take ``n`` GPUs from a job holding ``held``, from the hosts where it has the fewest
    (highest indices first), back to ``free``; never those on a lingering host
    (``staying``)."""
    hosts = sorted((h for h in held if h not in staying), key=lambda h: (len(held[h]), h))
    for host in hosts:
        if n <= 0:
            return
        for i in sorted(held[host], reverse=True)[:n]:
            held[host].discard(i)
            free.setdefault(host, set()).add(i)
            n -= 1
        if not held[host]:
            del held[host]


def count(held: Held) -> int:
    return sum(len(ix) for ix in held.values())
