"""The job's shared records (progress, cache) are written only over older ones, with
compare-and-swap: a generation that was replaced while cut off from etcd cannot take the job
back when it reaches etcd again. Against the in-memory store and a real etcd."""

from __future__ import annotations

import time

from efdl.rendezvous.api import KVStore
from efdl.rendezvous.outputs import put_unless_newer
from efdl.rendezvous.records import CacheRecord, JobKeys, Progress


def publish(store: KVStore, key: str, generation: int, step: int) -> bool:
    value = Progress(step, generation, time.time()).to_json()
    return put_unless_newer(
        store,
        key,
        value,
        (generation, step),
        lambda raw, k: Progress.from_json(raw, k).position,
        "progress record",
    )


def read(store: KVStore, key: str) -> tuple[int, int]:
    kv = store.get(key)
    assert kv is not None
    return Progress.from_json(kv.value, key).position


def test_an_older_generation_never_overwrites_a_newer_ones_progress(
    store: KVStore, prefix: str
) -> None:
    key = JobKeys("j").progress.replace("/efdl/", prefix)
    assert publish(store, key, 5, 100)  # absent: written
    assert publish(store, key, 5, 101)  # the same generation, further: written
    assert not publish(store, key, 4, 900)  # an older generation, whatever its step: refused
    assert read(store, key) == (5, 101)
    assert publish(store, key, 6, 40)  # a newer generation (resumed from an older snapshot)
    assert not publish(store, key, 5, 120)
    assert read(store, key) == (6, 40)


def test_a_bad_record_is_replaced_and_the_cache_record_is_kept_the_same_way(
    store: KVStore, prefix: str
) -> None:
    key = prefix + "progress"
    store.put(key, b"not json")
    assert publish(store, key, 1, 3)
    assert read(store, key) == (1, 3)

    cache_key = prefix + "cache"

    def cache(generation: int, step: int) -> bool:
        record = CacheRecord(step, None, 2, "file:///c", time.time(), generation)
        return put_unless_newer(
            store,
            cache_key,
            record.to_json(),
            record.position,
            lambda raw, k: CacheRecord.from_json(raw, k).position,
            "cache record",
        )

    assert cache(7, 500) and not cache(6, 900) and cache(8, 100)
    kv = store.get(cache_key)
    assert kv is not None and CacheRecord.from_json(kv.value, cache_key).position == (8, 100)
