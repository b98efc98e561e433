"""Warm worker processes: a script run in one behaves as under ``python script.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from efdl.launcher import warm
from efdl.launcher.warm import WarmPool, warm_command
from tests.wait import wait_until

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


SLEEPER = """
import os, signal
print(os.getpid(), flush=True)
signal.pause()  # until killed
"""


def test_the_fork_server_goes_with_the_pool_and_kills_what_it_forked(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    pool = WarmPool(1, os.environ)
    (server,) = pool.fill()
    assert pool.fill() == []  # one server a node
    proc = pool.start([sys.executable, str(script)], dict(os.environ))
    assert proc is not None
    assert proc.stdout is not None and int(proc.stdout.readline()) == proc.pid
    assert psutil.Process(proc.pid).ppid() == server
    pool.close()  # end of input: the server kills its children and exits (close waits)
    assert proc.wait(timeout=60) == -9
    assert not psutil.pid_exists(server)
    psutil.wait_procs([psutil.Process(proc.pid)] if psutil.pid_exists(proc.pid) else [], 60)
    assert not psutil.pid_exists(proc.pid)


AGENT = """
import os, sys
from efdl.launcher.warm import WarmPool
pool = WarmPool(1, os.environ)
(server,) = pool.fill()
proc = pool.start([sys.executable, sys.argv[1]], dict(os.environ))
print(server, proc.pid, flush=True)
sys.stdin.read()
"""


def test_a_killed_agent_takes_its_fork_server_and_workers_with_it(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert agent.stdout is not None
        server, worker = (int(x) for x in agent.stdout.readline().split())
        procs = [psutil.Process(server), psutil.Process(worker)]
        agent.kill()  # no close, no end of input: the death signals alone
        agent.wait(timeout=60)
        _, alive = psutil.wait_procs(procs, timeout=60)
        assert not alive
    finally:
        agent.kill()
        agent.wait()


def test_a_command_that_cannot_start_warm_is_left_to_a_cold_start(
    pool: WarmPool, tmp_path: Path
) -> None:
    pool.fill()
    assert pool.start(["/usr/bin/env", "true"], os.environ) is None  # --no-python
    other = {**os.environ, "PYTHONHASHSEED": "7", "PYTHONDONTWRITEBYTECODE": "1"}
    assert pool.start([sys.executable, "x.py"], other) is None  # read at an interpreter's start
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code, out, err = run_warm(pool, [str(script)])
    assert code == 0 and json.loads(out)["warm"] == "1", err  # the server still forks


def test_a_stopped_fork_server_is_given_up_and_what_it_forks_late_is_killed(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOPped (or stuck in the kernel): the order goes unanswered for ANSWER_S, the
    worker is left to a cold start and later ones too; when the server wakes and forks the
    order, that child is killed: no rank runs twice."""
    monkeypatch.setattr(warm, "ANSWER_S", 1.0)
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    (server,) = pool.fill()
    assert pool.wait_loaded(120)
    os.kill(server, signal.SIGSTOP)
    try:
        assert pool.start([sys.executable, str(script)], dict(os.environ)) is None
        assert pool.start([sys.executable, str(script)], dict(os.environ)) is None  # at once
    finally:
        os.kill(server, signal.SIGCONT)
    forked = psutil.Process(server)
    wait_until("the late child killed", lambda: not forked.children(), 60)


def test_workers_are_forked_concurrently_and_each_exit_is_its_own(
    pool: WarmPool, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    pool.fill()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [pool.start([sys.executable, str(script)], {**env, "CODE": str(c)}) for c in range(4)]
    assert all(p is not None for p in procs)
    assert len({p.pid for p in procs if p is not None}) == 4
    assert [p.wait(timeout=60) for p in procs if p is not None] == [0, 1, 2, 3]


def test_only_this_python_running_a_script_or_module_can_start_warm() -> None:
    py = sys.executable
    assert warm_command([py, "train.py", "--x"]) == ["train.py", "--x"]
    assert warm_command([py, "-m", "pkg.train"]) == ["-m", "pkg.train"]
    assert warm_command(["/usr/bin/bash", "run.sh"]) is None  # --no-python
    assert warm_command([py, "-X", "dev", "train.py"]) is None  # interpreter flags: cold
    assert warm_command([py, "-m"]) is None


RANDOM = """
import json, os, numpy, torch
print(json.dumps({"torch": torch.rand(1).item(), "numpy": float(numpy.random.rand()),
                  "seed": torch.initial_seed()}), flush=True)
"""


def test_each_forked_worker_draws_its_own_random_numbers(pool: WarmPool, tmp_path: Path) -> None:
    """As fresh interpreters do: torch's and numpy's generators seeded afresh in each."""
    script = tmp_path / "draw.py"
    script.write_text(RANDOM)
    draws = [json.loads(run_warm(pool, [str(script)])[1]) for _ in range(2)]
    assert draws[0]["torch"] != draws[1]["torch"] and draws[0]["seed"] != draws[1]["seed"]
    assert draws[0]["numpy"] != draws[1]["numpy"]


def test_a_module_beside_the_script_that_shadows_an_imported_one_starts_cold(
    pool: WarmPool, tmp_path: Path
) -> None:
    """The server imported ``statistics`` (torch._dynamo does); a script with its own
    statistics.py imports that one under ``python script.py``, so it starts cold."""
    (tmp_path / "statistics.py").write_text("def summary():\n    return 'mine'\n")
    script = tmp_path / "main.py"
    script.write_text(
        "import os, statistics\nprint(statistics.summary(), os.environ.get('EFDL_WARM'))\n"
    )
    code, out, err = run_warm(pool, [str(script)])
    assert code == 0, err
    assert out.split() == ["mine", "None"], out
    assert "shadow" in err, err


def test_a_worker_end_is_seen_while_its_fork_server_is_stopped(
    pool: WarmPool, tmp_path: Path
) -> None:
    """A SIGSTOPped server reaps nothing and says nothing: the worker's end is seen through
    its pidfd and its code read from /proc (the agent does not wait for the server)."""
    script = tmp_path / "exit.py"
    go = tmp_path / "go"
    os.mkfifo(go)
    script.write_text(  # exits 5 once the test writes to the pipe (at most 120 s)
        "import os, select, sys\n"
        f"fd = os.open({str(go)!r}, os.O_RDONLY | os.O_NONBLOCK)\n"
        "os.set_blocking(fd, True)\nassert select.select([fd], [], [], 120)[0]\nsys.exit(5)\n"
    )
    (server,) = pool.fill()
    assert pool.wait_loaded(120)
    proc = pool.start([sys.executable, str(script)], dict(os.environ))
    assert proc is not None
    os.kill(server, signal.SIGSTOP)
    try:
        writer: list[int] = []

        def opened() -> bool:  # ENXIO until the script has opened its read end
            try:
                writer.append(os.open(go, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                return False
            return True

        wait_until("the script's read end of the pipe", opened, 60)
        os.write(writer[0], b"go")
        os.close(writer[0])
        assert proc.wait(timeout=60) == 5
        assert psutil.Process(server).status() == psutil.STATUS_STOPPED  # still
    finally:
        os.kill(server, signal.SIGCONT)
