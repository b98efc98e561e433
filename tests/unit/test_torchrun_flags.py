"""Every option of the installed torchrun (read from its own parser, so a flag a new torch
adds fails here until efdl-run knows it) is accepted by efdl-run, under each of its
spellings, and is either honoured (the config differs from the one without it) or dropped
with a line saying what efdl does instead."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest
from torch.distributed.run import get_args_parser

from efdl.cli.run import launch_config, run_main
from efdl.config import LaunchConfig

# A value torchrun would take, for each of its options that takes one.
SAMPLES = {
    "nnodes": "1",
    "nproc_per_node": "2",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "etcd-1:2379",
    "rdzv_id": "resnet",
    "rdzv_conf": "join_timeout=60",
    "max_restarts": "1",
    "monitor_interval": "0.5",
    "start_method": "fork",
    "event_log_handler": "console",
    "role": "trainer",
    "log_dir": "/tmp/efdl-flag-test-logs",
    "redirects": "0:1,1:2",
    "tee": "3",
    "local_ranks_filter": "0",
    "duplicate_stdout_filters": "loss,,acc",
    "duplicate_stderr_filters": "Error",
    "node_rank": "0",
    "master_addr": "10.0.0.5",
    "master_port": "29511",
    "local_addr": "10.0.0.7",
    "logs_specs": "custom",
    "numa_binding": "node",
    "signals_to_handle": "SIGTERM,SIGUSR1",
    "shutdown_timeout": "12",
}
NOT_OPTIONS = {"help", "training_script", "training_script_args"}


def _torchrun_options() -> list[tuple[str, str, bool]]:
    """(spelling, dest, takes a value) for each of torchrun's option strings."""
    out = []
    for action in get_args_parser()._actions:
        if action.dest in NOT_OPTIONS:
            continue
        takes_value = action.nargs != 0 and not isinstance(action, argparse._StoreTrueAction)
        out.extend((spelling, action.dest, takes_value) for spelling in action.option_strings)
    return out


def _config(argv: list[str]) -> LaunchConfig:
    ctx = run_main.make_context("efdl-run", [*argv, "train.py"])
    params = dict(ctx.params)
    for name in ("script", "script_args", "config_file", "module", "no_python", "verbose"):
        params.pop(name)
    return launch_config(params, None, {})


def _fields(cfg: LaunchConfig) -> dict[str, Any]:
    fields = {name: getattr(cfg, name) for name in LaunchConfig.__dataclass_fields__}
    if str(fields["job_id"]).startswith("standalone-"):
        fields["job_id"] = "standalone-*"  # a fresh id per run
    return fields


OPTIONS = _torchrun_options()


def test_every_torchrun_option_has_a_sample_value() -> None:
    missing = {dest for _, dest, takes in OPTIONS if takes and dest not in SAMPLES}
    assert not missing, f"torchrun has options efdl-run's test has no value for: {missing}"


@pytest.mark.parametrize(("spelling", "dest", "takes_value"), OPTIONS)
def test_efdl_run_takes_each_torchrun_option(
    spelling: str, dest: str, takes_value: bool, caplog: pytest.LogCaptureFixture
) -> None:
    base_argv = ["--nnodes", "2"] if dest == "standalone" else []  # (else it is implied)
    argv = [*base_argv, spelling, SAMPLES[dest]] if takes_value else [*base_argv, spelling]
    caplog.set_level(logging.INFO, logger="efdl")
    base = _fields(_config(base_argv))
    caplog.clear()
    cfg = _config(argv)
    flag = "--" + dest.replace("_", "-")
    noted = [r.getMessage() for r in caplog.records if flag in r.getMessage()]
    changed = {k: v for k, v in _fields(cfg).items() if base[k] != v}
    if dest in ("module", "no_python", "run_path"):
        assert not changed  # how the script is run: the worker command (tested e2e)
        if dest == "run_path":
            assert noted
        return
    assert changed or noted, f"{spelling}: neither honoured nor noted"


