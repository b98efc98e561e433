"""The job's shared records that every generation writes: never overwritten by an older one.

``progress`` and ``cache`` (efdl.rendezvous.records) are written by whichever agent runs rank 0
of the generation. A generation that was cut off from etcd and replaced may still hold a
value to publish when it reaches etcd again (its publisher retries until it can): written
blindly, that value would take the job back to the old generation's step or snapshot. So
each record carries the generation that wrote it, and :func:`put_unless_newer` writes with
compare-and-swap on the record it read, refusing when that record is of a newer position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from efdl.errors import StoreError
from efdl.rendezvous.api import Compare, KVStore, Put
from efdl.rendezvous.records import RecordError

log = logging.getLogger(__name__)

# Compare-and-swap attempts before giving up (another writer changed the record each time:
# only a newer generation's writer can, and it then wins anyway).
TRIES = 5

Position = tuple[int, int]  # (generation, step): newer generation first, then newer step


def guarded_put(
    store: KVStore, key: str, position_of: Callable[[bytes, str], Position], what: str
) -> Callable[[bytes], bool]:
    """A writer of records under ``key`` (:func:`put_unless_newer`), each record's position
    read from itself: for efdl.launcher.publish.LatestPublisher."""
    return lambda value: put_unless_newer(
        store, key, value, position_of(value, key), position_of, what
    )


def put_unless_newer(
    store: KVStore,
    key: str,
    value: bytes,
    position: Position,
    position_of: Callable[[bytes, str], Position],
    what: str,
) -> bool:
    """Write ``value`` (at ``position``) under ``key`` unless the record there is of a newer
    position; compare-and-swap on the record read, so that a newer record written meanwhile
    is never overwritten. A record that does not parse is replaced. Returns whether it
    wrote; a refusal is logged once, naming both positions.

    Raises:
        StoreError: etcd failed (the caller retries), or the record kept changing.
    """
    for _ in range(TRIES):
        kv = store.get(key)
        if kv is not None:
            try:
                theirs = position_of(kv.value, key)
            except RecordError as exc:
                log.error("Replacing a bad %s: %s", what, exc)
                theirs = (-1, -1)
            if theirs > position:
                log.warning(
                    "Not publishing the %s of generation %d, step %d: etcd holds one of "
                    "generation %d, step %d (a newer generation replaced this node's).",
                    what,
                    position[0],
                    position[1],
                    theirs[0],
                    theirs[1],
                )
                return False
        same = Compare.absent(key) if kv is None else Compare.mod_revision_is(key, kv.mod_revision)
        if store.txn([same], [Put(key, value)]).succeeded:
            return True
    raise StoreError(f"The {what} at {key} kept changing while it was being published.")
