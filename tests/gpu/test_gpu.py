"""What one GPU can show: NCCL in place at world size 1, several ranks sharing the GPU over
gloo with CUDA tensors through every kind of rescale, CUDA state in rollback and cache
snapshots, and a plain torchrun CUDA script under efdl-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.worker.cache import SnapshotStorage
from tests.e2e.harness import (
    ELASTIC_ARGS,
    SCRIPTS,
    Job,
    alive,
    check_consistent,
    latest_gen,
    pids_of,
    standalone,
    steps_at_world,
    wait_gone,
)
from tests.e2e.test_cache import (
    _complete,
    check_resumed,
    kill_all,
    make_job,
    restart_and_resume,
    wait_persisted,
)
from tests.e2e.test_cache import entries as cache_entries

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent / "scripts"
ON_GPU = {"DEVICE": "cuda", "STEP_SECONDS": "0.1", "MODEL_WIDTH": "256"}


def test_nccl_world_size_1_init_abort_and_reinit_in_place() -> None:
    result = subprocess.run(
        [sys.executable, str(HERE / "nccl_reinit.py")], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    assert report["aborter_done"], "aborting the communicators from a side thread hung"
    assert report["kind"] == "peer", report  # the breaker's abort reads as a lost peer
    assert report["value"] == 2.0  # the new generation's group works
    assert report["verified_before"] == 2  # completed, no error: both steps count
    assert report["torn_after"], report  # enqueued after the failure: counted nowhere
    assert report["stuck_suspect"], report  # still running after the wait: not trusted
    assert report["stuck_wait_s"] < 10, report  # about two steps' time, not the 30 s timeout


def test_plain_torchrun_script_sets_its_device_from_local_rank(tmp_path: Path) -> None:
    result = standalone(
        HERE / "torchrun_cuda.py", "--job-id", "gpu-plain", "--nproc-per-node", "gpu"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "as cuda:0" in result.stdout


def test_in_place_nccl_at_world_size_1_trains_an_epoch(tmp_path: Path) -> None:
    env = {**ON_GPU, "BACKEND": "nccl", "EPOCHS": "1", "OUT_DIR": str(tmp_path)}
    args = ("--job-id", "gpu-nccl", "--nproc-per-node", "1")
    result = standalone(SCRIPTS / "elastic_steps.py", *args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "enter.jsonl").read_text().splitlines()]
    assert rows and all(r["device"] == "cuda:0" for r in rows)


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    # Every agent offers the same single GPU: the ranks share it over gloo.
    args = ["--lease-ttl", "3", *ELASTIC_ARGS, "--gpus", "0"]
    j = Job(tmp_path, etcd_server.endpoint.target, f"gpu-{uuid.uuid4().hex[:8]}", args, ON_GPU)
    yield j
    j.stop()


def test_ranks_sharing_the_gpu_over_gloo_join_leave_and_survive_a_kill(job: Job) -> None:
    job.start("a", script="elastic_steps.py")
    job.start("b", script="elastic_steps.py")
    rows = job.wait_for("two workers", steps_at_world(2), timeout_s=180)
    g2 = latest_gen(rows)
    a_pid = pids_of(rows, "a")

    job.start("c", script="elastic_steps.py")  # a join: a and b rebuild in place
    rows = job.wait_for("three workers", steps_at_world(3, g2), timeout_s=180)
    g3 = latest_gen(rows)
    job.agents["c"].signal(signal.SIGTERM)  # a graceful leave
    assert job.agents["c"].wait(90) == 0
    rows = job.wait_for("back to two", steps_at_world(2, g3), timeout_s=180)
    g4 = latest_gen(rows)

    b_workers = job.agents["b"].worker_pids()
    os.kill(b_workers[0], signal.SIGKILL)  # a worker dies: the survivor keeps its CUDA state
    assert not wait_gone(b_workers[:1], 30)
    rows = job.wait_for("the replacement", steps_at_world(2, g4), timeout_s=180)
    assert pids_of(rows, "a") == a_pid  # never restarted
    assert not alive(b_workers[:1])
    check_consistent(rows)  # bit-identical parameters on every rank at every step
    enters = cache_entries(job)
    assert enters and all(e["device"] == "cuda:0" for e in enters)


def test_an_fsdp2_model_on_the_gpu_grows_and_shrinks_in_place(job: Job) -> None:
    """FSDP2 with CUDA shards (ranks sharing the GPU over gloo): a join spreads the rows over
    three, a graceful leave over two, the survivors never restart, and every step's model and
    optimizer state is the same whatever the layout."""
    script = "fsdp_steps.py"
    job.start("a", script=script)
    job.start("b", script=script)
    rows = job.wait_for("two workers", steps_at_world(2), timeout_s=180)
    g2 = latest_gen(rows)
    a_pid, b_pid = pids_of(rows, "a"), pids_of(rows, "b")
    job.start("c", script=script)
    rows = job.wait_for("three workers", steps_at_world(3, g2), timeout_s=180)
    g3 = latest_gen(rows)
    assert pids_of(rows, "a") == a_pid and pids_of(rows, "b") == b_pid
    job.agents["b"].signal(signal.SIGTERM)
    assert job.agents["b"].wait(90) == 0
    rows = job.wait_for("back to two", steps_at_world(2, g3), timeout_s=180)
    assert pids_of(rows, "a") == a_pid
    assert rows and all(r["device"] == "cuda:0" for r in rows)
    check_consistent(rows)


def test_cuda_state_in_cache_snapshots_is_restored_on_resume(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    url = str(tmp_path / "cache")
    job = make_job(etcd_server, tmp_path, url, {**ON_GPU, "STEP_SECONDS": "0.05"})
    try:
        job.common += ["--gpus", "0"]
        job.start("a", script="elastic_steps.py")
        job.start("b", script="elastic_steps.py")
        wait_persisted(job, SnapshotStorage(url))
        pids = kill_all(job)
        rows = job.events()
        storage = SnapshotStorage(url)
        newest = next(s for s in storage.steps() if _complete(storage, s))
        new = restart_and_resume(job, pids)
        check_resumed(new, rows, newest)
        assert all(e["device"] == "cuda:0" for e in new)
    finally:
        job.stop()


def test_the_replica_digest_on_the_gpu_is_the_cpus() -> None:
    """The sync compares digests computed on each tensor's own device: a CUDA replica and a
    CPU one of the same tensors must agree, and a changed element must show."""
    import torch

    from efdl.worker.digest import digest

    cpu = [torch.randn(3_000_001), torch.randn(64, 33, dtype=torch.bfloat16), torch.arange(7)]
    gpu = [t.cuda() for t in cpu]
    assert digest(gpu) == digest(cpu)
    gpu[0][1_234_567] += 1e-3
    assert digest(gpu) != digest(cpu)


def test_a_stream_in_pinned_memory_from_worker_processes_feeds_the_gpu(tmp_path: Path) -> None:
    """ElasticStream through DataLoader workers with pin_memory: pinned batches, copied to
    the GPU without a wait, and the same rows as the main process reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    import efdl

    for i in range(4):
        ids = pa.array(range(i * 500, (i + 1) * 500), pa.int64())
        x = pa.FixedSizeListArray.from_arrays(
            pa.array([float(v) for v in range(2000)], pa.float32()), 4
        )
        pq.write_table(pa.table({"id": ids, "x": x}), tmp_path / f"{i}.parquet", row_group_size=128)
    rows = []
    for workers in (0, 2):
        stream = efdl.ElasticStream(str(tmp_path), 64, lanes=8, window=32)
        loader = DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=True)
        got = []
        for batch in loader:
            assert batch["x"].is_pinned() and batch["id"].is_pinned()
            x = batch["x"].to("cuda", non_blocking=True)
            got.append(sorted(batch["id"].tolist()))
            assert x.shape[1] == 4
        rows.append(got)
    assert rows[0] == rows[1] and sorted(i for b in rows[0] for i in b) == list(range(2000))


def test_the_stream_example_trains_on_the_gpu(tmp_path: Path) -> None:
    out = standalone(
        Path(__file__).parents[2] / "examples" / "stream" / "train.py",
        "--nproc-per-node",
        "1",
        script_args=["--data", str(tmp_path / "data"), "--epochs", "2"],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("train accuracy") == 2, out.stdout[-2000:]


def test_a_leaving_cuda_worker_gives_its_memory_back_quickly() -> None:
    """A worker that holds 8 GiB of GPU memory and leaves (efdl._process.exit_left) against
    one that ends as Python does: from its last line to the memory being free (NVML)."""
    result = subprocess.run(
        [sys.executable, str(HERE / "cuda_exit.py")], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    assert report["exit_left"]["freed"] and report["python"]["freed"], report
