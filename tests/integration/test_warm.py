"""Warm worker processes: a script run in one behaves as under ``python script.py``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from efdl.launcher.warm import WarmPool, warm_command

SCRIPT = """
import json, os, sys, torch
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "rank": os.environ.get("RANK"), "warm": os.environ.get("EFDL_WARM"),
                  "threads": torch.get_num_threads(), "stdin": sys.stdin.read(),
                  "main_file": getattr(sys.modules["__main__"], "__file__", None)}), flush=True)
if os.environ.get("BOOM"):
    def inner():
        raise ValueError("boom in the script")
    inner()
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture()
def pool() -> Iterator[WarmPool]:
    p = WarmPool(1, os.environ)
    yield p
    p.close()


def run_warm(pool: WarmPool, argv: list[str], **env: str) -> tuple[int, str, str]:
    pool.fill()
    worker_env = {**os.environ, "RANK": "3", "OMP_NUM_THREADS": "1", **env}
    proc = pool.start([sys.executable, *argv], worker_env)
    assert proc is not None
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    return proc.wait(timeout=60), out.decode(), err.decode()


def test_a_script_runs_as_main_with_its_argv_path_and_environment(
    pool: WarmPool, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code, out, err = run_warm(pool, [str(script), "--lr", "0.1"])
    assert code == 0, err
    seen = json.loads(out)
    assert seen["argv"] == [str(script), "--lr", "0.1"]
    assert seen["name"] == "__main__" and seen["main_file"] == str(script)
    assert seen["path0"] == str(tmp_path)  # the script's own modules import
    assert seen["rank"] == "3" and seen["warm"] == "1"
    assert seen["threads"] == 1  # OMP_NUM_THREADS of the worker, not of the agent
    assert seen["stdin"] == ""  # not the agent's pipe


def test_exit_codes_and_tracebacks_are_the_scripts(pool: WarmPool, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code, _, _ = run_warm(pool, [str(script)], CODE="7")
    assert code == 7
    code, _, err = run_warm(pool, [str(script)], BOOM="1")
    assert code == 1
    assert "ValueError: boom in the script" in err
    assert "warm.py" not in err and "runpy" not in err, err  # the script's frames only
    assert err.startswith("Traceback (most recent call last):"), err


def test_a_module_runs_as_python_m_would(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mytrainer.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # the agent's directory, where python -m looks first
    code, out, err = run_warm(pool, ["-m", "mytrainer", "x"])
    assert code == 0, err
    seen = json.loads(out)
    assert seen["name"] == "__main__" and seen["argv"] == [str(tmp_path / "mytrainer.py"), "x"]


def test_unused_warm_processes_go_when_the_pool_closes() -> None:
    pool = WarmPool(2, os.environ)
    waiting = pool.fill()
    assert len(waiting) == 2
    pool.close()  # end of input: they exit unused (close waits for them)
    assert not [pid for pid in waiting if psutil.pid_exists(pid)]
    assert pool.take() is None


def test_a_command_that_cannot_start_warm_is_left_to_a_cold_start(pool: WarmPool) -> None:
    pool.fill()
    assert pool.start(["/usr/bin/env", "true"], os.environ) is None  # --no-python
    assert pool.take() is not None  # the warm process is still there for a worker


def test_only_this_python_running_a_script_or_module_can_start_warm() -> None:
    py = sys.executable
    assert warm_command([py, "train.py", "--x"]) == ["train.py", "--x"]
    assert warm_command([py, "-m", "pkg.train"]) == ["-m", "pkg.train"]
    assert warm_command(["/usr/bin/bash", "run.sh"]) is None  # --no-python
    assert warm_command([py, "-X", "dev", "train.py"]) is None  # interpreter flags: cold
    assert warm_command([py, "-m"]) is None
