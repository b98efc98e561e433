"""efdl.ElasticStream under real efdl-run agents: every sample id of every epoch trained once
through a crash, a join and a graceful leave, with DataLoader workers and without."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from tests.e2e.harness import (
    SCRIPTS,
    Job,
    check_consistent,
    in_place_job,
    regrown,
    standalone,
    steps_at_world,
)
from tests.e2e.test_cache import (
    _complete,
    check_resumed,
    make_job,
    restart_and_resume,
    run_and_kill,
)

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).parents[2]

# Uneven files, small row groups: lanes begin and end inside files and row groups.
FILE_ROWS = (130, 7, 301, 64, 222, 95, 141)  # 960 rows: 60 steps of 16 per epoch


def write_shards(folder: Path) -> int:
    folder.mkdir()
    first = 0
    for i, n in enumerate(FILE_ROWS):
        ids = pa.array(range(first, first + n), pa.int64())
        x = pa.array(
            [[float(v % 7)] * 4 for v in range(first, first + n)], pa.list_(pa.float32(), 4)
        )
        pq.write_table(
            pa.table({"id": ids, "x": x}), folder / f"part-{i:03d}.parquet", row_group_size=50
        )
        first += n
    return first


@pytest.fixture(autouse=True)
def windows_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader workers' windows (efdl.data.exchange) in the test's folder: a rank the test
    kills leaves its iteration's directory behind."""
    monkeypatch.setenv("EFDL_DATA_SHM", str(tmp_path / "shm"))


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = in_place_job(tmp_path, etcd_server.endpoint.target, "stream")
    yield j
    j.stop()


def committed(rows: list[dict[str, object]]) -> dict[tuple[int, int], list[dict[str, object]]]:
    """Each (epoch, step)'s rows from the last generation that trained it (a step a crash
    cut short is trained again in the next one)."""
    last: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (int(r["epoch"]), int(r["step"]))  # type: ignore[call-overload]
        last[key] = max(last.get(key, 0), int(r["gen"]))  # type: ignore[call-overload]
    out: dict[tuple[int, int], list[dict[str, object]]] = {}
    for r in rows:
        key = (int(r["epoch"]), int(r["step"]))  # type: ignore[call-overload]
        if int(r["gen"]) == last[key]:  # type: ignore[call-overload]
            out.setdefault(key, []).append(r)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_once_per_epoch_through_a_crash_a_join_and_a_leave(
    job: Job, tmp_path: Path, workers: int
) -> None:
    total = write_shards(tmp_path / "data")
    job.env.update(
        STREAM=str(tmp_path / "data"),
        NUM_WORKERS=str(workers),
        GLOBAL_BATCH="16",
        LANES="8",
        WINDOW="32",
        EPOCHS="1000",
        FAIL_AT="1:20",  # rank 1 crashes at step 20; its agent replaces it
        STEP_SECONDS="0.05",
    )
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    job.wait_for("the crashed worker's replacement training", regrown(2))
    job.start("c", script="elastic_steps.py")
    job.wait_for("three workers", steps_at_world(3))
    job.agents["c"].signal(signal.SIGTERM)  # a graceful leave
    assert job.agents["c"].wait(60) == 0, job.agents["c"].output()[-2000:]
    rows = job.wait_for(
        "back to two",
        steps_at_world(2, max(int(r["gen"]) for r in job.events() if r["world"] == 3)),
    )  # type: ignore[call-overload]
    last_event_epoch = max(int(r["epoch"]) for r in rows)  # type: ignore[call-overload]
    rows = job.wait_for(
        "the epoch after the leave to end",
        lambda rows: any(int(r["epoch"]) > last_event_epoch + 1 for r in rows),  # type: ignore[call-overload]
    )
    steps = committed(rows)
    worlds_in_epoch: dict[int, set[int]] = {}
    for epoch in range(last_event_epoch + 2):
        seen: Counter[int] = Counter()
        for (e, _), rs in steps.items():
            if e == epoch:
                for r in rs:
                    seen.update(int(i) for i in r["samples"])  # type: ignore[attr-defined]
                    worlds_in_epoch.setdefault(e, set()).add(int(r["world"]))  # type: ignore[call-overload]
        repeated = {i: n for i, n in seen.items() if n > 1}
        assert sorted(seen) == list(range(total)), f"epoch {epoch}: {total - len(seen)} skipped"
        assert not repeated, f"epoch {epoch}: repeated {repeated}"
    assert any(len(w) > 1 for w in worlds_in_epoch.values()), "no rescale inside an epoch"
    check_consistent(rows)


def test_a_job_resumed_from_the_cache_trains_the_same_batches_from_its_snapshot(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Every agent killed: the stream's position came back with the snapshot, so each step
    after it trains the global batch the lost run trained at that step."""
    write_shards(tmp_path / "data")
    url = str(tmp_path / "cache")
    env = {"STREAM": str(tmp_path / "data"), "GLOBAL_BATCH": "16", "LANES": "8", "WINDOW": "32"}
    job = make_job(etcd_server, tmp_path, url, env)
    try:
        storage, rows, pids = run_and_kill(job, url)
        step = next(s for s in storage.steps() if _complete(storage, s))
        new = restart_and_resume(job, pids)
        check_resumed(new, rows, step)
        job.wait_for(
            "ten steps after the snapshot",
            lambda rs: sum(1 for r in rs if r["pid"] not in pids and r["rank"] == 0) >= 10,
        )
        batches: dict[tuple[object, object], dict[bool, set[int]]] = {}
        for r in job.events():
            by_run = batches.setdefault((r["epoch"], r["step"]), {})
            by_run.setdefault(r["pid"] in pids, set()).update(r["samples"])  # type: ignore[arg-type]
        again = [key for key, runs in batches.items() if len(runs) == 2]
        assert again, "no step trained by both runs"
        for key in again:
            assert batches[key][True] == batches[key][False], key
    finally:
        job.stop()


def test_the_stream_example_writes_its_data_and_trains(tmp_path: Path) -> None:
    out = standalone(
        ROOT / "examples" / "stream" / "train.py",
        "--nproc-per-node",
        "2",
        script_args=["--data", str(tmp_path / "data"), "--epochs", "2", "--workers", "1"],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(list((tmp_path / "data").glob("part-*.parquet"))) == 16
    accuracy = [
        float(line.split("accuracy ")[1].split()[0])
        for line in out.stdout.splitlines()
        if "train accuracy" in line
    ]
    assert len(accuracy) == 2 and accuracy[1] > accuracy[0], out.stdout[-2000:]


def test_a_plain_torchrun_script_resumes_the_stream_from_its_checkpoint(tmp_path: Path) -> None:
    """Restart mode: a worker crash restarts both workers, which load the stream's position
    from the script's checkpoint; each epoch's rows once (the last try of each step)."""
    total = write_shards(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    env = {"STREAM": str(tmp_path / "data"), "OUT_DIR": str(out), "FAIL_AT": "1:25"}
    run = standalone(
        SCRIPTS / "stream_restart.py", "--nproc-per-node", "2", "--max-restarts", "2", env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert {r["restart"] for r in rows} == {0, 1}, "no restart"
    last: dict[tuple[int, int, int], dict[str, object]] = {}
    for r in rows:  # the last try of each (epoch, step, rank)
        last[(r["epoch"], r["step"], r["rank"])] = r
    for epoch in range(2):
        seen = Counter(i for (e, _, _), r in last.items() if e == epoch for i in r["samples"])  # type: ignore[attr-defined]
        assert sorted(seen) == list(range(total)) and max(seen.values()) == 1, epoch
