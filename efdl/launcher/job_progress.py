"""What a node knows of its job's progress and cache records, and their publication.

The job's newest committed step (generation, step) and its newest snapshot in the cache are
read from etcd (at each round, and at the join) and moved on by this node's own workers
(their agreed commits, their persisted snapshots). Both records are written by
:class:`LatestPublisher` threads, off the agent's loop, and only over older ones: a
generation replaced while cut off from etcd publishes nothing over its successor's
(efdl.rendezvous.outputs). When etcd forgets what it held, this node publishes its view of
both again, so that the node that knows most wins.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from efdl.errors import StoreError
from efdl.launcher.publish import LatestPublisher
from efdl.protocol.messages import Persisted
from efdl.rendezvous.api import KVStore
from efdl.rendezvous.outputs import Position, guarded_put
from efdl.rendezvous.records import CacheRecord, JobKeys, Progress, RecordError

log = logging.getLogger(__name__)


def _position(record: type[CacheRecord] | type[Progress]) -> Callable[[bytes, str], Position]:
    """Where a record of this kind stands: (generation, step)."""
    return lambda raw, key: record.from_json(raw, key).position


class JobProgress:
    """This node's view of the job's progress and cache records, and their publishers.

    Args:
        store: the etcd store.
        job_id: the job.
        tag: says the job, node and generation, for the log.
    """

    def __init__(self, store: KVStore, job_id: str, tag: Callable[[], str]) -> None:
        self._store = store
        self._keys = JobKeys(job_id)
        self._tag = tag
        # The job's newest committed step: what this node knows of it (etcd's progress
        # record, read at each round, and its own workers' commits), and, while this node
        # runs rank 0, its publication (see Progress).
        self.position: Position = (0, 0)
        self.cache: CacheRecord | None = None  # the newest cache record this node knows
        self._cache_out = LatestPublisher(
            guarded_put(store, self._keys.cache, _position(CacheRecord), "cache record"),
            "cache record",
        )
        self._progress_out = LatestPublisher(
            guarded_put(store, self._keys.progress, _position(Progress), "progress record"),
            "progress record",
        )

    def agreed(self, generation: int, step: int, publish: bool) -> None:
        """Every rank of ``generation`` committed ``step`` (from a channel thread); ``publish``:
        this node runs rank 0, whose agent writes the job's progress record."""
        self.position = max(self.position, (generation, step))
        if publish:
            self._progress_out.offer(Progress(step, generation, time.time()).to_json())

    def persisted(self, ev: Persisted, url: str) -> CacheRecord:
        """This node's workers persisted a snapshot into the cache at ``url``: publish it."""
        record = CacheRecord(ev.step, ev.epoch, ev.world_size, url, time.time(), ev.generation)
        self.cache = record
        self._cache_out.offer(record.to_json())
        return record

    def read(self) -> None:
        """Learn the job's newest committed step from etcd (a node that joins a job that
        trained, or that runs a generation made of newcomers only); kept if etcd fails."""
        key = self._keys.progress
        try:
            kv = self._store.get(key)
        except StoreError as exc:
            log.warning("%s: could not read the job's progress record: %s", self._tag(), exc)
            return
        if kv is None:
            return
        try:
            position = Progress.from_json(kv.value, key).position
        except RecordError as exc:
            log.error("%s: ignoring a bad progress record: %s", self._tag(), exc)
            return
        self.position = max(self.position, position)

    def read_cache(self, url: str) -> None:
        """Learn the job's newest snapshot from etcd, and say whether this job starts cold or
        resumes from its cache (at ``url``)."""
        key = self._keys.cache
        try:
            kv = self._store.get(key)
        except StoreError as exc:
            log.warning("%s: could not read the cache record: %s", self._tag(), exc)
            return
        record = None
        if kv is not None:
            try:
                record = CacheRecord.from_json(kv.value, key)
            except RecordError as exc:
                log.error("%s: ignoring a bad cache record: %s", self._tag(), exc)
        self.cache = record
        if record is None:
            log.info("%s: no snapshot published for this job yet (cache %s).", self._tag(), url)
        else:
            log.info(
                "%s: the job's newest snapshot is step %d (epoch %s, world size %d) in %s; "
                "a job with no live member resumes from it.",
                self._tag(),
                record.step,
                record.epoch,
                record.world_size,
                record.url,
            )

    def publish_again(self) -> None:
        """etcd forgot what it held (from the rendezvous thread): publish the job's progress
        and cache records again from what this node knows of them (each written only over an
        older one, so the node that knows most wins), lest a job restarted later start over
        from step 0, or ignore its cache, without a word."""
        generation, step = self.position
        if step > 0:
            self._progress_out.offer(Progress(step, generation, time.time()).to_json())
        cache = self.cache
        if cache is not None:
            self._cache_out.offer(cache.to_json())
        log.warning(
            "%s: etcd forgot what it held; published this node's view of the job again "
            "(progress: generation %d, step %d; cache: %s).",
            self._tag(),
            generation,
            step,
            f"step {cache.step}" if cache is not None else "none known",
        )

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop publishing; wait up to ``timeout_s`` for each put under way."""
        self._cache_out.close(timeout_s=timeout_s)
        self._progress_out.close(timeout_s=timeout_s)
