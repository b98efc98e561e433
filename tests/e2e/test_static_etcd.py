"""The etcd that node rank 0 of a static launch serves (torchrun's `--nnodes N --node-rank R
--master-addr A --master-port P`), with real efdl-run agents: refused on an address other
hosts reach unless the job has a token; with one, nobody without it gets in, the workers
never see it, and every tool that sends it over plain http says so; and a node 0 that is
SIGKILLed and started again serves the job's etcd data as it was."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from efdl._process import free_port
from efdl.errors import StoreAuthError
from efdl.rendezvous.api import Endpoint, EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd, require_auth
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import JobKeys
from efdl.rendezvous.served import job_directory
from tests.e2e.harness import EFDL_RUN, Agent, read_rows
from tests.integration.test_static_security import outside_address
from tests.wait import wait_until

pytestmark = pytest.mark.timeout(300)
PLAIN_HTTP = "go over plain http"

# One all-reduce per step; each row says whether the worker's environment holds a secret.
STEPS = """\
import json, os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t, step = torch.ones(1), 0
secrets = ("EFDL_JOB_TOKEN", "EFDL_ETCD_PASSWORD")
while True:
    dist.all_reduce(t)
    seen = [s for s in secrets if s in os.environ]
    row = {"rank": dist.get_rank(), "step": step, "secrets": seen}
    with open(os.path.join(os.environ["OUT_DIR"], "events.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\\n")
    step += 1
    time.sleep(0.05)  # a training step's length
"""


def static_args(rank: int, addr: str, port: int, job: str, state: Path, script: Path) -> list[str]:
    return [
        *("--nnodes", "2", "--node-rank", str(rank), "--master-addr", addr),
        *("--master-port", str(port), "--job-id", job, "--nproc-per-node", "1"),
        *("--host", "127.0.0.1", "--lease-ttl", "3", "--join-timeout", "60"),
        *("--state-dir", str(state), str(script)),
    ]


def efdl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "efdl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def both_ranks_trained(out: Path, after: int = 0) -> bool:
    ranks = {r["rank"] for r in read_rows(out)[after:]}
    return ranks == {0, 1}


def test_a_static_launch_across_hosts_without_a_token_is_refused(tmp_path: Path) -> None:
    """Node 0 would serve the job's etcd where other hosts reach it: refused at start, naming
    the address and how to give a token; so is a node that would join through it."""
    address = outside_address()
    if address is None:
        pytest.skip("this host has no address other than loopback")
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never runs')\n")
    port = free_port(address)
    env = {k: v for k, v in os.environ.items() if k != "EFDL_JOB_TOKEN"}
    for rank, verb in ((0, "serve"), (1, "join")):
        done = subprocess.run(
            [*EFDL_RUN, *static_args(rank, address, port, "open", tmp_path, script)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"Cannot {verb} the job's etcd at {address}:{port} without a job token" in (
            done.stderr
        ), done.stderr[-3000:]
        assert "EFDL_JOB_TOKEN" in done.stderr and "Traceback" not in done.stderr
    with socket.socket() as s:
        s.bind((address, port))  # nothing was served there


def test_a_static_launch_with_a_token_lets_nobody_else_in(tmp_path: Path) -> None:
    """With EFDL_JOB_TOKEN on every node, node 0 serves the job's etcd on an address other
    hosts reach, auth on: a client without the token, or with another, is refused; `efdl
    status` and `efdl stop` with it work. The workers' environment holds no secret; every
    process that sends the token over plain http warns once, naming the endpoint; the job's
    etcd data goes when the job ends."""
    address = outside_address()
    if address is None:
        pytest.skip("this host has no address other than loopback")
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    port, token, job = free_port(address), secrets.token_hex(16), "guarded"
    env = {"EFDL_JOB_TOKEN": token, "EFDL_ETCD_PASSWORD": "not-for-workers"}
    state = tmp_path / "state"
    agents = [
        Agent(f"node-{r}", static_args(r, address, port, job, state, script), tmp_path, env)
        for r in (1, 0)
    ]
    try:
        wait_until("both ranks to train", lambda: both_ranks_trained(tmp_path), 120)
        endpoint = (Endpoint(address, port),)
        with pytest.raises(StoreAuthError), EtcdStore(EtcdSettings(endpoint)) as anonymous:
            anonymous.get_prefix(JobKeys(job).prefix)
        with pytest.raises(StoreAuthError):
            EtcdStore(EtcdSettings(endpoint, user="root", password=secrets.token_hex(16)))
        target = f"{address}:{port}"
        shown = efdl("status", "--etcd", target, "--job-id", job, env={"EFDL_JOB_TOKEN": token})
        assert shown.returncode == 0, shown.stderr[-2000:]
        assert shown.stderr.count(PLAIN_HTTP) == 1 and f"http://{target}" in shown.stderr
        refused = efdl("status", "--etcd", target, "--job-id", job, env={})
        assert refused.returncode != 0 and "authentication on" in refused.stderr, refused.stderr
        mode = stat.S_IMODE(job_directory(state, job, port).stat().st_mode)
        assert mode == 0o700
        stopped = efdl("stop", "--etcd", target, "--job-id", job, env={"EFDL_JOB_TOKEN": token})
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        for agent in agents:
            assert agent.wait(90) == 0, agent.output()[-4000:]
    finally:
        for agent in agents:
            agent.stop()
    rows = read_rows(tmp_path)
    assert rows and all(r["secrets"] == [] for r in rows), rows[:3]
    for agent in agents:
        log = agent.output()
        assert log.count(PLAIN_HTTP) == 1, log[-4000:]
        assert token not in log
    assert "auth on with the job token" in agents[1].output()
    assert not job_directory(state, job, port).exists()  # the job ended: its data went


def test_node_zero_restarted_serves_the_jobs_etcd_data_again(tmp_path: Path) -> None:
    """Node 0 of a static launch (on one host: loopback, no token) is SIGKILLed, its etcd
    with it, and started again: its etcd has the job's records from before (the events, the
    round), not an empty etcd; the job trains again with both nodes and, stopped, removes
    the data."""
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    port, job, state = free_port(), "restarted", tmp_path / "state"
    env: dict[str, str] = {}
    args = [static_args(r, "127.0.0.1", port, job, state, script) for r in (0, 1)]
    node1 = Agent("node-1", args[1], tmp_path, env)
    node0 = Agent("node-0", args[0], tmp_path, env)
    agents = [node1, node0]
    settings = EtcdSettings((Endpoint("127.0.0.1", port),))
    keys = JobKeys(job)
    try:
        wait_until("both ranks to train", lambda: both_ranks_trained(tmp_path), 120)
        with EtcdStore(settings) as store:
            events = {kv.key for kv in store.get_prefix(keys.events).kvs}
            before = store.get(keys.round)
        assert events and before is not None
        directory = job_directory(state, job, port)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        node0.proc.kill()
        node0.wait(30)

        def port_free() -> bool:  # its etcd went with it
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) != 0

        wait_until("node 0's etcd to go", port_free, 30)
        trained = len(read_rows(tmp_path))
        node0 = Agent("node-0-again", args[0], tmp_path, env)
        agents.append(node0)
        wait_until("both ranks to train again", lambda: both_ranks_trained(tmp_path, trained), 120)
        assert "its data kept from before" in node0.output()
        with EtcdStore(settings) as store:
            now = {kv.key for kv in store.get_prefix(keys.events).kvs}
            after = store.get(keys.round)
        assert events <= now, sorted(events - now)
        assert after is not None and after.create_revision == before.create_revision
        assert after.mod_revision > before.mod_revision  # a round after the restart
        stopped = efdl("stop", "--etcd", f"127.0.0.1:{port}", "--job-id", job, env={})
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        for agent in (node1, node0):
            assert agent.wait(90) == 0, agent.output()[-4000:]
    finally:
        for agent in agents:
            agent.stop()
    assert not job_directory(state, job, port).exists()


def test_stock_torchrun_keeps_the_token_from_its_workers_and_warns(tmp_path: Path) -> None:
    """Stock torchrun on efdl's backend copies its own environment to its workers: the
    handler takes the etcd password and the job token out of it once it has read them. Its
    etcd on an address other hosts reach, over plain http: the handler says so, once."""
    address = outside_address()
    if address is None:
        pytest.skip("this host has no address other than loopback")
    script = tmp_path / "env.py"
    script.write_text(
        "import json, os\n"
        "print('SECRETS', json.dumps([k for k in ('EFDL_JOB_TOKEN', 'EFDL_ETCD_PASSWORD') "
        "if k in os.environ]))\n"
    )
    token = secrets.token_hex(16)
    require_auth(tmp_path / "data", "root", token)
    with EmbeddedEtcd(data_dir=tmp_path / "data", host=address) as server:
        done = subprocess.run(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"),
                *("--nproc-per-node", "1", "--rdzv-backend", "efdl"),
                *("--rdzv-endpoint", server.endpoint.target, "--rdzv-id", "torchrun-secrets"),
                *("--local-addr", "127.0.0.1", str(script)),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "EFDL_JOB_TOKEN": token, "EFDL_ETCD_PASSWORD": "unused"},
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SECRETS []" in done.stdout, done.stdout[-2000:]
    assert done.stderr.count(PLAIN_HTTP) == 1, done.stderr[-3000:]
    assert f"http://{server.endpoint.target}" in done.stderr and token not in done.stderr


def test_a_standalone_run_ignores_a_job_token_in_its_environment(tmp_path: Path) -> None:
    """A job token is the credential of the etcd a node of the job serves: a standalone run's
    own etcd has no auth, and a token left in the environment does not stop it."""
    script = tmp_path / "hello.py"
    script.write_text("print('HELLO')\n")
    done = subprocess.run(
        [*EFDL_RUN, "--standalone", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EFDL_JOB_TOKEN": secrets.token_hex(16)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HELLO" in done.stdout
