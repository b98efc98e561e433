"""Errors that are not the job's communication end the worker with that error (recorded in
torch's error file, reported by the agent), and the restart policy decides what follows:
no in-place worker waits for a rebuild that will never come."""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.e2e.harness import SCRIPTS, standalone

pytestmark = pytest.mark.timeout(240)


def run(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return standalone(
        SCRIPTS / "elastic_steps.py",
        *("--job-id", f"errors-{uuid.uuid4().hex[:8]}", "--nproc-per-node", "2"),
        *("--grace-period", "5", *args),
        env={"OUT_DIR": str(tmp_path), "STEP_SECONDS": "0.05", **env},
    )


def test_cuda_out_of_memory_ends_the_worker_and_the_job_without_restarts(tmp_path: Path) -> None:
    result = run(tmp_path, {"OOM_AT": "1:5"}, "--max-restarts", "0")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Worker rank 1 failed with exit code 1: OutOfMemoryError: CUDA out of memory" in (
        result.stderr
    )
    lines = (result.stdout + result.stderr).splitlines()
    # The failing rank was not taken for a dead peer (its partner may recover: it lost one).
    assert not [line for line in lines if line.startswith("[rank1]") and "recovering" in line]


def test_cuda_out_of_memory_is_restarted_by_the_restart_policy(tmp_path: Path) -> None:
    result = run(tmp_path, {"OOM_AT": "1:5", "EPOCHS": "1"}, "--max-restarts", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replacing the failed worker; the others go on without it (restart 1 of 1)" in (
        result.stderr
    )
    assert "OutOfMemoryError: CUDA out of memory" in result.stderr
    # The other rank recovered (its peer's exit broke a collective) and the job went on.
    assert "recovering:" in result.stdout + result.stderr


def test_a_user_barrier_timeout_ends_the_worker_with_the_timeout(tmp_path: Path) -> None:
    env = {"SKIP_BARRIER_AT": "1:5", "COLLECTIVE_TIMEOUT": "4"}
    result = run(tmp_path, env, "--max-restarts", "0")
    assert result.returncode == 1, result.stderr[-3000:]
    # Rank 0 times out in the barrier; rank 1, in its next step's all-reduce, times out at
    # about the same moment (or sees rank 0's timeout close their connection, and waits for a
    # rebuild): whichever exits first with a timeout is the one the agent reports.
    assert re.search(
        r"Worker rank [01] failed with exit code 1: RuntimeError: .*Timed out", result.stderr
    ), result.stderr[-3000:]


def test_a_script_that_fails_the_same_way_before_any_step_is_run_twice_not_four_times(
    tmp_path: Path,
) -> None:
    script = tmp_path / "broken.py"
    script.write_text(
        "import os\n"
        "with open(os.path.join(os.environ['OUT_DIR'], 'starts'), 'a') as f:\n"
        "    f.write('x')\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')  # torch's excepthook now prefixes [rank0]:\n"
        "import no_such_module_here\n"
    )
    result = standalone(
        script, "--nproc-per-node", "1", "--max-restarts", "3", env={"OUT_DIR": str(tmp_path)}
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert (tmp_path / "starts").read_text() == "xx"  # one retry, then it is final
    assert (
        "Worker rank 0 failed with exit code 1: ModuleNotFoundError: No module named "
        "'no_such_module_here', the same error as the last failure, with no step trained "
        "since: a restart would fail the same way" in result.stderr
    ), result.stderr[-3000:]
    assert "\n[rank0]: ModuleNotFoundError" in result.stderr  # the agent's prefix, once
    assert "[rank0]: [rank0]:" not in result.stderr