def test_the_output_flags_keep_torchruns_meaning() -> None:
    spec = _config(
        ["--log-dir", "/tmp/x", "--redirects", "0:1,1:2", "--tee", "2", "--local-ranks-filter", "0"]
    ).log_spec("job")
    assert spec.to_console(0, 1) is False and spec.to_console(0, 2) is True  # 0: stdout to files
    assert spec.labelled(0, 2) and not spec.labelled(0, 1)  # teed streams are labelled
    assert not spec.to_console(1, 1) and not spec.to_console(1, 2)  # filtered out
    assert _config(["--shutdown-timeout", "12"]).grace_period_s == 12.0
    assert [s.name for s in _config(["--signals-to-handle", "TERM,SIGUSR1"]).signals()] == [
        "SIGTERM",
        "SIGUSR1",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--redirects", "4"], "--redirects is '4'; expected 0 (none), 1 (stdout)"),
        (["--tee", "a:1"], "--tee is 'a:1'; expected 0 (none)"),
        (["--local-ranks-filter", "0,x"], "--local-ranks-filter is '0,x'; expected local ranks"),
        (["--signals-to-handle", "SIGKILL"], "--signals-to-handle names 'SIGKILL'"),
        (["--signals-to-handle", "SIGNOPE"], "--signals-to-handle names 'SIGNOPE'"),
    ],
)
def test_bad_output_and_signal_flags_say_what_was_expected(argv: list[str], message: str) -> None:
    from efdl.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(argv)


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "etcd-v3", "efdl"])
def test_an_etcd_backend_endpoint_is_the_etcd(backend: str) -> None:
    cfg = _config(["--rdzv-backend", backend, "--rdzv-endpoint", "etcd-1:2379", "--nnodes", "2"])
    assert cfg.etcd == "etcd-1:2379" and not cfg.standalone


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_torchruns_store_backends_run_on_etcd_or_standalone(backend: str) -> None:
    """c10d and static: efdl's rendezvous on --etcd where given; their endpoint is a node's
    address, never taken for an etcd; one node without etcd runs standalone."""
    flags = ["--rdzv-backend", backend, "--rdzv-endpoint", "node-0:29400"]
    assert _config([*flags, "--etcd", "etcd-1:2379", "--nnodes", "2"]).etcd == "etcd-1:2379"
    alone = _config(flags)
    assert alone.standalone and alone.etcd in (None, "")


def test_torchruns_own_single_node_line_runs_standalone() -> None:
    """What `torchrun --standalone` expands to: c10d at port 0 of localhost, one node."""
    cfg = _config(["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1"])
    assert cfg.standalone and not cfg.etcd and not cfg.serve_etcd


def test_standalone_with_an_etcd_is_refused_not_ignored() -> None:
    from efdl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--standalone starts an etcd of its own.*etcd-1:2379"):
        _config(["--standalone", "--etcd", "etcd-1:2379"])


def test_an_unknown_backend_is_refused() -> None:
    from efdl.errors import ConfigError

    with pytest.raises(ConfigError, match="--rdzv-backend 'zk' is not efdl's"):
        _config(["--rdzv-backend", "zk"])


def test_c10d_without_etcd_is_served_by_the_node_that_can_listen_at_its_endpoint() -> None:
    """torchrun's c10d: the node at --rdzv-endpoint hosts the store. efdl's static
    rendezvous: that node (it can listen there) serves the job's etcd; the others use it."""
    import socket

    from efdl._process import free_port

    port = free_port()
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "2"]
    host = _config(flags)
    assert (host.etcd, host.serve_etcd) == (f"127.0.0.1:{port}", True)
    with socket.socket() as taken:  # served already (by another node on this host)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        other = _config(flags)
    assert (other.etcd, other.serve_etcd) == (f"127.0.0.1:{port}", False)
