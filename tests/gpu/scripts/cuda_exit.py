"""A CUDA worker's exit: from its last line to its GPU memory free, as NVML sees it.

Two ways to end, three times each, alternating: ``exit_left`` (what a worker efdl asks to
leave does: skip the final collections) and a plain end of the script. The child holds 8 GiB
and many Python objects (a model's worth of small tensors' handles), then writes the time it
ends at. Prints one JSON line: for each way, the seconds to process gone and to memory freed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pynvml

CHILD = """
import sys, time, torch
from efdl._process import exit_left
x = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
objs = [torch.zeros(1) for _ in range(100_000)]  # a heap to collect, as a worker has
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
open(sys.argv[2], "w").write(repr(time.time()))
if sys.argv[1] == "exit_left":
    exit_left()
"""


def used_mib(handle: object) -> float:
    return pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20


def once(way: str, handle: object, baseline: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        mark = Path(tmp) / "t"
        p = subprocess.Popen(
            [sys.executable, "-c", CHILD, way, str(mark)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready"
        p.stdin.write("\n")
        p.stdin.flush()
        freed_at = gone_at = None
        deadline = time.monotonic() + 60
        while (freed_at is None or gone_at is None) and time.monotonic() < deadline:
            now = time.time()
            if gone_at is None and p.poll() is not None:
                gone_at = now
            if freed_at is None and used_mib(handle) < baseline + 1024:
                freed_at = now
            time.sleep(0.002)
        p.wait(timeout=60)
        start = float(mark.read_text())
        return {
            "gone_s": (gone_at or float("nan")) - start,
            "freed_s": (freed_at or float("nan")) - start,
            "rc": p.returncode,
        }


def main() -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    baseline = used_mib(handle)
    runs: dict[str, list[dict[str, float]]] = {"exit_left": [], "python": []}
    for _ in range(3):
        for way in runs:
            runs[way].append(once(way, handle, baseline))
    report = {
        way: {
            "gone_s": statistics.median(r["gone_s"] for r in rs),
            "freed_s": statistics.median(r["freed_s"] for r in rs),
            "freed": all(r["freed_s"] == r["freed_s"] for r in rs),  # not NaN
            "rc": sorted({int(r["rc"]) for r in rs}),
            "runs": rs,
        }
        for way, rs in runs.items()
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
