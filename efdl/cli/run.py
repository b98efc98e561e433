"""efdl-run: the node agent's command, its options made one LaunchConfig, and the launch
around it (an embedded or served etcd, the job's start, the agent)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from efdl import __version__
from efdl._process import skip_final_gc
from efdl.cli.common import etcd_options, handle_errors, log, setup_logging
from efdl.cli.launching import FRESH_PREFIX, launch
from efdl.cli.torchrun_flags import IGNORED, apply_rdzv_conf, rendezvous_flags
from efdl.config import DEFAULT_JOB_ID, EtcdClientConfig, LaunchConfig
from efdl.errors import ConfigError
from efdl.kubeflow import pet_params
from efdl.options import load, read_yaml
from efdl.rendezvous.api import Endpoint
from efdl.rendezvous.served import (
    refusal,
    resolve,
)


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="efdl-run")
@etcd_options
@click.option("--standalone", is_flag=True, default=None, help="Embedded etcd, this node only.")
@click.option("--job-id", "--rdzv-id", "--rdzv_id", "job_id", help="The job's id.")
@click.option("--min", "min_workers", type=int, help="Fewest workers to train with.")
@click.option("--max", "max_workers", type=int, help="Most workers; more nodes wait as spares.")
@click.option("--nnodes", help="torchrun's MIN:MAX nodes (times --nproc-per-node workers).")
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    help="Workers here: N, gpu, cpu or auto (default: one per GPU, else 1).",
)
@click.option(
    "--gpus",
    help="GPUs for the job: all (default: those visible), free (no compute process on them), "
    "or indices/UUIDs such as 2,5.",
)
@click.option("--node-id", help="This node's id in the job (default: host name + suffix).")
@click.option(
    "--host",
    "--local-addr",
    "--local_addr",
    "host",
    help="Address peers use to reach this node; the store binds to it.",
)
@click.option(
    "--store-port",
    "store_port",
    type=int,
    help="Fixed port for the c10d store (default: any free port).",
)
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    help="torchrun's static rendezvous (--nnodes > 1, no etcd): the address where the node "
    "of --node-rank 0 serves the job's etcd (default 127.0.0.1).",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=int,
    help="Its port (default 29500); on one node, the c10d store's port.",
)
@click.option(
    "--node-rank",
    "--node_rank",
    "node_rank",
    type=int,
    help="torchrun's static launch: 0 serves the rendezvous (ranks come from it).",
)
@click.option(
    "--serve-etcd",
    is_flag=True,
    default=None,
    help="Serve the job's etcd here (embedded, on --etcd's first endpoint, an address of "
    "this host); the job lives as long as this node does.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    help="Where the etcd this node serves keeps its data, kept for a restart of this node "
    "(default: $XDG_STATE_HOME/efdl, else ~/.local/state/efdl).",
)
@click.option("--lease-ttl", "lease_ttl_s", type=int, help="Seconds until a dead node is noticed.")
@click.option("--settle", "settle_s", type=float, help="Seconds to batch joins into one round.")
@click.option(
    "--join-timeout",
    "join_timeout_s",
    type=float,
    help="Seconds the job may wait below --min before it fails.",
)
@click.option(
    "--max-restarts",
    "--max_restarts",
    "max_restarts",
    type=int,
    help="Restarts of failed workers on this node before it gives up (a failure that repeats "
    "the last one's error with no step trained between is not restarted).",
)
@click.option(
    "--warm-workers",
    "warm_workers",
    type=int,
    help="0: every worker starts cold (a Python interpreter and a torch import of its own); "
    "any other number: workers are forked from one interpreter per node that imported torch "
    "once, at the agent's start (about 300 MB of host memory). Default: forked on a GPU node "
    "or one with 4+ cores per worker slot, else cold.",
)
@click.option(
    "--grace-period",
    "--shutdown-timeout",
    "--shutdown_timeout",
    "grace_period_s",
    type=float,
    help="Seconds from SIGTERM to SIGKILL for workers and for leaving.",
)
@click.option(
    "--hang-timeout",
    "hang_timeout_s",
    type=float,
    help="Seconds an in-place worker may make no step while a peer waits on it before it is "
    "replaced (default: 90% of the collective timeout, at least 5 of the longest steps).",
)
@click.option(
    "--fence-timeout",
    "fence_timeout_s",
    type=float,
    help="Seconds this node's workers train on while their agent cannot reach etcd; then "
    "they stop committing, state in memory, until it can (default: 90, at least 3 lease "
    "TTLs). A generation cut off from etcd whole is replaced this long after its lease went.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    help="text (default) or json: one object per line with time, job, node, generation, rank.",
)
@click.option(
    "--metrics-port",
    type=int,
    help="Serve Prometheus metrics on --host at this port (default: off; 0: any free port).",
)
@click.option(
    "--log-dir",
    "--log_dir",
    "log_dir",
    type=click.Path(path_type=Path),
    help="Keep per-rank log files here.",
)
@click.option(
    "--tee",
    "-t",
    "tee",
    help="Show these streams on the console, each line labelled [rankN]:, also where they "
    "are redirected: 1 stdout, 2 stderr, 3 both, or per local rank (0:1,1:2).",
)
@click.option(
    "--redirects",
    "-r",
    "redirects",
    help="Send these streams to the --log-dir files only: 1 stdout, 2 stderr, 3 both, or "
    "per local rank (0:1,1:2).",
)
@click.option(
    "--local-ranks-filter",
    "--local_ranks_filter",
    "local_ranks_filter",
    help="Show only these local ranks' output on the console (e.g. 0 or 0,1).",
)
@click.option(
    "--rank-prefix",
    is_flag=True,
    default=None,
    help="Label each worker line on the console with its rank, [rankN]: (default: lines as "
    "the worker printed them, as torchrun shows them).",
)
@click.option(
    "--duplicate-stdout-filters",
    "--duplicate_stdout_filters",
    "duplicate_stdout_filters",
    help="Copy stdout lines containing any of these comma-separated strings to "
    "LOG_DIR/JOB/filtered_stdout.log (needs --log-dir).",
)
@click.option(
    "--duplicate-stderr-filters",
    "--duplicate_stderr_filters",
    "duplicate_stderr_filters",
    help="The same for stderr (LOG_DIR/JOB/filtered_stderr.log).",
)
@click.option(
    "--signals-to-handle",
    "--signals_to_handle",
    "signals_to_handle",
    help="Signals on which this node leaves the job gracefully (e.g. add SIGUSR1 for SLURM); "
    "SIGUSR2, unless listed, drains it (it waits, held out, until efdl release).",
)
@click.option(
    "--virtual-local-rank",
    "--virtual_local_rank",
    "virtual_local_rank",
    is_flag=True,
    default=None,
    help="Every worker sees LOCAL_RANK=0 and only its own GPU (as cuda:0).",
)
@click.option("--role", help="ROLE_NAME of the workers.")
@click.option(
    "--cache-url",
    help="Persist committed state here (directory or fsspec URL, e.g. s3://bucket/job).",
)
@click.option(
    "--cache-every-steps", type=int, help="Persist every N commits (default 0: not by count)."
)
@click.option(
    "--cache-every",
    "cache_every_s",
    type=float,
    help="Persist when this many seconds passed since the last (default 60; 0: not by time).",
)
@click.option("--cache-keep", type=int, help="Complete snapshots to keep (default 2).")
@click.option(
    "--peer-copies",
    type=int,
    help="Sharded models: keep a snapshot every N commits in the host memory of another "
    "node's worker, for a crash to lose no step (default 0: none).",
)
@click.option(
    "--new-run",
    is_flag=True,
    default=None,
    help="Start a new run of a job that finished, was stopped or failed (keeps its cache).",
)
@click.option(
    "--straggler-ratio",
    type=float,
    help="A node whose own work per step takes this many times the other nodes' is slow: "
    "an event and a metric (default 1.5; efdl.elastic_state jobs with state.ddp).",
)
@click.option(
    "--straggler-window",
    type=int,
    help="Steps per judgment of the nodes' pace, the median over them (default 20).",
)
@click.option(
    "--evict-stragglers",
    is_flag=True,
    default=None,
    help="A slow node leaves in place (held out for the quarantine time, a spare taking its "
    "place), if the job keeps its --min without it.",
)
@click.option(
    "--quarantine-ttl",
    "quarantine_ttl_s",
    type=float,
    help="Seconds a node found bad (health check, crash loop) stays out of the job.",
)
@click.option(
    "--quarantine-after",
    type=int,
    help="Quarantine this node after this many worker failures with the same error (0: never).",
)
@click.option(
    "--quarantine-window",
    "quarantine_window_s",
    type=float,
    help="Seconds within which --quarantine-after failures count.",
)
@click.option(
    "--health-interval",
    "health_interval_s",
    type=float,
    help="Seconds between health checks while training (0: only before joining).",
)
@click.option(
    "--health-check",
    help="A command run before joining and at each health interval; non-zero: quarantined.",
)
@click.option(
    "--health-check-timeout",
    "health_check_timeout_s",
    type=float,
    help="Seconds --health-check may run before it is killed and counts as failed.",
)
@click.option(
    "--health-collective",
    is_flag=True,
    default=None,
    help="Before joining, run the node's own all-reduce (NCCL on its GPUs, else gloo); a "
    "failure or a hang past --health-check-timeout: quarantined.",
)
@click.option(
    "--health-min-free",
    "health_min_free_mb",
    type=int,
    help="MB the cache directory must have free (and twice the last snapshot).",
)
@click.option("-m", "--module", "module", is_flag=True, help="Run SCRIPT as a module (python -m).")
@click.option(
    "--no-python",
    "--no_python",
    "no_python",
    is_flag=True,
    help="SCRIPT is an executable, not a Python file.",
)
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", hidden=True)
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", hidden=True)
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", hidden=True)
@click.option("--monitor-interval", "--monitor_interval", "monitor_interval", hidden=True)
@click.option("--start-method", "--start_method", "start_method", hidden=True)
@click.option("--run-path", "--run_path", "run_path", is_flag=True, default=None, hidden=True)
@click.option("--logs-specs", "--logs_specs", "logs_specs", hidden=True)
@click.option("--numa-binding", "--numa_binding", "numa_binding", hidden=True)
@click.option("--event-log-handler", "--event_log_handler", "event_log_handler", hidden=True)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@handle_errors
def run_main(
    script: str,
    script_args: tuple[str, ...],
    config_file: Path | None,
    module: bool,
    no_python: bool,
    verbose: bool,
    **flags: Any,
) -> None:
    """Run SCRIPT on this node as part of an elastic job (a drop-in for torchrun).

    \b
    efdl-run --etcd etcd-1:2379 --job-id resnet --min 2 --max 8 train.py --lr 0.1
    efdl-run --standalone --nproc-per-node 2 train.py
    """
    setup_logging(verbose)
    cfg = launch_config(flags, config_file, os.environ)
    if cfg.log_format != "text":
        setup_logging(verbose, cfg.log_format)
    args = _worker_command(script, script_args, module, no_python)
    code = launch(cfg, args)
    skip_final_gc()  # its workers are gone: so should it be, at once
    sys.exit(code)


def launch_config(
    flags: dict[str, Any], config_file: Path | None, env: Mapping[str, str]
) -> LaunchConfig:
    """efdl-run's options (as click parsed them, torchrun's spellings included) with its
    config file and environment, as one config; torchrun's options that efdl does not need
    are dropped with a line saying what it does instead."""
    params = pet_params(flags, env)
    rdzv_backend = params.pop("rdzv_backend")
    rdzv_endpoint = params.pop("rdzv_endpoint")
    rdzv_conf = params.pop("rdzv_conf")
    for name, why in IGNORED.items():
        if params.pop(name, None) is not None:
            log.info("Ignoring --%s: %s.", name.replace("_", "-"), why)
    rendezvous_flags(rdzv_backend, rdzv_endpoint, params)
    if rdzv_conf:
        apply_rdzv_conf(rdzv_conf, params)
    data = read_yaml(config_file) if config_file else {}
    cfg = load(LaunchConfig, params, env=env, yaml_data=data, yaml_source=str(config_file or ""))
    if cfg.standalone and not params.get("standalone") and not data.get("standalone"):
        log.info("No etcd was given and the job is one node: running it standalone.")
    if cfg.standalone and not cfg.job_id:
        # As torchrun: a run of its own, which no other standalone run on this host shares
        # (a script's checkpoint named after TORCHELASTIC_RUN_ID is this run's alone).
        cfg = dataclasses.replace(cfg, job_id=f"{FRESH_PREFIX}{uuid.uuid4().hex[:12]}")
        log.info("Standalone run %s (a fresh id: give --job-id to resume a run later).", cfg.job_id)
    if cfg.job_id == DEFAULT_JOB_ID and not cfg.standalone:
        log.info(
            "No --job-id was given: the job is %r, torchrun's default run id (every job on "
            "this etcd without one is the same job).",
            DEFAULT_JOB_ID,
        )
    given = params.get("etcd") or env.get("EFDL_ETCD") or data.get("etcd")
    static = not cfg.standalone and cfg.etcd != given  # torchrun's static rendezvous
    for name in ("master_addr", "master_port", "node_rank"):
        if getattr(cfg, name) is not None and given:
            log.info(
                "Ignoring --%s: the rendezvous runs on the etcd given (--etcd), which ranks "
                "the nodes and tells them the store's address.",
                name.replace("_", "-"),
            )
    if static:
        log.info(
            "No etcd was given for a job of several nodes: as torchrun's static rendezvous, "
            "%s at %s (--master-addr:--master-port).",
            "this node serves the job's etcd" if cfg.serve_etcd else "the node of rank 0 serves it",
            cfg.etcd,
        )
        if not cfg.serve_etcd:  # the serving node checks where it listens, when it does
            at = Endpoint.parse(cfg.etcd or "")
            refused = refusal(
                at.target, resolve(at.host, at.port), cfg.job_token(env) is not None, False
            )
            if refused:
                raise ConfigError(refused)
    for stream in ("stdout", "stderr"):
        if cfg.log_dir is None and getattr(cfg, f"duplicate_{stream}_filters"):
            log.info(
                "Ignoring --duplicate-%s-filters: the copies go under --log-dir, and none is set.",
                stream,
            )
    return cfg


def _worker_command(
    script: str, script_args: tuple[str, ...], module: bool, no_python: bool
) -> list[str]:
    if module:
        return [sys.executable, "-m", script, *script_args]
    if no_python:
        if not shutil.which(script):
            raise ConfigError(f"The program {script!r} (--no-python) was not found.")
        return [script, *script_args]
    if not Path(script).is_file():
        raise ConfigError(f"The training script {script!r} does not exist.")
    return [sys.executable, script, *script_args]


def _show_defaults(command: click.Command, *configs: type) -> None:
    """Add each option's default, from the config dataclasses where the layering keeps it
    (a flag's own default is None: not given), to its --help text."""
    defaults = {
        f.name: f.default
        for cls in configs
        for f in dataclasses.fields(cls)
        if f.default not in (None, False, "", dataclasses.MISSING)
    }
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in defaults:
            continue
        if param.help and "default" not in param.help:
            param.help = f"{param.help} [default: {defaults[param.name]}]"


_show_defaults(run_main, LaunchConfig, EtcdClientConfig)
