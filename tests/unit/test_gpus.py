"""GPU discovery (through a stand-in NVML), selection, and each worker's CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json

import pytest

from efdl.errors import ConfigError
from efdl.launcher import gpus
from efdl.launcher.gpus import Gpu, cuda_ids, discover, free_slot, select, worker_devices
from tests.fakes import pynvml as fake_nvml

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)]
EIGHT = [Gpu(i, UUIDS[i], "NVIDIA H100 80GB HBM3", 81559, busy=i in (0, 1, 4)) for i in range(8)]


def ids(chosen: list[gpus.Selected]) -> list[str]:
    return [s.visible_id for s in chosen]


def test_nvml_is_read_for_gpus_mig_instances_and_busy_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    table = [
        {"uuid": UUIDS[0], "name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920, "processes": 2},
        {"uuid": UUIDS[1], "mig": []},  # MIG capable, MIG mode off
        {
            "uuid": UUIDS[2],
            "mig": [{"uuid": "MIG-1111", "memory_mb": 9856}, {"uuid": "MIG-2222", "processes": 1}],
        },
    ]
    monkeypatch.setenv("EFDL_FAKE_NVML", json.dumps(table))
    found = discover(fake_nvml)
    assert [(g.index, g.uuid, g.busy) for g in found] == [
        (0, UUIDS[0], True),
        (1, UUIDS[1], False),
        (2, "MIG-1111", False),
        (2, "MIG-2222", True),
    ]
    assert found[0].model == "NVIDIA A100-SXM4-80GB" and found[0].memory_mb == 81920
    assert found[2].mig and not found[1].mig


def test_no_driver_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EFDL_FAKE_NVML", raising=False)
    assert discover(fake_nvml) == []


def test_simulated_gpus_replace_discovery_and_bad_counts_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EFDL_SIMULATED_GPUS (trying the fleet without GPUs): that many, each with a UUID of its
    own that --gpus can name, none busy; a count that is not one is a ConfigError."""
    monkeypatch.setenv("EFDL_SIMULATED_GPUS", "3")
    found = discover()
    assert [g.index for g in found] == [0, 1, 2] and not any(g.busy for g in found)
    assert len({g.uuid for g in found}) == 3 and all(g.uuid.startswith("GPU-") for g in found)
    assert [s.gpu.index for s in select(found, None, found[2].uuid)] == [2]
    monkeypatch.setenv("EFDL_SIMULATED_GPUS", "0")
    assert discover() == []
    for bad in ("two", "-1", "65", ""):
        monkeypatch.setenv("EFDL_SIMULATED_GPUS", bad)
        with pytest.raises(ConfigError, match=f"EFDL_SIMULATED_GPUS={bad!r} is not a number"):
            discover()


def test_all_visible_gpus_by_default_in_the_agents_own_order() -> None:
    assert ids(select(EIGHT, None, None)) == [str(i) for i in range(8)]
    assert ids(select(EIGHT, "6,2", "all")) == ["6", "2"]
    assert ids(select(EIGHT, f"{UUIDS[3]},{UUIDS[5][:12]}", None)) == [UUIDS[3], UUIDS[5][:12]]
    assert select(EIGHT, "-1", None) == []
    assert ids(select(EIGHT, "3,9,4", None)) == ["3"]  # CUDA stops at the first unknown entry


def test_a_list_of_indices_or_uuids_picks_those_gpus_in_that_order() -> None:
    assert ids(select(EIGHT, None, "5,2")) == ["5", "2"]
    chosen = select(EIGHT, None, f"{UUIDS[7]},{UUIDS[3]}")
    assert [s.gpu.index for s in chosen] == [7, 3] and ids(chosen) == [UUIDS[7], UUIDS[3]]
    assert [s.gpu.index for s in select(EIGHT, "2,5,6", "6,2")] == [6, 2]


def test_free_takes_the_gpus_no_compute_process_runs_on() -> None:
    assert ids(select(EIGHT, None, "free")) == ["2", "3", "5", "6", "7"]
    assert ids(select(EIGHT, "0,1,4,7", "free")) == ["7"]


@pytest.mark.parametrize(
    ("visible", "spec", "words"),
    [
        (None, "9", ["'9'", "no GPU", "0 (GPU-"]),
        ("2,5", "3", ["'3'", "no GPU", "2 (GPU-", "5 (GPU-"]),
        (None, "2,2", ["'2' twice"]),
        (None, "GPU-0000", ["more than one GPU"]),
        ("0,1,4", "free", ["every GPU", "0, 1, 4", "compute process"]),
        ("-1", "free", ["sees no GPU", "CUDA_VISIBLE_DEVICES='-1'"]),
        ("-1", "0", ["sees no GPU"]),
        (None, " , ", ["expected 'all', 'free'"]),
    ],
)
def test_bad_selections_say_what_was_asked_and_what_there_is(
    visible: str | None, spec: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        select(EIGHT, visible, spec)
    for word in words:
        assert word in str(err.value)


def test_a_gpu_in_mig_mode_is_named_by_its_instances() -> None:
    found = [Gpu(0, UUIDS[0]), Gpu(1, "MIG-aaaa"), Gpu(1, "MIG-bbbb")]
    assert ids(select(found, None, None)) == ["0", "MIG-aaaa", "MIG-bbbb"]
    assert ids(select(found, None, "MIG-bbbb")) == ["MIG-bbbb"]
    with pytest.raises(ConfigError, match="MIG mode; name its MIG instances by UUID: MIG-aaaa"):
        select(found, None, "1")


def test_workers_see_uuids_where_cuda_numbers_gpus_differently() -> None:
    chosen = select(EIGHT, None, "2,5")
    assert cuda_ids(chosen, None) == ("2", "5")
    assert cuda_ids(chosen, "PCI_BUS_ID") == ("2", "5")
    assert cuda_ids(chosen, "FASTEST_FIRST") == (UUIDS[2], UUIDS[5])


def test_cuda_local_rank_is_the_workers_own_gpu() -> None:
    node = ("2", "5", "6", "7")
    for local_rank in range(4):  # restart mode: slot == local rank, the node's order
        assert worker_devices(node, local_rank, local_rank) == ("2,5,6,7", local_rank)
    # In place, a newcomer of local rank 1 on slot 3 (slot 1 is still held): GPU 7 at 1.
    visible, own = worker_devices(node, 3, 1)
    assert visible.split(",")[own] == "7" and own == 1 and sorted(visible.split(",")) == list(node)
    assert worker_devices(("MIG-a", "MIG-b"), 1, 1) == ("MIG-b", 0)


def test_a_newcomer_gets_a_gpu_no_running_worker_holds() -> None:
    assert free_slot(1, held={0}, slots=4) == 1
    assert free_slot(1, held={0, 1}, slots=4) == 2  # local rank 1's GPU is still in use
    assert free_slot(0, held={0, 2}, slots=3) == 1
    assert free_slot(2, held={0, 1, 2}, slots=3) == 2  # all held: its own (shared a moment)
