"""A stand-in for nvidia-ml-py's ``pynvml`` on hosts without GPUs: the GPUs it reports come
from ``EFDL_FAKE_NVML``, a JSON list of ``{"uuid", "name", "memory_mb", "processes", "mig"}``
(``processes``: how many compute processes, or their PIDs; ``mig``: a list of instances, each
``{"uuid", "memory_mb", "processes"}``), or from the file ``EFDL_FAKE_NVML_FILE`` names, read
at every ``nvmlInit()`` and every look-up of a GPU by UUID (a test changes it to start a
foreign process on a GPU, or to make a GPU fail). A GPU's health (efdl.launcher.health) comes
from its entry too: ``ecc_uncorrected`` (volatile count), ``retired_pending``,
``remap_pending``, ``remap_failed`` (booleans), ``throttle`` (NVML's throttle reasons bit
mask), ``lost`` (NVML says the GPU is lost) and ``xid`` (critical Xid errors, each delivered
once through the event set). Without that variable it behaves as NVML does with no driver.
Put this directory first on PYTHONPATH to make an ``efdl-run`` process see those GPUs; only
the calls efdl makes exist here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_ENABLED = 1
NVML_FEATURE_DISABLED = 0
nvmlEventTypeXidCriticalError = 0x8
_gpus: list[dict[str, Any]] = []
_xids_delivered: dict[str, int] = {}  # by UUID: how many of its ``xid`` were delivered


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


def nvmlInit() -> None:
    path = os.environ.get("EFDL_FAKE_NVML_FILE")
    text = Path(path).read_text() if path else os.environ.get("EFDL_FAKE_NVML")
    if text is None:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    _gpus[:] = json.loads(text)


def _reload() -> None:
    """The GPUs as the file says now (a test may have changed it)."""
    path = os.environ.get("EFDL_FAKE_NVML_FILE")
    if path:
        _gpus[:] = json.loads(Path(path).read_text())


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> dict[str, Any]:
    _reload()
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for gpu in _gpus:
        if gpu["uuid"] == text:
            if gpu.get("lost"):
                raise NVMLError_GpuIsLost("GPU is lost")
            return gpu
    raise NVMLError_NotFound("Not Found")


def nvmlDeviceGetIndex(handle: dict[str, Any]) -> int:
    return next(i for i, g in enumerate(_gpus) if g["uuid"] == handle["uuid"])


def nvmlDeviceGetTotalEccErrors(handle: dict[str, Any], error_type: int, counter: int) -> int:
    if error_type != NVML_MEMORY_ERROR_TYPE_UNCORRECTED or counter != NVML_VOLATILE_ECC:
        raise NVMLError_NotSupported("Not Supported")
    return int(handle.get("ecc_uncorrected", 0))


def nvmlDeviceGetRetiredPagesPendingStatus(handle: dict[str, Any]) -> int:
    return NVML_FEATURE_ENABLED if handle.get("retired_pending") else NVML_FEATURE_DISABLED


def nvmlDeviceGetRemappedRows(handle: dict[str, Any]) -> tuple[int, int, int, int]:
    return 0, 0, int(bool(handle.get("remap_pending"))), int(bool(handle.get("remap_failed")))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: dict[str, Any]) -> int:
    return int(handle.get("throttle", 0))


def nvmlEventSetCreate() -> list[str]:
    return []  # the UUIDs registered


def nvmlDeviceRegisterEvents(handle: dict[str, Any], types: int, event_set: list[str]) -> None:
    event_set.append(str(handle["uuid"]))


def nvmlEventSetWait_v2(event_set: list[str], timeout_ms: int) -> SimpleNamespace:
    _reload()
    for gpu in _gpus:
        uuid = str(gpu["uuid"])
        xids = list(gpu.get("xid", []))
        done = _xids_delivered.get(uuid, 0)
        if uuid in event_set and done < len(xids):
            _xids_delivered[uuid] = done + 1
            return SimpleNamespace(
                device=gpu, eventType=nvmlEventTypeXidCriticalError, eventData=int(xids[done])
            )
    raise NVMLError_Timeout("Timeout")


def nvmlEventSetFree(event_set: list[str]) -> None:
    event_set.clear()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> dict[str, Any]:
    return _gpus[index]


def nvmlDeviceGetName(handle: dict[str, Any]) -> str:
    return str(handle.get("name", "NVIDIA H100 80GB HBM3"))


def nvmlDeviceGetUUID(handle: dict[str, Any]) -> str:
    return str(handle["uuid"])


def nvmlDeviceGetMemoryInfo(handle: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(total=int(handle.get("memory_mb", 81559)) << 20)


def nvmlDeviceGetComputeRunningProcesses(handle: dict[str, Any]) -> list[SimpleNamespace]:
    procs = handle.get("processes", 0)
    pids = procs if isinstance(procs, list) else [1000 + i for i in range(int(procs))]
    return [SimpleNamespace(pid=int(p)) for p in pids]


def nvmlDeviceGetMigMode(handle: dict[str, Any]) -> tuple[int, int]:
    if "mig" not in handle:
        raise NVMLError_NotSupported("Not Supported")
    mode = NVML_DEVICE_MIG_ENABLE if handle["mig"] else NVML_DEVICE_MIG_DISABLE
    return mode, mode


def nvmlDeviceGetMaxMigDeviceCount(handle: dict[str, Any]) -> int:
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(handle: dict[str, Any], index: int) -> dict[str, Any]:
    instances = handle["mig"]
    if index >= len(instances):
        raise NVMLError("Not Found")
    return dict(instances[index])
