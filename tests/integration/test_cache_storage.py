"""The remote cache's snapshots, on a local directory, fsspec's memory:// and real S3 (moto's
server on 127.0.0.1, through s3fs), written as ranks write them (every rank its parts, rank 0
the structure and, once every rank reported, the manifest): complete snapshots only,
corruption skipped with the file named, hostile files refused, old snapshots pruned,
background writes consistent, and a snapshot resumed by a different number of ranks."""

from __future__ import annotations

import json
import logging
import pickle
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from efdl.worker.cache import (
    MANIFEST,
    STATE,
    CacheSettings,
    FileInfo,
    Manifest,
    SnapshotError,
    SnapshotStorage,
    digest,
)
from efdl.worker.persist import Persister
from efdl.worker.rng import rng_state
from tests.integration.ranks import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "resume_state.py"


@pytest.fixture(params=["local", "memory", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "cache")
    if request.param == "memory":
        return f"memory://efdl-{uuid.uuid4().hex[:8]}/job"
    return str(request.getfixturevalue("s3_bucket")) + "/jobs/a"


def tree_at(step: int) -> dict[str, Any]:
    """A state tree of three tensors (12 KiB, 4 KiB, 4 B) and some plain values."""
    return {
        "model": {"w": torch.full((3072,), float(step)), "b": torch.full((1024,), -float(step))},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": []},
        "step": step,
        "values": {"epoch": step // 10},
    }


def persist(
    url: str,
    step: int,
    world: int = 2,
    part_bytes: int = 8192,
    attempt: int = 1,
    generation: int = 0,
) -> Manifest:
    """Snapshot ``step`` as ``world`` ranks of ``generation`` write it (one Persister per rank:
    their reports meet on storage, as the ranks' do); the manifest rank 0 wrote."""
    done: list[Manifest] = []
    writers = [Persister(CacheSettings(url), part_bytes) for _ in range(world)]
    for rank in range(world - 1, -1, -1):  # rank 0 last: it waits for the others' reports
        own = {"rng": rng_state()}
        tree = tree_at(step)
        writers[rank].start(
            step, step // 10, rank, world, tree, set(), own, done.append, attempt, generation
        )
    for w in writers:
        assert w.flush(60)
    assert len(done) == 1
    return done[0]


def corrupt(storage: SnapshotStorage, step: int, name: str, how: str) -> str:
    path = storage.path(step, name)
    data = bytearray(storage.fs.cat_file(path))
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 2]
    if how == "delete":
        storage.fs.rm(path)
    else:
        storage.fs.pipe_file(path, bytes(data))
    return path


def test_the_ranks_write_their_parts_and_the_newest_snapshot_reads_back_whole(url: str) -> None:
    storage = SnapshotStorage(url)
    assert storage.newest() is None  # a cold start
    persist(url, 10)
    written = persist(url, 20)
    found = storage.newest()
    assert found is not None
    m, state = found
    assert m == written and m.step == 20 and m.epoch == 2 and m.world_size == 2
    assert m.torch_version == torch.__version__ and m.efdl_version
    for key, value in tree_at(20)["model"].items():
        assert torch.equal(state["model"][key], value)
    assert state["values"] == {"epoch": 2} and state["step"] == 20
    raw = json.loads(storage.fs.cat_file(storage.path(20, MANIFEST)))
    parts = sorted(n for n in raw["files"] if n.startswith("part-"))
    assert parts == ["part-00000.pt", "part-00001.pt", "part-00002.pt"]  # 4 KiB, 12 KiB, 4 B
    assert {STATE, "rank-00000.pt", "rank-00001.pt"} <= set(raw["files"])
    assert all(len(f["xxh3_128"]) == 32 and f["size"] > 0 for f in raw["files"].values())


def test_a_snapshot_without_its_manifest_does_not_exist(url: str) -> None:
    storage = SnapshotStorage(url)
    persist(url, 10)
    storage.write(20, STATE, {"tree": {}, "parts": {}})  # the writers died before the rest
    found = storage.newest()
    assert found is not None and found[0].step == 10


def test_rank_0_writes_no_manifest_while_a_rank_has_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("efdl.worker.persist.REPORT_WAIT_S", 0.5)
    url = str(tmp_path / "cache")
    writer = Persister(CacheSettings(url), 8192)
    published: list[Manifest] = []
    own = {"rng": rng_state()}
    with caplog.at_level(logging.WARNING):
        writer.start(30, 3, 0, 2, tree_at(30), set(), own, published.append)  # rank 1 is gone
        assert writer.flush(30)
    assert not published and SnapshotStorage(url).newest() is None
    assert "rank(s) 1 did not report" in caplog.text


def test_a_crashed_attempts_leftovers_are_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run crashed while persisting steps 30 and 40: rank 1 had written and reported its
    parts (of a state unlike the resumed run's), rank 0 no manifest. The resumed run reaches
    step 30 again: its rank 0 does not take the old report for its rank 1's (that would make a
    snapshot of two states), and once the snapshot is whole the leftovers are gone."""
    monkeypatch.setattr("efdl.worker.persist.REPORT_WAIT_S", 0.5)
    url = str(tmp_path / "cache")
    storage = SnapshotStorage(url)
    own = {"rng": rng_state()}
    for step in (30, 40):  # the crashed attempt: rank 1 only
        crashed = Persister(CacheSettings(url), 8192)
        crashed.start(step, 3, 1, 2, tree_at(999), set(), own, lambda m: None, 111)
        assert crashed.flush(30)
    assert storage.reporters(30) == {1} and storage.reported(30, 1, 111) is not None
    assert storage.reported(30, 1, 222) is None  # another attempt's: not there
    rank0 = Persister(CacheSettings(url), 8192)
    published: list[Manifest] = []
    with caplog.at_level(logging.WARNING):  # the new attempt's rank 1 has not written yet
        rank0.start(30, 3, 0, 2, tree_at(30), set(), own, published.append, 222)
        assert rank0.flush(30)
    assert not published and "rank(s) 1 did not report" in caplog.text
    m = persist(url, 30, attempt=333)  # both ranks of the resumed run
    found = storage.newest()
    assert found is not None and found[0] == m
    assert torch.equal(found[1]["model"]["w"], tree_at(30)["model"]["w"])
    assert storage.steps() == [30]  # the crashed attempt's step 40 went


@pytest.mark.parametrize(
    ("name", "how"),
    [
        (STATE, "flip"),
        (STATE, "truncate"),
        ("part-00001.pt", "flip"),
        ("rank-00001.pt", "flip"),
        ("part-00000.pt", "delete"),
    ],
)
def test_a_corrupt_snapshot_is_skipped_naming_the_file(
    url: str, name: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = SnapshotStorage(url)
    persist(url, 10)
    persist(url, 20)
    path = corrupt(storage, 20, name, how)
    with caplog.at_level(logging.WARNING):
        found = storage.newest()
    assert found is not None and found[0].step == 10
    assert path in caplog.text and "step 20" in caplog.text


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"step": "20"}, "'step'"),
        ({"files": {"../../etc/passwd": {"size": 1, "xxh3_128": "0" * 32}}}, "unexpected file"),
        ({"files": {STATE: {"size": 1, "xxh3_128": "nothex"}}}, "malformed xxh3_128"),
        ({"files": {STATE: {"size": -1, "xxh3_128": "0" * 32}}}, r"field .size. is -1; expected 0"),
        ({"files": {STATE: 5}}, r"\(file 'state.pt'\) must be a JSON object, not int"),
        ({"files": {}}, "lists no state.pt"),
        ({"format": 1}, "has format 1, not 2"),
        ({"world_size": 0}, r"field .world_size. is 0; expected 1\.\."),
        ({"step": True}, r"field .step. is True; expected int"),
        ({"epoch": "3"}, r"field .epoch. is .3.; expected int\."),
    ],
)
def test_a_hostile_manifest_is_rejected_by_name(
    tmp_path: Path, patch: dict[str, object], message: str
) -> None:
    storage = SnapshotStorage(str(tmp_path))
    m = persist(str(tmp_path), 20)
    data = json.loads(m.to_json())
    data.update(patch)
    storage.fs.pipe_file(storage.path(20, MANIFEST), json.dumps(data).encode())
    with pytest.raises(SnapshotError, match=message):
        storage.manifest(20)
    storage.fs.pipe_file(storage.path(20, MANIFEST), b"{not json")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        storage.manifest(20)


def test_a_structure_that_misplaces_a_tensor_is_rejected(tmp_path: Path) -> None:
    storage = SnapshotStorage(str(tmp_path))
    m = persist(str(tmp_path), 20)
    state = storage.read(m, STATE)
    del state["parts"]["['model']['w']"]
    files = dict(m.files)
    files[STATE] = storage.write(20, STATE, state)
    storage.commit(Manifest(20, 2, 2, files))
    with pytest.raises(SnapshotError, match=r"tensor \['model'\]\['w'\] is in no part"):
        storage.structure(storage.manifest(20))


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ({"['model']['w']": ["part-00000.pt"]}, "each of its 2 ranks' rows"),  # one rank's
        ({"['model']['w']": "part-00000.pt"}, "each of its 2 ranks' rows"),
        ({"['model']['w']": ["part-00000.pt", "part-00099.pt"]}, "lacks: ['part-00099.pt']"),
    ],
)
def test_a_structure_with_a_bad_map_of_rows_is_rejected(
    tmp_path: Path, rows: object, expected: str
) -> None:
    storage = SnapshotStorage(str(tmp_path))
    m = persist(str(tmp_path), 20)
    state = storage.read(m, STATE)
    state["rows"] = rows
    files = dict(m.files)
    files[STATE] = storage.write(20, STATE, state)
    storage.commit(Manifest(20, 2, 2, files))
    with pytest.raises(SnapshotError, match=re.escape(expected)):
        storage.structure(storage.manifest(20))


class Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_a_snapshot_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    storage = SnapshotStorage(str(tmp_path))
    m = persist(str(tmp_path), 20)
    evil = pickle.dumps({"tree": Boom()})
    path = Path(storage.path(20, STATE))
    path.write_bytes(evil)  # and a manifest that matches it: the digest is not the defence
    files = dict(m.files)
    files[STATE] = FileInfo(len(evil), digest(evil))
    storage.commit(Manifest(20, 2, 2, files))
    with pytest.raises(SnapshotError, match="cannot be loaded"):
        storage.read(storage.manifest(20), STATE)


def test_only_the_last_k_snapshots_are_kept(url: str) -> None:
    storage = SnapshotStorage(url)
    for step in (10, 20, 30, 40):
        persist(url, step)
    storage.write(50, STATE, {"tree": {}})  # being written: not counted, not deleted
    storage.prune(keep=2)
    assert storage.steps() == [50, 40, 30]


def test_a_newer_generations_snapshot_wins_over_an_older_ones_higher_step(url: str) -> None:
    """Generation 5 trained on to step 60 while cut off from etcd; generation 6 went on from
    step 40 and wrote step 50. The job's line is generation 6's: it is the newest snapshot,
    and the one pruning keeps (each writing keeps the newest two: step 40 went, not 50)."""
    storage = SnapshotStorage(url)
    persist(url, 40, generation=5)
    persist(url, 60, generation=5)
    persist(url, 50, generation=6)
    assert [m.position for m in storage.manifests()] == [(6, 50), (5, 60)]
    found = storage.newest()
    assert found is not None and found[0].position == (6, 50)
    newest = storage.newest_structure(above=(5, 60))
    assert newest is not None and newest.manifest.step == 50
    assert storage.newest_structure(above=(6, 50)) is None
    storage.prune(keep=1)
    assert storage.steps() == [50]


def test_a_bad_cache_url_is_a_clear_error() -> None:
    from efdl.errors import ConfigError

    with pytest.raises(ConfigError, match="nosuchproto://x"):
        SnapshotStorage("nosuchproto://x")


def test_a_usable_cache_passes_its_check_and_keeps_no_probe(url: str) -> None:
    storage = SnapshotStorage(url)
    storage.check()
    storage.fs.invalidate_cache()
    assert storage.fs.find(storage.root) == []


def test_a_cache_path_that_cannot_be_made_is_one_sentence(tmp_path: Path) -> None:
    from efdl.errors import ConfigError

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"'.*/file/cache' cannot be used: its directory cannot"):
        SnapshotStorage(str(tmp_path / "file" / "cache"))


def test_a_bucket_without_credentials_or_that_does_not_exist_fails_its_check(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import s3fs  # type: ignore[import-untyped]

    from efdl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'s3://efdl-none-\w+/job' cannot be used: .*probe"):
        SnapshotStorage(f"s3://efdl-none-{uuid.uuid4().hex[:8]}/job").check()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError, match=r"cannot be used: .*NoCredentialsError.*credentials"):
        SnapshotStorage(s3_bucket + "/job").check()
    s3fs.S3FileSystem.clear_instance_cache()


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
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "values": {}}
    buffers = {f"['model']['{n}']" for n, _ in model.named_buffers()}
    published: list[Manifest] = []
    p.start(7, 0, 0, 1, tree, buffers, {"rng": rng_state()}, published.append)
    model(torch.randn(8, 256)).sum().backward()  # changes BatchNorm statistics at once
    opt.step()  # waits for the copy, then changes the parameters
    assert p.flush(30)
    assert [m.step for m in published] == [7] and p.last_persisted == 7
    found = p.storage.newest()
    assert found is not None
    for key, value in expected.items():
        assert torch.equal(found[1]["model"][key], value), key
    assert not p.due(7) and p.due(8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("holder", "job", "expected"),
    [
        (30, 45, 40),  # a stale holder behind the job: the cache's newer snapshot is taken
        (45, 60, None),  # nothing newer than the holder anywhere: the job stops, naming both
        (50, 50, 50),  # a holder at the job's step: it sends, the cache is not read
    ],
)
def test_a_stale_holder_never_rolls_the_job_back(
    tmp_path: Path, holder: int, job: int, expected: int | None
) -> None:
    """The ranks that trained the job to step ``job`` are gone; rank 0 survives holding step
    ``holder``, rank 1 is new. The cache holds step 40."""
    url = str(tmp_path / "cache")
    persist(url, 40, world=2, part_bytes=4096)
    env = {
        "EFDL_CACHE_URL": url,
        "RESUME_HOLDER_STEP": str(holder),
        "RESUME_JOB_STEP": str(job),
    }
    args = [[str(r), "2", str(tmp_path / "storage")] for r in range(2)]
    results = [json.loads(t.strip().splitlines()[-1]) for t in run_ranks(SCRIPT, args, env)]
    for r in results:
        if expected is None:
            assert f"it had committed step {job}" in r["error"], r
            assert f"step {holder} of generation 0" in r["error"], r
        else:
            assert r["step"] == expected, r
            assert r["w"] == float(3072 * expected), r


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
def test_ranks_resume_a_snapshot_of_another_world_size_reading_it_between_them(
    tmp_path: Path, world: int
) -> None:
    """Written by 2 ranks in 3 parts, resumed by ``world`` ranks (real gloo processes, every
    one a newcomer): each reads some parts and sends them to the others."""
    url = str(tmp_path / "cache")
    persist(url, 40, world=2, part_bytes=4096)
    persist(url, 50, world=2, part_bytes=4096)
    corrupt(SnapshotStorage(url), 50, "part-00001.pt", "flip")  # the newest is broken
    m = SnapshotStorage(url).manifest(40)
    assert len([n for n in m.files if n.startswith("part-")]) == 3
    env = {"EFDL_CACHE_URL": url, "EFDL_SYNC_BUCKET_MB": "0.002"}
    args = [[str(r), str(world), str(tmp_path / "storage")] for r in range(world)]
    outputs = run_ranks(SCRIPT, args, env)
    results = [json.loads(text.strip().splitlines()[-1]) for text in outputs]
    want = tree_at(40)["model"]
    for r in results:
        assert r["step"] == 40 and r["epoch"] == 4
        assert r["w"] == float(want["w"].sum()) and r["b"] == float(want["b"].sum())
    received = [r["received"] for r in results]
    whole = 4 * (3072 + 1024 + 1)
    if world > 1:  # everyone read some, and received the rest
        assert all(0 < n < whole for n in received), received
    else:
        assert received == [0]
    assert "part-00001.pt" in "".join(outputs)  # the broken newest one, named
