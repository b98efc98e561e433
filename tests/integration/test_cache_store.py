"""The remote cache's snapshot store, on a local directory, fsspec's memory:// and real S3
(moto's server on 127.0.0.1, through s3fs): complete snapshots only, corruption skipped with
the file named, hostile files refused, old snapshots pruned, background writes consistent."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import uuid
from pathlib import Path

import pytest
import torch

from efdl.state.cache import (
    MANIFEST,
    STATE,
    CacheSettings,
    FileInfo,
    Manifest,
    SnapshotError,
    SnapshotStore,
    rank_file,
)
from efdl.state.persist import Persister


@pytest.fixture(params=["local", "memory", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "cache")
    if request.param == "memory":
        return f"memory://efdl-{uuid.uuid4().hex[:8]}/job"
    return str(request.getfixturevalue("s3_bucket")) + "/jobs/a"


def snapshot(store: SnapshotStore, step: int, world: int = 2) -> Manifest:
    """A snapshot as rank 0 and the others write it."""
    files = {
        STATE: store.write(step, STATE, {"model": {"w": torch.full((4,), float(step))}}),
    }
    for r in range(world):
        files[rank_file(r)] = store.write(step, rank_file(r), {"rng": torch.get_rng_state()})
    m = Manifest(step, step // 10, world, files)
    store.commit(m)
    return m


def corrupt(store: SnapshotStore, step: int, name: str, how: str) -> str:
    path = store.path(step, name)
    data = bytearray(store.fs.cat_file(path))
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 2]
    if how == "delete":
        store.fs.rm(path)
    else:
        store.fs.pipe_file(path, bytes(data))
    return path


def test_the_newest_complete_snapshot_is_restored_with_its_manifest(url: str) -> None:
    store = SnapshotStore(url)
    assert store.newest() is None  # a cold start
    snapshot(store, 10)
    written = snapshot(store, 20)
    found = store.newest()
    assert found is not None
    m, state = found
    assert m == written and m.step == 20 and m.epoch == 2 and m.world_size == 2
    assert m.torch_version == torch.__version__ and m.efdl_version
    assert torch.equal(state["model"]["w"], torch.full((4,), 20.0))
    raw = json.loads(store.fs.cat_file(store.path(20, MANIFEST)))
    assert set(raw["files"]) == {STATE, "rank-00000.pt", "rank-00001.pt"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in raw["files"].values())


def test_a_snapshot_without_its_manifest_does_not_exist(url: str) -> None:
    store = SnapshotStore(url)
    snapshot(store, 10)
    store.write(20, STATE, {"model": {"w": torch.zeros(4)}})  # the writer died before the rest
    found = store.newest()
    assert found is not None and found[0].step == 10


@pytest.mark.parametrize(
    ("name", "how"),
    [(STATE, "flip"), (STATE, "truncate"), ("rank-00001.pt", "flip"), ("rank-00000.pt", "delete")],
)
def test_a_corrupt_snapshot_is_skipped_naming_the_file(
    url: str, name: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = SnapshotStore(url)
    snapshot(store, 10)
    snapshot(store, 20)
    path = corrupt(store, 20, name, how)
    with caplog.at_level(logging.WARNING):
        found = store.newest()
    assert found is not None and found[0].step == 10
    assert path in caplog.text and "step 20" in caplog.text


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"step": "20"}, "'step'"),
        ({"files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}}, "unexpected file"),
        ({"files": {STATE: {"size": 1, "sha256": "nothex"}}}, "malformed sha256"),
        ({"files": {}}, "lists no state.pt"),
        ({"format": 99}, "format 99"),
        ({"world_size": 0}, "out of range"),
    ],
)
def test_a_hostile_manifest_is_rejected_by_name(
    tmp_path: Path, patch: dict[str, object], message: str
) -> None:
    store = SnapshotStore(str(tmp_path))
    m = snapshot(store, 20)
    data = json.loads(m.to_json())
    data.update(patch)
    store.fs.pipe_file(store.path(20, MANIFEST), json.dumps(data).encode())
    with pytest.raises(SnapshotError, match=message):
        store.manifest(20)
    store.fs.pipe_file(store.path(20, MANIFEST), b"{not json")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        store.manifest(20)


class Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_a_snapshot_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    m = snapshot(store, 20)
    evil = pickle.dumps({"model": Boom()})
    path = Path(store.path(20, STATE))
    path.write_bytes(evil)  # and a manifest that matches it: the checksum is not the defence
    files = dict(m.files)
    files[STATE] = FileInfo(len(evil), hashlib.sha256(evil).hexdigest())
    store.commit(Manifest(20, 2, 2, files))
    with pytest.raises(SnapshotError, match="cannot be loaded"):
        store.read(store.manifest(20), STATE)


def test_only_the_last_k_snapshots_are_kept(url: str) -> None:
    store = SnapshotStore(url)
    for step in (10, 20, 30, 40):
        snapshot(store, step)
    store.write(50, STATE, {"model": {}})  # being written: not counted, not deleted
    store.prune(keep=2)
    assert store.steps() == [50, 40, 30]


def test_a_bad_cache_url_is_a_clear_error() -> None:
    from efdl.errors import ConfigError

    with pytest.raises(ConfigError, match="nosuchproto://x"):
        SnapshotStore("nosuchproto://x")


def test_the_background_writer_persists_the_state_of_its_commit(url: str) -> None:
    """The copy is made in the background, but the optimizer's next step waits for it: what
    is written is the state at the commit, not what the training did after."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    p = Persister(CacheSettings(url, every_steps=1, every_s=0, keep=2))
    opt.register_step_pre_hook(lambda *_: p.fence())
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    buffers = {f"/model/{n}" for n, _ in model.named_buffers()}
    published: list[Manifest] = []
    p.start(
        7, 0, 1, 0, tree, buffers, {"rng": torch.get_rng_state()}, lambda *_: {}, published.append
    )
    model(torch.randn(8, 256)).sum().backward()  # changes BatchNorm statistics at once
    opt.step()  # waits for the copy, then changes the parameters
    assert p.flush(30)
    assert [m.step for m in published] == [7] and p.last_persisted == 7
    found = p.store.newest()
    assert found is not None
    for key, value in expected.items():
        assert torch.equal(found[1]["model"][key], value), key
    assert not p.due(7) and p.due(8)
