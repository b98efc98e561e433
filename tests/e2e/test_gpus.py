"""The device contract with real efdl-run processes on a host whose GPUs a stand-in NVML
reports (tests/fakes/pynvml.py first on PYTHONPATH): each worker's ``cuda:LOCAL_RANK`` is the
GPU the agent gave it, as torchrun's contract says."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import EFDL_RUN, SCRIPTS

pytestmark = pytest.mark.timeout(180)
FAKES = Path(__file__).parents[1] / "fakes"
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(8)]
BUSY = (0, 1, 4)
NVML = json.dumps([{"uuid": u, "processes": int(i in BUSY)} for i, u in enumerate(UUIDS)])
SCRIPT = (
    "import json, os\n"
    "keys = ['CUDA_VISIBLE_DEVICES', 'LOCAL_RANK', 'EFDL_CUDA_DEVICE', 'CUDA_DEVICE_ORDER',\n"
    "        'TORCH_NCCL_ASYNC_ERROR_HANDLING', 'EFDL_LOCAL_RANK']\n"
    "print(json.dumps({k: os.environ.get(k) for k in keys}))\n"
)


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    script = tmp_path / "gpu_env.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    path = os.pathsep.join(p for p in (str(FAKES), base.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [*EFDL_RUN, "--standalone", "--job-id", "gpus", *args, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        env={**base, "PYTHONPATH": path, "EFDL_FAKE_NVML": NVML, **(env or {})},
    )
    return result.returncode, result.stdout, result.stderr


def own_gpus(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """Each worker's own GPU (what ``cuda:LOCAL_RANK`` opens), by local rank."""
    code, out, err = run(tmp_path, *args, env=env)
    assert code == 0, err[-3000:]
    envs = [json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if "[rank" in line]
    own = {}
    for e in envs:
        visible = e["CUDA_VISIBLE_DEVICES"].split(",")
        assert e["EFDL_CUDA_DEVICE"] == e["LOCAL_RANK"]
        assert e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # NVML's indices are CUDA's
        assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # torchrun's, for plain scripts
        own[int(e["LOCAL_RANK"])] = visible[int(e["LOCAL_RANK"])]
    return [own[r] for r in sorted(own)]


def test_gpus_by_index_each_worker_on_its_own(tmp_path: Path) -> None:
    assert own_gpus(tmp_path, "--gpus", "2,5", "--nproc-per-node", "gpu") == ["2", "5"]


def test_virtual_local_rank_shows_each_worker_its_own_gpu_alone(tmp_path: Path) -> None:
    """torchrun's --virtual-local-rank: LOCAL_RANK is 0 everywhere and each worker sees only
    its GPU (cuda:0); efdl still knows which local rank it is (EFDL_LOCAL_RANK)."""
    code, out, err = run(tmp_path, "--gpus", "2,5", "--virtual-local-rank")
    assert code == 0, err[-3000:]
    envs = [json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if "[rank" in line]
    seen = sorted((e["EFDL_LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs)
    assert seen == [("0", "2"), ("1", "5")], envs
    assert {(e["LOCAL_RANK"], e["EFDL_CUDA_DEVICE"]) for e in envs} == {("0", "0")}


def test_gpus_by_uuid(tmp_path: Path) -> None:
    chosen = f"{UUIDS[7]},{UUIDS[3]}"
    assert own_gpus(tmp_path, "--gpus", chosen) == [UUIDS[7], UUIDS[3]]


def test_gpus_free_takes_the_idle_ones_of_those_visible(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,4"}  # 0, 1 and 4 run other jobs' processes
    assert own_gpus(tmp_path, "--gpus", "free", env=env) == ["2"]


def test_default_is_the_agents_visible_gpus_and_efdl_gpus_is_read(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": f"{UUIDS[3]},{UUIDS[1]}"}
    assert own_gpus(tmp_path, env=env) == [UUIDS[3], UUIDS[1]]
    assert own_gpus(tmp_path, env={"EFDL_GPUS": "6"}) == ["6"]
    # --nproc-per-node below the GPU count: the first ones, as torchrun's LOCAL_RANK would.
    assert own_gpus(tmp_path, "--gpus", "5,6,7", "--nproc-per-node", "2") == ["5", "6"]


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--gpus", "9"], {}, ["--gpus 9 names '9'", "0 (GPU-00000000"]),
        (["--gpus", "free"], {"CUDA_VISIBLE_DEVICES": "0,4"}, ["every GPU", "0, 4"]),
        (["--gpus", "2,5", "--nproc-per-node", "3"], {}, ["3 asks for more", "2 visible GPUs"]),
    ],
)
def test_bad_gpu_choices_are_clear_errors(
    tmp_path: Path, args: list[str], env: dict[str, str], words: list[str]
) -> None:
    code, _, err = run(tmp_path, *args, env=env)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    for word in words:
        assert word in err, err[-2000:]


def test_in_place_a_survivor_keeps_its_gpu_and_the_replacement_takes_the_free_one(
    tmp_path: Path,
) -> None:
    env = {"OUT_DIR": str(tmp_path), "FAIL_AT": "1:5", "EPOCHS": "1", "STEP_SECONDS": "0.05"}
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    path = os.pathsep.join(p for p in (str(FAKES), base.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [
            *EFDL_RUN,
            "--standalone",
            "--job-id",
            "gpus-in-place",
            "--gpus",
            "2,5",
            "--max-restarts",
            "1",
            str(SCRIPTS / "elastic_steps.py"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env={**base, "PYTHONPATH": path, "EFDL_FAKE_NVML": NVML, **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    entries = [json.loads(line) for line in (tmp_path / "enter.jsonl").read_text().splitlines()]
    gpu_of: dict[int, set[str]] = {}
    for e in entries:
        gpu_of.setdefault(e["pid"], set()).add(e["gpu"])
    assert all(len(g) == 1 for g in gpu_of.values()), gpu_of  # nobody ever changed GPU
    first = next(e["pid"] for e in entries if e["step"] == 0 and e["rank"] == 0)
    assert gpu_of.pop(first) == {"2"}  # the survivor re-entered after the rollback, on GPU 2
    assert sorted(g.pop() for g in gpu_of.values()) == ["5", "5"]  # the failed one, its heir
    assert "replacing the failed worker" in result.stderr
