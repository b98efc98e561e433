"""efdl-run as users run it: real agent processes, real etcd, real torch.distributed (gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest

from efdl.history import read_events
from efdl.launcher.node import interface_of
from efdl.rendezvous.api import Endpoint, EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from tests.e2e.harness import (
    EFDL_RUN,
    Agent,
    Job,
    latest_gen,
    rank0_rows,
    restart_job,
    steps_at_world,
    wait_gone,
)
from tests.procs import run_together
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture()
def job(etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[Job]:
    j = restart_job(tmp_path, etcd_server.endpoint.target, "e2e")
    yield j
    j.stop()


def efdl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "efdl", *args], capture_output=True, text=True, timeout=60
    )


def test_join_grow_crash_leave_and_status(job: Job) -> None:
    common = ("--min", "1", "--max", "4", "--nproc-per-node", "1")
    job.start("a", *common)
    job.start("b", *common)
    rows = job.wait_for("two nodes training", steps_at_world(2))
    g2 = latest_gen(rows)
    ranks2 = {r["rank"]: r["node"] for r in rows if r["gen"] == g2}
    assert sorted(ranks2.values()) == ["a", "b"]  # in join order: a and b start together

    # A third node joins: every worker restarts at world size 3.
    job.start("c", *common)
    rows = job.wait_for("three nodes training", steps_at_world(3, g2))
    g3 = latest_gen(rows)
    ranks3 = {r["rank"]: r["node"] for r in rows if r["gen"] == g3}
    assert ranks3 == {**ranks2, 2: "c"}  # survivors keep their ranks, the newcomer is appended
    steps_before = max(int(r["step"]) for r in rows)

    # Restart mode measures what the join cost (the workers' optimizer steps, watched for
    # the agent): training stood still from the last step before it to the first after.
    first3 = min(float(r["t"]) for r in rows if r["gen"] == g3)
    last2 = max(float(r["t"]) for r in rows if r["gen"] == g2)

    def restarted() -> list[dict[str, object]]:
        out = efdl("events", "--etcd", job.etcd, "--job-id", job.job_id, "--json")
        events = [json.loads(line) for line in out.stdout.splitlines()]
        return [e for e in events if e["kind"] == "rescale" and e["generation"] == g3]

    # Waited for in this process (an `efdl events` per poll would start a Python each time),
    # then read as `efdl events --json` shows it.
    with EtcdStore(EtcdSettings((Endpoint.parse(job.etcd),))) as store:
        wait_until(
            "the join's pause in the history",
            lambda: any(
                e.kind == "rescale" and e.generation == g3
                for e in read_events(store, job.job_id)[0]
            ),
            60,
        )
    (pause,) = restarted()
    assert "workers restarted" in str(pause["text"]) and pause["world_size"] == 3
    # measured from the steps the agent saw (reported every 0.1 s at most), about the rows'
    assert first3 - last2 - 0.5 < float(pause["seconds"]) < first3 - last2 + 0.5, pause  # type: ignore[arg-type]

    status = efdl("status", "--etcd", job.etcd, "--job-id", job.job_id)
    assert status.returncode == 0, status.stderr
    assert f"generation {g3}, active, world size 3" in status.stdout
    still = float(status.stdout.split("stood still ", 1)[1].split(" s", 1)[0])
    assert still >= float(pause["seconds"]) - 0.05 > 0, status.stdout  # type: ignore[arg-type]
    # The first to join leads (the oldest node record).
    assert f"leader {ranks2[0]}" in status.stdout and "ranks 2-2" in status.stdout

    # SIGKILL c's agent: its worker dies with it; a and b go on at world size 2.
    c_workers = job.agents["c"].worker_pids()
    assert c_workers
    job.agents["c"].signal(signal.SIGKILL)
    job.agents["c"].wait()
    assert not wait_gone(c_workers, 10), "a worker outlived its SIGKILLed agent"
    rows = job.wait_for("back to two nodes", steps_at_world(2, g3))
    g4 = latest_gen(rows)
    # Training resumed from the checkpoint, not from scratch.
    assert min(int(r["step"]) for r in rows if r["gen"] == g4) >= steps_before - 5

    # SIGTERM b: it leaves gracefully (exit 0); a trains alone.
    job.agents["b"].signal(signal.SIGTERM)
    assert job.agents["b"].wait(30) == 0
    assert "Left the job on SIGTERM" in job.agents["b"].output()
    job.wait_for("one node training", steps_at_world(1, g4))

    stop = efdl("stop", "--etcd", job.etcd, "--job-id", job.job_id)
    assert stop.returncode == 0, stop.stderr
    assert job.agents["a"].wait(30) == 0
    assert "The job was stopped" in job.agents["a"].output()


@dataclass
class EndedJob:
    """A job whose one agent restarted its crashed workers and finished, then a start of
    that job refused and a --new-run of it, each to its end: what each said and wrote."""

    job: Job
    first: Agent
    first_code: int
    first_rows: list[dict[str, object]]
    history_json: str  # `efdl events --json` after the first run
    history: str  # `efdl events` after the first run
    status: str  # `efdl status` after the first run
    again: Agent
    again_code: int
    new: Agent
    new_code: int


@pytest.fixture(scope="module")
def ended_job(
    etcd_server: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EndedJob]:
    """Run once, read by the crash-restart and the ended-job tests (each reads what it
    checks; neither starts anything)."""
    job = restart_job(tmp_path_factory.mktemp("ended"), etcd_server.endpoint.target, "e2e")
    try:
        # rank 1 of 2 crashes at step 5; the workers restart (1 of 2 allowed) and finish
        job.env.update(FAIL_AT="1:5", STEPS="12")
        first = job.start("a", "--nproc-per-node", "2", "--max-restarts", "2")
        first_code = first.wait(120)
        first_rows = job.events()
        where = ("--etcd", job.etcd, "--job-id", job.job_id)
        history_json = efdl("events", *where, "--json").stdout
        history = efdl("events", *where).stdout
        status = efdl("status", *where).stdout
        del job.env["FAIL_AT"]
        one = ("--nproc-per-node", "1", "--min", "1", "--max", "1")
        again = job.start("b", *one)
        again_code = again.wait(60)
        job.env.update(STEPS="16")  # the script resumes from its own checkpoint: 4 more steps
        new = job.start("c", *one, "--new-run")
        new_code = new.wait(120)
        yield EndedJob(
            job,
            first,
            first_code,
            first_rows,
            history_json,
            history,
            status,
            again,
            again_code,
            new,
            new_code,
        )
    finally:
        job.stop()


# Tests reading one module fixture's run share an xdist group, so one worker makes the run.
@pytest.mark.xdist_group("launcher-ended-job")
def test_a_worker_crash_is_restarted(ended_job: EndedJob) -> None:
    agent = ended_job.first
    assert ended_job.first_code == 0, agent.output()[-3000:]
    rows = ended_job.first_rows
    assert {r["restart"] for r in rows} == {0, 1}
    assert max(int(r["step"]) for r in rows) == 11  # type: ignore[call-overload]
    out = agent.output()
    assert "worker rank 1 (local rank 1" in out and "failed with exit code 3" in out
    assert "restarting the workers (restart 1 of 2)" in out
    # Every crash is in the job's history, the failed worker's (and a peer's that failed
    # with it, if it did before its exit was handled), whichever came first: its exit or the
    # round its failure made.
    lines = ended_job.history_json.splitlines()
    crashes = [json.loads(line) for line in lines if '"crash"' in line]
    assert any("worker rank 1 " in c["text"] and "exit code 3" in c["text"] for c in crashes)


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One worker that fails at once (its error recorded), no restarts allowed: run once,
    read by the tests of what efdl-run says of it."""
    script = tmp_path_factory.mktemp("boom") / "boom.py"
    script.write_text(
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    raise ValueError('the learning rate 42 is too large')\n"
        "main()\n"
    )
    return subprocess.run(
        [
            *EFDL_RUN,
            "--standalone",
            "--job-id",
            "boom",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.xdist_group("launcher-failed-run")
def test_max_restarts_exhausted_ends_with_a_clear_message(
    failed_run: subprocess.CompletedProcess[str],
) -> None:
    assert failed_run.returncode == 1, failed_run.stderr[-3000:]
    assert "used all 0 restarts (--max-restarts)" in failed_run.stderr, failed_run.stderr[-3000:]


def test_a_spare_replaces_a_dead_member(job: Job) -> None:
    common = ("--min", "1", "--max", "1", "--nproc-per-node", "1")
    job.start("a", *common)
    rows = job.wait_for("a training", steps_at_world(1))
    job.start("s", *common)
    # it joins once its warm process is ready, and waits as a spare
    wait_until("s to be a spare", lambda: "this node is a spare" in job.agents["s"].output(), 90)
    assert {r["node"] for r in job.events()} == {"a"}
    job.agents["a"].signal(signal.SIGKILL)
    job.agents["a"].wait()
    rows = job.wait_for(
        "the spare training", lambda rs: any(r["node"] == "s" for r in rs) and steps_at_world(1)(rs)
    )
    assert min(int(r["step"]) for r in rows if r["node"] == "s") > 0  # resumed, not restarted


def test_the_digits_example_trains_each_time_and_resumes_only_an_unfinished_job(
    tmp_path: Path, short_tmp: Path
) -> None:
    """The README's quick start, twice: each run trains from epoch 0 (the checkpoint is
    the job's, and goes when the job finishes). A job left on SIGTERM keeps it and exits 143
    (unfinished: a scheduler runs it again): the next run of that job (--job-id) says it
    resumed, and from where."""
    example = Path(__file__).parents[2] / "examples" / "digits" / "train_torchrun.py"
    command = [*EFDL_RUN, "--standalone", "--job-id", "digits", "--nproc-per-node", "2"]
    command.append(str(example))
    env = {**os.environ, "TMPDIR": str(short_tmp)}  # where the default checkpoint goes
    checkpoint = short_tmp / "digits-digits.pt"

    done = subprocess.run(
        [*command, "--epochs", "3"], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [e["epoch"] for e in rank0_rows(done.stdout)] == [0, 1, 2], done.stdout
    assert rank0_rows(done.stdout)[-1]["world"] == 2 and "resumed" not in done.stdout
    assert not checkpoint.exists()

    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(
            [*command, "--epochs", "1000"], stdout=out, stderr=subprocess.STDOUT, env=env
        )
        try:
            wait_until("two epochs", lambda: len(rank0_rows(log.read_text())) >= 2, 120)
            first.send_signal(signal.SIGTERM)
            assert first.wait(60) == 143, log.read_text()[-2000:]
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    second = rank0_rows(log.read_text())
    assert second[0]["epoch"] == 0 and "resumed" not in log.read_text()  # ran twice: trained
    last = max(int(e["epoch"]) for e in second)  # type: ignore[call-overload]
    assert checkpoint.exists()
    resumed = subprocess.run(
        [*command, "--epochs", str(last + 5)], capture_output=True, text=True, timeout=180, env=env
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    import re

    found = re.search(rf"resumed from {re.escape(str(checkpoint))} at epoch (\d+)", resumed.stdout)
    assert found and int(found.group(1)) in (last + 1, last + 2), resumed.stdout
    assert rank0_rows(resumed.stdout)[0]["epoch"] == int(found.group(1))
    assert not checkpoint.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--standalone", "missing.py"], "The training script 'missing.py' does not exist"),
        (
            ["--standalone", "--min", "3", "--max", "2", "x.py"],
            r"--min \(3\) must not be greater than --max \(2\)",
        ),
        (["--standalone", "--min", "0", "x.py"], r"--min \(0\) must be at least 1"),
        (["--etcd", "127.0.0.1:9", "--job-id", "a/b", "x.py"], "The job id 'a/b' is not allowed"),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1", "x.py"],
            "Cannot serve the job's etcd at 192.0.2.1:29500",
        ),
        (["--standalone", "--nproc-per-node", "many", "x.py"], "expected a positive number"),
        (
            ["--standalone", "--cache-url", "x.py/cache", "x.py"],
            "--cache-url 'x.py/cache' cannot be used: its directory cannot be made",
        ),
        (
            ["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:2181", "x.py"],
            "is not efdl's: efdl's rendezvous is etcd v3",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("print('never runs')\n")
    result = subprocess.run(
        [*EFDL_RUN, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    import re

    assert re.search(message, result.stderr), result.stderr


def test_bad_config_files_and_unreachable_etcd(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("print('never runs')\n")
    for text, message in [
        ("min: [1,\n", "is not valid YAML at line"),
        ("mni: 2\n", "Unknown key 'mni'"),
    ]:
        (tmp_path / "c.yaml").write_text(text)
        r = subprocess.run(
            [*EFDL_RUN, "--config", "c.yaml", "--standalone", "x.py"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert r.returncode == 2 and message in r.stderr, r.stderr
    t0 = time.monotonic()
    r = subprocess.run(
        [
            *EFDL_RUN,
            "--etcd",
            "127.0.0.1:9,127.0.0.1:10",
            "--etcd-timeout",
            "1",
            "--join-timeout",
            "3",
            "--job-id",
            "j",
            "x.py",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "Cannot reach etcd" in r.stderr
    assert "127.0.0.1:9" in r.stderr and "127.0.0.1:10" in r.stderr
    assert time.monotonic() - t0 < 20


def test_etcd_without_a_job_id_is_torchruns_default_run_id(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """`--etcd host:port` and no `--job-id`: the job is "none", as torchrun's --rdzv-id
    default (said in a line), not an error."""
    script = tmp_path / "env.py"
    script.write_text("import os\nprint('RUN', os.environ['TORCHELASTIC_RUN_ID'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFDL_")}
    r = subprocess.run(
        [*EFDL_RUN, "--etcd", etcd_server.endpoint.target, "--nproc-per-node", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RUN none" in r.stdout, r.stdout
    assert "No --job-id was given: the job is 'none'" in r.stderr


def test_a_static_torchrun_launch_of_two_nodes_trains_without_an_etcd(tmp_path: Path) -> None:
    """`--nnodes 2 --node-rank N --master-addr A --master-port P`, as a SLURM script launches
    torchrun: node 0 serves the job's etcd at A:P, both nodes train in one job of world size
    2, and node 0 stops its etcd only once node 1 has left: both exit 0."""
    from efdl._process import free_port

    port = free_port()
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "print('RANKS', os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['EFDL_NODE_ID'])\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFDL_")}
    static = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [
        [*EFDL_RUN, *static, "--node-rank", str(rank), "--node-id", f"node-{rank}", str(script)]
        for rank in (1, 0)  # the serving node last: the other waits for its etcd
    ]
    done = run_together(nodes, 180, env=env, cwd=tmp_path)
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
    seen = sorted(
        line.split("RANKS ", 1)[1]
        for d in done
        for line in d.stdout.splitlines()
        if "RANKS " in line
    )
    assert [s.split()[:2] for s in seen] == [["0", "2"], ["1", "2"]], seen
    assert {s.split()[2] for s in seen} == {"node-0", "node-1"}
    assert f"Serving the job's etcd at 127.0.0.1:{port}" in done[1].stderr


def test_a_store_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    (tmp_path / "x.py").write_text("print('never runs')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(
            [*EFDL_RUN, "--standalone", "--store-port", str(port), "x.py"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert r.returncode == 2 and f"Cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr


# Three runs of one two-worker script, each run once and read by several tests: what it
# printed (OUT-<rank> and its run id on stdout, two ERR lines on stderr) and, as JSON, its
# torchrun environment.
ENV_KEYS = [
    *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
    *("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"),
    *("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"),
    *("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS"),
    *("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "EFDL_GENERATION", "EFDL_ETCD_PASSWORD"),
    "EFDL_NODE_HOST",
    "GLOO_SOCKET_IFNAME",
]
SAY = (
    "import json, os, sys\n"
    "r = os.environ['RANK']\n"
    "print(f'OUT-{r}', os.environ['TORCHELASTIC_RUN_ID'])\n"
    "print(f'ERR-{r}-apple', file=sys.stderr)\n"
    "print(f'ERR-{r}-pear', file=sys.stderr)\n"
    f"print('ENV', json.dumps({{k: os.environ.get(k) for k in {ENV_KEYS!r}}}))\n"
)
UNLABELLED = [sys.executable, "-c", "from efdl.cli.run import run_main; run_main()"]


@pytest.fixture(scope="module")
def say_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("say")
    (path / "say.py").write_text(SAY)
    return path


def say(
    cwd: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``efdl-run --nproc-per-node 2 FLAGS say.py`` (no --rank-prefix) to its end."""
    return subprocess.run(
        [*UNLABELLED, "--nproc-per-node", "2", *flags, "say.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def envs_of(text: str) -> list[dict[str, str]]:
    """The environments the workers printed (ENV {...} lines), by rank."""
    found = [json.loads(line.split("ENV ", 1)[1]) for line in text.splitlines() if "ENV {" in line]
    return sorted(found, key=lambda e: e["RANK"])


@pytest.fixture(scope="module")
def plain_run(say_dir: Path) -> tuple[int, subprocess.CompletedProcess[str]]:
    """As torchrun takes it: no etcd, no --standalone, one node, --master-port P (no EFDL_
    variables); P and the run."""
    from efdl._process import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFDL_")}
    return port, say(say_dir, "--master-port", str(port), env=env)


@pytest.fixture(scope="module")
def labelled_run(say_dir: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """--rank-prefix, and stdout only to files (--log-dir, --redirects 1): its --log-dir and
    the run."""
    logs = say_dir / "labelled-logs"
    env = {**os.environ, "EFDL_ETCD_PASSWORD": "do-not-leak"}
    return logs, say(say_dir, "--rank-prefix", "--log-dir", str(logs), "--redirects", "1", env=env)


@pytest.fixture(scope="module")
def filtered_run(say_dir: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A named standalone job (--max-restarts 7, a password and MKL_NUM_THREADS set, no
    other *_NUM_THREADS) with every output flag: its --log-dir and the run."""
    logs = say_dir / "logs"
    env = {
        **{k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")},
        "EFDL_ETCD_PASSWORD": "secret",
        "MKL_NUM_THREADS": "3",
    }
    job = ("--standalone", "--job-id", "envjob", "--max-restarts", "7")
    done = say(
        say_dir,
        *job,
        *("--log-dir", str(logs), "--redirects", "3", "--tee", "1"),
        *("--local-ranks-filter", "1", "--duplicate-stderr-filters", "apple,kiwi"),
        env=env,
    )
    return logs, done


@pytest.mark.xdist_group("launcher-say-runs")
def test_a_torchrun_command_line_without_etcd_runs_standalone(
    plain_run: tuple[int, subprocess.CompletedProcess[str]],
) -> None:
    """`efdl-run --nproc-per-node 2 --master-port P train.py`, as torchrun takes it: no etcd,
    no --standalone, one node: the job runs standalone, its store on P."""
    port, r = plain_run
    assert r.returncode == 0, r.stderr[-2000:]
    seen = [f"{e['RANK']} {e['WORLD_SIZE']} {e['MASTER_PORT']}" for e in envs_of(r.stdout)]
    assert seen == [f"0 2 {port}", f"1 2 {port}"], r.stdout
    assert "running it standalone" in r.stderr
    # the store's line comes with its round, not after the (short) job ended
    serving = r.stderr.find(f"Serving the c10d store of generation 1 on 127.0.0.1:{port}")
    assert 0 <= serving < r.stderr.find("workers finished; the job is done"), r.stderr


@pytest.mark.xdist_group("launcher-say-runs")
def test_worker_output_follows_torchrun_output_flags(
    plain_run: tuple[int, subprocess.CompletedProcess[str]],
    labelled_run: subprocess.CompletedProcess[str],
    filtered_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """As torchrun shows it: each line as the worker printed it. --tee shows those streams
    labelled, also where --redirects sends them to files; --local-ranks-filter keeps the
    other local ranks off the console; --duplicate-stderr-filters copies the matching lines
    to LOG_DIR/JOB/filtered_stderr.log; --rank-prefix labels every line. And each run that
    names no job is a run of its own (TORCHELASTIC_RUN_ID), as torchrun's standalone runs."""

    def lines(text: str, word: str) -> list[str]:
        return sorted(line for line in text.splitlines() if word in line)

    _, plain = plain_run
    for done in (plain, labelled_run[1], filtered_run[1]):
        assert done.returncode == 0, done.stderr[-3000:]
    outs = lines(plain.stdout, "OUT-")
    assert [o.split()[0] for o in outs] == ["OUT-0", "OUT-1"], plain.stdout
    assert lines(plain.stderr, "ERR-") == ["ERR-0-apple", "ERR-0-pear", "ERR-1-apple", "ERR-1-pear"]

    labelled_logs, labelled = labelled_run
    assert "[rank1]: ERR-1-pear" in labelled.stderr.splitlines()
    labelled_outs = lines("".join(p.read_text() for p in labelled_logs.rglob("rank*")), "OUT-")
    runs = {line.split()[-1] for line in outs + labelled_outs}
    assert len(runs) == 2 and all(r.startswith("standalone-") for r in runs), runs

    logs, filtered = filtered_run
    assert [o.split()[:2] for o in lines(filtered.stdout, "OUT-")] == [["[rank1]:", "OUT-1"]]
    assert "ERR-" not in filtered.stderr  # redirected and not teed
    (copies,) = logs.glob("*/filtered_stderr.log")
    assert sorted(copies.read_text().splitlines()) == ["ERR-0-apple", "ERR-1-apple"]
    assert lines((copies.parent / "gen1" / "rank0.stdout").read_text(), "OUT-0")  # files: all


@pytest.mark.xdist_group("launcher-say-runs")
def test_log_dir_keeps_per_rank_files_and_redirects_silence_the_console(
    labelled_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    logs, result = labelled_run
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[rank" not in result.stdout and "OUT-" not in result.stdout  # to the files only
    (run,) = (p.name for p in logs.iterdir())  # LOG_DIR/<run id>/
    files = sorted(p.relative_to(logs) for p in logs.rglob("rank*"))
    assert [str(f) for f in files] == [
        f"{run}/gen1/rank0.stderr",
        f"{run}/gen1/rank0.stdout",
        f"{run}/gen1/rank1.stderr",
        f"{run}/gen1/rank1.stdout",
    ]
    for rank in (0, 1):  # each worker ran once, its stdout all in its file
        text = (logs / run / "gen1" / f"rank{rank}.stdout").read_text()
        assert [line.split()[0] for line in text.splitlines() if "OUT-" in line] == [
            f"OUT-{rank}"
        ], text


@pytest.mark.xdist_group("launcher-say-runs")
def test_worker_environment_follows_torchrun(
    filtered_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    logs, result = filtered_run
    assert result.returncode == 0, result.stderr[-2000:]
    # each rank's environment, from its stdout file (rank 0's is filtered off the console)
    envs = envs_of("\n".join(p.read_text() for p in logs.glob("*/gen1/rank*.stdout")))
    assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert e["WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "2"
        assert (
            e["GROUP_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "1" and e["ROLE_NAME"] == "default"
        )
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["TORCHELASTIC_RUN_ID"] == "envjob" and e["TORCHELASTIC_MAX_RESTARTS"] == "7"
        assert (
            e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        )
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"error-rank{e['RANK']}.json")
        # As torchrun: OMP_NUM_THREADS=1 for two workers; what the user set is left alone.
        assert e["OMP_NUM_THREADS"] == "1" and e["MKL_NUM_THREADS"] == "3"
        assert e["OPENBLAS_NUM_THREADS"] is None and e["EFDL_GENERATION"] == "1"
        assert e["EFDL_ETCD_PASSWORD"] is None
        assert e["EFDL_NODE_HOST"] == "127.0.0.1"  # where a worker serves its peer copies
        # gloo's sockets on the interface of the node's address (--standalone: 127.0.0.1)
        assert e["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1") == "lo"


@pytest.mark.xdist_group("launcher-failed-run")
def test_the_failing_ranks_recorded_error_is_reported(
    failed_run: subprocess.CompletedProcess[str],
) -> None:
    result = failed_run
    assert result.returncode == 1
    assert "worker rank 0 (local rank 0" in result.stderr
    assert "failed with exit code 1: ValueError: the learning rate 42 is too large" in result.stderr


def test_a_mistyped_job_id_is_refused_by_stop_and_status_and_leaves_nothing(job: Job) -> None:
    """`efdl stop` of a job etcd holds nothing of must not create a closed job of that name
    (a later efdl-run of it would be refused), and `efdl status` says there is no such job."""
    typo = job.job_id + "-typo"
    for command in ("stop", "status"):
        result = efdl(command, "--etcd", job.etcd, "--job-id", typo)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert f"No job '{typo}'" in result.stderr and "Traceback" not in result.stderr
    with EtcdStore(EtcdSettings((Endpoint.parse(job.etcd),))) as store:
        assert not store.get_prefix(f"/efdl/{typo}/").kvs


@pytest.mark.xdist_group("launcher-ended-job")
def test_an_ended_job_is_refused_until_a_new_run_is_asked_for(ended_job: EndedJob) -> None:
    """Starting a job id that finished must not exit 0 doing nothing: it is refused with a
    sentence saying how to start it again, and --new-run starts a new run of it."""
    job = ended_job.job
    assert ended_job.first_code == 0, ended_job.first.output()[-3000:]
    done = ended_job.status
    assert "finished" in done and "--new-run" in done, done
    history = ended_job.history
    ends = [line for line in history.splitlines() if " round " in line and "finished:" in line]
    assert len(ends) == 1, history  # the job's end is in its history, once
    gens = {r["gen"] for r in ended_job.first_rows}

    assert ended_job.again_code == 2, ended_job.again.output()[-3000:]
    out = ended_job.again.output()
    assert f"Job '{job.job_id}' finished at" in out and "--new-run" in out
    assert "Traceback" not in out

    assert ended_job.new_code == 0, ended_job.new.output()[-3000:]
    later = [r for r in job.events() if r["gen"] not in gens]
    assert later and max(int(r["step"]) for r in later) == 15  # type: ignore[call-overload]
    assert min(int(r["gen"]) for r in later) > max(int(g) for g in gens)  # type: ignore[call-overload]


def test_efdl_run_leaves_nothing_in_the_temp_directory(tmp_path: Path, short_tmp: Path) -> None:
    """Not after a run, not after a start that failed; and what a SIGKILLed agent could not
    remove (its private directory, its embedded etcd's data) goes at the next start."""
    temp = short_tmp
    env = {**os.environ, "TMPDIR": str(temp)}
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*EFDL_RUN, "--standalone", *args, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    # (A run that ended well leaves nothing: checked after the last run below, which also
    # sweeps.)
    failed = run("--cache-url", str(script / "cache"))  # a file's child: cannot be made
    assert failed.returncode == 2 and "cannot be used" in failed.stderr, failed.stderr
    assert list(temp.iterdir()) == []

    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(600)\n")
    killed = subprocess.Popen(
        [*EFDL_RUN, "--standalone", str(tmp_path / "sleep.py")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_until(  # made and marked as the agent's (a kill between the two leaves no mark)
            "the agent's and etcd's directories, each with its owner mark",
            lambda: len([p for p in temp.iterdir() if (p / ".owner").exists()]) >= 2,
            60,
        )
    finally:
        killed.kill()
        killed.wait()
    left = sorted(p.name for p in temp.iterdir())
    assert any(n.startswith("efdl-standalone-") for n in left), left
    assert any(n.startswith("efdl-etcd-") for n in left), left
    again = run()
    assert again.returncode == 0, again.stderr[-2000:]
    assert list(temp.iterdir()) == []  # swept, quietly (-v says so: nothing is wrong)
    assert "efdl-standalone-" not in again.stderr and "killed" not in again.stderr


def ctrl_c(
    argv: list[str], env: dict[str, str] | None, ready: Callable[[Popen[str]], None]
) -> tuple[int, str]:
    """Run ``argv`` as from a terminal (SIGINT not ignored, as a background job's is), wait
    for ``ready(process)``, press Ctrl-C: its exit code and what it wrote to stderr."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        ready(proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_ctrl_c_while_waiting_for_etcd_exits_130_and_says_so() -> None:
    """A wrong --etcd: efdl-run says what it waits for and how long (again every half
    minute), and Ctrl-C there ends it with 130 and a sentence (not click's "Aborted!", 1)."""
    from efdl._process import free_port

    def waiting(proc: Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Waiting for etcd at" in line:
                assert "giving up" in line, line
                return

    script = Path(__file__).parent / "scripts" / "elastic_steps.py"
    argv = [*EFDL_RUN, "--etcd", f"127.0.0.1:{free_port()}", "--job-id", "nowhere", str(script)]
    code, err = ctrl_c(argv, None, waiting)
    assert code == 130, err
    assert "interrupted (Ctrl-C)" in err and "Aborted" not in err and "Traceback" not in err


def test_an_unnamed_standalone_run_stopped_by_ctrl_c_leaves_no_checkpoint(short_tmp: Path) -> None:
    """The README's run, Ctrl-C'd after its first checkpoint: the run had no --job-id, so no
    later run resumes it; the checkpoint its script left in the temp directory under the run's
    id goes with it, and efdl-run exits 130 (unfinished work)."""
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    script = Path(__file__).parents[2] / "examples" / "digits" / "train_torchrun.py"
    argv = [*EFDL_RUN, "--standalone", "--nproc-per-node", "2", str(script), "--epochs", "1000"]
    code, err = ctrl_c(
        argv,
        env,
        lambda _: wait_until(
            "the run's first checkpoint",
            lambda: any(p.name.startswith("digits-standalone-") for p in short_tmp.iterdir()),
            180,
        ),
    )
    assert code == 130, err[-3000:]
    left = [p.name for p in short_tmp.iterdir() if "standalone" in p.name or "efdl" in p.name]
    assert left == [], err[-3000:]  # (torch's own caches may stay: torchinductor_<user>)
    assert "Removed" in err and "no later run resumes" in err, err[-3000:]
