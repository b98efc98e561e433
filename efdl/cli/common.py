"""What every command shares: logging, the etcd flags, errors as one line and an exit
code, the job a command is about, a store for it, --since."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from efdl import logs
from efdl.config import EtcdClientConfig
from efdl.errors import ConfigError, EfdlError
from efdl.options import load, read_yaml
from efdl.rendezvous.api import EtcdSettings
from efdl.rendezvous.embedded import EmbeddedEtcd
from efdl.rendezvous.etcd_store import EtcdStore
from efdl.rendezvous.records import check_id

F = TypeVar("F", bound=Callable[..., Any])


log = logging.getLogger("efdl")


def setup_logging(verbose: bool, fmt: str = "text") -> None:
    logs.setup(verbose, fmt)


def etcd_options(fn: F) -> F:
    """The etcd client flags, shared by every command that talks to etcd."""
    options = [
        click.option("--etcd", help="etcd endpoints, host:port[,host:port...] (env EFDL_ETCD)."),
        click.option("--etcd-ca", type=click.Path(path_type=Path), help="CA file (turns on TLS)."),
        click.option("--etcd-cert", type=click.Path(path_type=Path), help="Client certificate."),
        click.option("--etcd-key", type=click.Path(path_type=Path), help="Client certificate key."),
        click.option("--etcd-user", help="etcd user; the password comes from EFDL_ETCD_PASSWORD."),
        click.option(
            "--etcd-password-file",
            type=click.Path(path_type=Path),
            help="File holding the etcd password (instead of EFDL_ETCD_PASSWORD).",
        ),
        click.option(
            "--etcd-timeout",
            "etcd_timeout_s",
            type=float,
            help="Seconds each etcd request may take, failover included (default 5).",
        ),
        click.option(
            "--job-token-file",
            type=click.Path(path_type=Path),
            help="File holding the job's token (instead of EFDL_JOB_TOKEN): the secret of the "
            "etcd a node of the job serves (static launch, --serve-etcd).",
        ),
        click.option(
            "--config",
            "config_file",
            type=click.Path(path_type=Path),
            help="YAML file of options (flags > EFDL_* env > this file > defaults).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def handle_errors(fn: F) -> F:
    """Turn an EfdlError into ``efdl: <sentence>`` on stderr and exit code 2, and a Ctrl-C
    into exit code 130 (as a shell reports SIGINT)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EfdlError as exc:
            click.echo(f"efdl: error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:  # (click would say "Aborted!" and exit 1)
            click.echo("efdl: interrupted (Ctrl-C).", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def etcd_config(config_file: Path | None, flags: dict[str, Any]) -> EtcdClientConfig:
    data = read_yaml(config_file) if config_file else {}
    known = {
        k: v
        for k, v in data.items()
        if str(k).replace("-", "_").startswith("etcd")
        or str(k) in ("job-token-file", "job_token_file")
    }
    source = str(config_file) if config_file else "the config file"
    return load(EtcdClientConfig, flags, yaml_data=known, yaml_source=source)


def job_config(
    job_id: str | None, config_file: Path | None, flags: dict[str, Any]
) -> tuple[str, EtcdClientConfig]:
    """The job a command is about (--job-id > EFDL_JOB_ID > ``job-id`` in the --config file,
    as for efdl-run) and how to reach its etcd."""
    data = read_yaml(config_file) if config_file else {}
    from_yaml = next((v for k, v in data.items() if str(k).replace("-", "_") == "job_id"), None)
    chosen = job_id or os.environ.get("EFDL_JOB_ID") or from_yaml
    if not chosen:
        raise ConfigError(
            "No job was named: give --job-id (or set EFDL_JOB_ID, or job-id in the --config file)."
        )
    return check_id(str(chosen)), etcd_config(config_file, flags)


@contextmanager
def store_for(
    cfg: EtcdClientConfig, standalone: bool, settings: EtcdSettings | None = None
) -> Iterator[tuple[EtcdStore, EmbeddedEtcd | None]]:
    """A client of ``cfg``'s etcd (``settings`` if resolved already), or with ``standalone``
    of an embedded etcd started here; stopped, with the client closed, on the way out."""
    server = EmbeddedEtcd().start() if standalone else None
    try:
        if server is not None:  # its own etcd: no credentials (a job token is for another)
            timeout_s = cfg.etcd_timeout_s
            settings = server.settings(request_timeout_s=timeout_s, connect_timeout_s=2 * timeout_s)
        store = EtcdStore(settings or cfg.etcd_settings())
        try:
            yield store, server
        finally:
            store.close()
    finally:
        if server:
            server.stop()


def job_option(fn: F) -> F:
    return click.option(
        "--job-id", help="The job (its keys: /efdl/<job-id>/); or EFDL_JOB_ID, or --config's."
    )(fn)


def parse_since(text: str | None) -> float:
    """--since: a duration back from now (90s, 10m, 2h, 1d) or a local time
    (2026-11-24 08:00[:00])."""
    if not text:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(text[:-1]) * units[text[-1]]
    for form in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"):
        try:
            return time.mktime(time.strptime(text, form))
        except ValueError:
            continue
    raise ConfigError(
        f"--since {text!r} is neither a duration (90s, 10m, 2h, 1d) nor a time (2026-11-24 08:00)."
    )


def stop_on_sigterm() -> threading.Event:
    """An event that SIGTERM sets: a daemon's graceful end."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop
