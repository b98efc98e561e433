"""Configuration: one frozen object per command, validated once, read from flags, the
environment, a YAML file and defaults (efdl.options)."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from efdl.errors import ConfigError
from efdl.options import option_name
from efdl.output import STDERR, STDOUT, LogSpec, parse_filters, parse_ranks, parse_streams
from efdl.protocol.env import JOB_TOKEN_ENV, JOB_TOKEN_USER, MIN_STRAGGLER_WINDOW, PASSWORD_ENV
from efdl.rendezvous.api import EtcdSettings

JOB_TOKEN_MIN_CHARS = 16
# The fence timeout unless told (LaunchConfig.fence_s): etcd outages shorter than this are
# trained through.
DEFAULT_FENCE_S = 90.0
DEFAULT_JOB_ID = "none"  # torchrun's --rdzv-id default: jobs that name none are one job
STATIC_PORT = 29500  # torchrun's --master-port default


def read_password(password_file: Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The etcd password: from the file if given, else ``EFDL_ETCD_PASSWORD``, else None.

    Never from a command-line argument, where ``ps`` would show it.
    """
    env = os.environ if env is None else env
    if password_file is not None:
        try:
            return password_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"Cannot read the etcd password file {str(password_file)!r}: {exc.strerror}."
            ) from None
    return env.get(PASSWORD_ENV)


def read_job_token(token_file: Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The job's token: from the file if given, else ``EFDL_JOB_TOKEN``, else None.

    Never from a command-line argument, where ``ps`` would show it.

    Raises:
        ConfigError: the file cannot be read, or the token is shorter than 16 characters.
    """
    env = os.environ if env is None else env
    where = f"The job token file {str(token_file)!r}" if token_file else JOB_TOKEN_ENV
    if token_file is not None:
        try:
            token: str | None = token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"Cannot read the job token file {str(token_file)!r}: {exc.strerror}."
            ) from None
    else:
        token = env.get(JOB_TOKEN_ENV)
    if token is not None and len(token) < JOB_TOKEN_MIN_CHARS:
        raise ConfigError(
            f"{where} holds a token of {len(token)} characters; expected at least "
            f"{JOB_TOKEN_MIN_CHARS} (make one with `openssl rand -hex 32`)."
        )
    return token


@dataclasses.dataclass(frozen=True, slots=True)
class EtcdClientConfig:
    """How a command reaches etcd (``--etcd``, ``--etcd-ca`` ... in every command).

    Attributes:
        etcd: comma-separated endpoints, e.g. ``etcd-1:2379,etcd-2:2379``.
        etcd_ca: CA bundle that signed the etcd servers' certificates (turns on TLS).
        etcd_cert: client certificate, for etcd's ``--client-cert-auth``.
        etcd_key: the client certificate's key.
        etcd_user: user for etcd's auth; the password comes from ``EFDL_ETCD_PASSWORD`` or
            ``etcd_password_file``, never from a flag.
        etcd_password_file: file holding the password (one line).
        etcd_timeout_s: bound on each etcd request, failover included; also how long to
            keep trying to connect at start.
        job_token_file: file holding the job's token (else ``EFDL_JOB_TOKEN``): the secret
            of the etcd a node of the job serves (torchrun's static launch, ``--serve-etcd``),
            which every node and every ``efdl`` command about the job must be given; they
            authenticate as etcd's root user with it. Not with ``etcd_user``.
    """

    etcd: str | None = None
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    etcd_user: str | None = None
    etcd_password_file: Path | None = None
    etcd_timeout_s: float = 5.0
    job_token_file: Path | None = None

    def job_token(self, env: Mapping[str, str] | None = None) -> str | None:
        """The job's token (``job_token_file``, else ``EFDL_JOB_TOKEN``), or None."""
        return read_job_token(self.job_token_file, env)

    def etcd_settings(
        self,
        endpoints: str | None = None,
        env: Mapping[str, str] | None = None,
        connect_timeout_s: float | None = None,
    ) -> EtcdSettings:
        """Resolved client settings (reads the password); ``endpoints`` overrides ``etcd``;
        ``connect_timeout_s``: how long to wait for etcd at start (default: two request
        timeouts)."""
        target = endpoints or self.etcd
        if not target:
            raise ConfigError(
                "No etcd endpoints were given: pass --etcd host:port[,host:port...] "
                "(or EFDL_ETCD), or use --standalone."
            )
        user = self.etcd_user
        password = read_password(self.etcd_password_file, env)
        if password is not None and user is None:
            password = None  # a password in the environment alone does not turn auth on
        token = self.job_token(env)
        if token is not None:
            if user is not None:
                raise ConfigError(
                    f"Both --etcd-user ({user!r}) and a job token ({JOB_TOKEN_ENV} or "
                    "--job-token-file) were given; expected one: the job token is the "
                    "credential of the etcd a node of the job serves, --etcd-user that of an "
                    "etcd run apart."
                )
            user, password = JOB_TOKEN_USER, token
        return EtcdSettings.from_list(
            target,
            ca_file=self.etcd_ca,
            cert_file=self.etcd_cert,
            key_file=self.etcd_key,
            user=user,
            password=password,
            request_timeout_s=self.etcd_timeout_s,
            connect_timeout_s=connect_timeout_s or 2 * self.etcd_timeout_s,
        )


NPROC_WORDS = ("gpu", "cpu", "auto")


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig(EtcdClientConfig):
    """Everything ``efdl-run`` needs, validated once (flag > ``EFDL_*`` env > YAML > default).

    Attributes:
        standalone: start an embedded etcd on 127.0.0.1 and run one node.
        job_id: the job; agents with the same id and etcd form one job.
        min_workers: the job trains with at least this many workers, else it waits.
        max_workers: never more workers than this; extra nodes wait as spares.
        nnodes: torchrun's ``MIN:MAX`` (nodes), turned into workers with ``nproc_per_node``.
        nproc_per_node: workers on this node: a number, ``gpu`` (one per visible GPU),
            ``cpu`` (one per CPU core, as torchrun) or ``auto`` (one per GPU; 1 on a CPU host,
            where torchrun would start one per core).
        gpus: the GPUs this agent gives the job: ``all`` (default: every GPU visible to it),
            ``free`` (those no compute process runs on), or a list of indices (as nvidia-smi
            numbers them) and UUIDs, e.g. ``2,5``. Worker slots are taken from these in order.
        node_id: this node's id in the job (default: host name and a random suffix).
        host: the address peers use to reach this node; the store binds to it.
        store_port: fixed port for the generation's c10d store (0: any free port).
        lease_ttl_s: a dead node is noticed after this long. Longer than the longest
            stall that must not count as death.
        settle_s: joins closer together than this make one round.
        join_timeout_s: how long the job may wait below ``min_workers`` before it fails.
        max_restarts: how many times this node restarts its failed workers before giving up.
        warm_workers: 0: every worker starts cold; any other number: workers are forked
            from the node's fork server, one interpreter that imported torch at the agent's
            start, so that no start, restart, replacement or newcomer imports it again
            (efdl.launcher.warm; about 300 MB of host memory with a CPU build). None: forked
            on a GPU node or one with 4+ cores per worker slot, else cold.
        grace_period_s: SIGTERM to SIGKILL, for workers and for a graceful leave.
        hang_timeout_s: how long an in-place worker may make no step while a peer waits on
            it in a collective before its agent replaces it (efdl.worker.hang); None: 90% of
            the workers' collective timeout, and at least five of the longest steps.
        fence_timeout_s: how long this node's workers may train on while their agent cannot
            reach etcd; past it they stop committing (their state kept in memory) until it
            can, and a leader may replace the generation without them only once this long
            (and a margin) has passed since their node's record went. Training rides out
            etcd outages shorter than this; a generation cut off from etcd whole is replaced
            this long after its lease went (docs/rendezvous.md, "Fencing"). None: 90 s, and
            at least three lease TTLs (:meth:`fence_s`).
        log_format: ``text`` (for people) or ``json`` (one object per line, agent and worker
            lines alike, each with time, job, node, generation and, for workers, rank).
        metrics_port: serve Prometheus metrics on ``--host`` at this port (None: off; 0: a
            free port, logged).
        log_dir: keep per-rank log files (and error files) under this directory.
        redirects: torchrun's ``--redirects``: 1 stdout, 2 stderr, 3 both go to files only;
            or per local rank, ``0:1,1:2``.
        tee: torchrun's ``--tee`` (same form): those streams are shown on the console too,
            each line labelled with its rank.
        local_ranks_filter: only these local ranks' output reaches the console (``0,1``).
        rank_prefix: label every worker line on the console with ``[rankN]: `` (default: as
            the worker printed it, as torchrun shows it).
        duplicate_stdout_filters: lines of stdout containing one of these comma-separated
            strings are also written to ``<log_dir>/<job>/filtered_stdout.log``.
        duplicate_stderr_filters: the same for stderr.
        signals_to_handle: signals on which the node leaves the job gracefully.
        virtual_local_rank: every worker sees ``LOCAL_RANK=0`` and only its own GPU.
        serve_etcd: this node serves the job's etcd (an embedded one, on ``--etcd``'s first
            endpoint, which must be an address of this host); the job's rendezvous lives as
            long as this node does. Set for the node of ``--node-rank`` 0 of a torchrun
            static launch (``--nnodes N --master-addr A --master-port P``, no etcd).
        master_addr: torchrun's static rendezvous address (with ``--nnodes`` > 1 and no etcd:
            where the node of ``--node-rank`` 0 serves the job's etcd; default 127.0.0.1).
        master_port: its port (default 29500); on one node, the c10d store's port.
        node_rank: torchrun's ``--node-rank``: 0 serves the static rendezvous; the ranks
            themselves come from the rendezvous (nodes in the order they joined).
        state_dir: where the etcd this node serves (``serve_etcd``) keeps its data, in
            ``<state_dir>/etcd/<job>-<port>`` (mode 0700), so a restarted node serves the same
            data; removed when the job ends. Default ``$XDG_STATE_HOME/efdl``, else
            ``~/.local/state/efdl``.
        role: torchrun's ``--role`` (ROLE_NAME).
        cache_url: where committed state is persisted (any fsspec URL or a directory);
            default with ``--standalone``: ``<log_dir>/<job>/cache`` when ``log_dir`` is set.
        cache_every_steps: persist every this many commits (0: not by count).
        cache_every_s: persist when this many seconds passed since the last (0: not by time).
        cache_keep: complete snapshots kept in the cache.
        peer_copies: a sharded model's workers also keep a snapshot every this many commits
            in host memory, their own and a partner's on another node (efdl.worker.peers);
            0: none.
        new_run: start a new run of a job that has ended (finished, stopped or failed); without
            it efdl-run refuses such a job. The new run keeps the job's remote cache.
        straggler_ratio: a node whose own work per step (efdl.worker.pace) takes this many
            times the other nodes' is slow: an event and a metric.
        straggler_window: steps per judgment of the nodes' pace (the median over them).
        evict_stragglers: a slow node leaves the job in place (held out for a while, its
            place taken by a spare if one waits), if the job keeps its min without it.
        quarantine_ttl_s: how long a node that holds itself out as bad (a failed health
            check, a crash loop) stays out of the job before it is offered again
            (efdl.rendezvous.holds).
        quarantine_after: this many failures of this node's workers with the same error
            (exit code or signal, and last error line) within ``quarantine_window_s``
            quarantine the node instead of restarting it again (0: never).
        quarantine_window_s: the window of ``quarantine_after``.
        health_interval_s: run the health checks (efdl.launcher.health) this often while the
            node trains (they run before it joins too); 0: only before it joins.
        health_check: a command of the user's, run (through the shell) before the node joins
            and at each health interval; a non-zero exit quarantines the node, its output's
            tail in the reason.
        health_check_timeout_s: the longest ``health_check`` may run; past it, it is killed
            and counts as failed.
        health_collective: before it joins, the node runs its own all-reduce, one process per
            slot over the workers' backend (efdl.launcher.collective); a failure or a hang
            past ``health_check_timeout_s`` quarantines it.
        health_min_free_mb: the node is unhealthy when its cache directory (a local
            ``--cache-url``) has less free space than this, or than twice the last snapshot
            it wrote, whichever is more.
    """

    standalone: bool = False
    job_id: str | None = None
    min_workers: int | None = dataclasses.field(default=None, metadata={"option": "min"})
    max_workers: int | None = dataclasses.field(default=None, metadata={"option": "max"})
    nnodes: str | None = None
    nproc_per_node: str = "auto"
    gpus: str | None = None
    node_id: str | None = None
    host: str | None = None
    store_port: int = 0
    lease_ttl_s: int = 5
    settle_s: float = 1.0
    join_timeout_s: float = 600.0
    max_restarts: int = 3
    warm_workers: int | None = None
    grace_period_s: float = 30.0
    hang_timeout_s: float | None = None
    fence_timeout_s: float | None = None
    metrics_port: int | None = None
    log_format: str = "text"
    log_dir: Path | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str | None = None
    rank_prefix: bool = False
    duplicate_stdout_filters: str | None = None
    duplicate_stderr_filters: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    virtual_local_rank: bool = False
    serve_etcd: bool = False
    master_addr: str | None = None
    master_port: int | None = None
    node_rank: int | None = None
    state_dir: Path | None = None
    role: str = "default"
    cache_url: str | None = None
    cache_every_steps: int = 0
    cache_every_s: float = 60.0
    cache_keep: int = 2
    peer_copies: int = 0
    new_run: bool = False
    straggler_ratio: float = 1.5
    straggler_window: int = 20
    evict_stragglers: bool = False
    quarantine_ttl_s: float = 3600.0
    quarantine_after: int = 3
    quarantine_window_s: float = 1800.0
    health_interval_s: float = 300.0
    health_check: str | None = None
    health_check_timeout_s: float = 60.0
    health_collective: bool = False
    health_min_free_mb: int = dataclasses.field(
        default=1024, metadata={"option": "health_min_free"}
    )

    def __post_init__(self) -> None:
        word = self.nproc_per_node.strip().lower()
        if word not in NPROC_WORDS and not (word.isdigit() and int(word) > 0):
            raise ConfigError(
                f"--nproc-per-node is {self.nproc_per_node!r}; expected a positive number, "
                "'gpu', 'cpu' or 'auto'."
            )
        if self.gpus is not None and not self.gpus.strip(" ,"):
            raise ConfigError(
                f"--gpus is {self.gpus!r}; expected 'all', 'free' or a list of GPU indices or "
                "UUIDs such as 2,5."
            )
        if self.nnodes is not None:
            self.node_range()  # validates
        for flag, value in (("--min", self.min_workers), ("--max", self.max_workers)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} ({value}) must be at least 1.")
        if (
            self.min_workers is not None
            and self.max_workers is not None
            and self.min_workers > self.max_workers
        ):
            raise ConfigError(
                f"--min ({self.min_workers}) must not be greater than --max ({self.max_workers})."
            )
        if self.lease_ttl_s < 2:
            raise ConfigError(f"--lease-ttl ({self.lease_ttl_s} s) must be at least 2 seconds.")
        if not 0 <= self.store_port < 65536:
            raise ConfigError(f"--store-port ({self.store_port}) must be 0..65535.")
        for name in ("settle_s", "grace_period_s"):
            if getattr(self, name) < 0:
                flag = option_name(name).replace("_", "-")
                raise ConfigError(f"--{flag} ({getattr(self, name)}) must not be negative.")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"--join-timeout ({self.join_timeout_s} s) must be positive.")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise ConfigError(
                f"--hang-timeout ({self.hang_timeout_s} s) must be positive (leave it out for "
                "the default: 90% of the collective timeout)."
            )
        if not self.straggler_ratio > 1:
            raise ConfigError(
                f"--straggler-ratio ({self.straggler_ratio:g}) must be greater than 1: a node "
                "this many times slower than the others is slow."
            )
        if self.straggler_window < MIN_STRAGGLER_WINDOW:
            raise ConfigError(
                f"--straggler-window ({self.straggler_window}) must be at least "
                f"{MIN_STRAGGLER_WINDOW} steps."
            )
        if self.fence_timeout_s is not None and self.fence_timeout_s <= 2 * self.lease_ttl_s:
            raise ConfigError(
                f"--fence-timeout ({self.fence_timeout_s:g} s) must be longer than two lease "
                f"TTLs ({2 * self.lease_ttl_s} s, --lease-ttl {self.lease_ttl_s}): workers would "
                "stop before the lease could tell a lost node from an etcd that is slow."
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts ({self.max_restarts}) must not be negative.")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format is {self.log_format!r}; expected text or json.")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port ({self.metrics_port}) must be a port, 0..65535 (0: any free)."
            )
        if self.warm_workers is not None and self.warm_workers < 0:
            raise ConfigError(f"--warm-workers ({self.warm_workers}) must not be negative.")
        self.log_spec("job")  # validates the output flags
        self.signals()  # validates
        if self.cache_every_steps < 0 or self.cache_every_s < 0:
            raise ConfigError(
                f"--cache-every-steps ({self.cache_every_steps}) and --cache-every "
                f"({self.cache_every_s} s) must not be negative."
            )
        if self.peer_copies < 0:
            raise ConfigError(
                f"--peer-copies ({self.peer_copies}) must be a number of commits between "
                "copies, or 0 for none."
            )
        if self.cache_keep < 1:
            raise ConfigError(f"--cache-keep ({self.cache_keep}) must be at least 1.")
        if self.cache_url is not None and not self.cache_url.strip():
            raise ConfigError("--cache-url is empty; expected a directory or an fsspec URL.")
        if self.node_rank is not None and self.node_rank < 0:
            raise ConfigError(f"--node-rank ({self.node_rank}) must not be negative.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port ({self.master_port}) must be 1..65535.")
        if self.standalone and self.etcd:
            raise ConfigError(
                f"--standalone starts an etcd of its own on 127.0.0.1, and --etcd (or "
                f"EFDL_ETCD) names another, {self.etcd}: give one of them."
            )
        for name, unit, zero_ok, meaning in (
            ("quarantine_ttl_s", " s", False, "how long a node found bad stays out"),
            ("quarantine_after", "", True, "failures; 0: never quarantine for crashes"),
            ("quarantine_window_s", " s", False, "the window the failures count in"),
            ("health_interval_s", " s", True, "0: check only before joining"),
            ("health_check_timeout_s", " s", False, "how long the command may run"),
            ("health_min_free_mb", " MB", True, "0: no disk check"),
        ):
            value = getattr(self, name)
            if not (value >= 0 if zero_ok else value > 0):
                flag = option_name(name, type(self)).replace("_", "-")
                bound = "must not be negative" if zero_ok else "must be positive"
                raise ConfigError(f"--{flag} ({value:g}{unit}) {bound} ({meaning}).")
        if self.health_check is not None and not self.health_check.strip():
            raise ConfigError("--health-check is empty; expected a command to run.")
        if self.serve_etcd and self.standalone:
            raise ConfigError("--serve-etcd is for a job of several nodes; --standalone is one.")

    def resolved(self) -> LaunchConfig:
        """This config with what torchrun's flags imply made explicit (:func:`load` returns
        it so): no etcd and several nodes is torchrun's static rendezvous, served by the node
        of ``--node-rank`` 0 at ``--master-addr:--master-port``; no etcd and one node is a
        standalone run; a standalone run's ``--master-port`` is its store's port; a job
        without ``--job-id`` is torchrun's default run id."""
        changes: dict[str, Any] = {}
        standalone = self.standalone
        if not standalone and not self.etcd:
            nodes = self.node_range() if self.nnodes is not None else (1, 1)
            if nodes[1] > 1:
                addr = self.master_addr or "127.0.0.1"
                host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
                changes["etcd"] = f"{host}:{self.master_port or STATIC_PORT}"
                if not self.node_rank:
                    changes["serve_etcd"] = True
            else:
                changes["standalone"] = standalone = True
        if standalone and self.master_port and not self.store_port:
            changes["store_port"] = self.master_port  # torchrun's store port
        if not standalone and not self.job_id:
            changes["job_id"] = DEFAULT_JOB_ID  # torchrun's default run id
        # replace() checks the result again (__post_init__): --serve-etcd on a standalone run.
        return dataclasses.replace(self, **changes) if changes else self

    def fence_s(self) -> float:
        """The fence timeout: ``--fence-timeout``, else 90 s and at least three lease TTLs."""
        if self.fence_timeout_s is not None:
            return self.fence_timeout_s
        return max(DEFAULT_FENCE_S, 3.0 * self.lease_ttl_s)

    def placement_timeout_s(self) -> float:
        """How long an in-place worker whose collective failed waits for its next placement:
        a lost member is noticed within the lease TTL, its round follows after the settle
        window and a few etcd requests. No placement by then: the failure was the worker's
        own (it ends with its error, and the restart policy applies)."""
        return self.lease_ttl_s + self.settle_s + 2 * self.etcd_timeout_s + 10.0

    def cache_for(self, job_id: str) -> str | None:
        """The cache URL of ``job_id``: --cache-url, or with --standalone and --log-dir a
        directory under the job's log dir; None: nothing is persisted."""
        if self.cache_url:
            return self.cache_url
        if self.standalone and self.log_dir is not None:
            return str(self.log_dir / job_id / "cache")
        return None

    def log_spec(self, job_id: str) -> LogSpec:
        """Where job ``job_id``'s worker output goes (see efdl.output)."""
        return LogSpec(
            self.log_dir / job_id if self.log_dir else None,
            parse_streams(self.redirects, "--redirects"),
            parse_streams(self.tee, "--tee"),
            parse_ranks(self.local_ranks_filter),
            self.rank_prefix,
            {
                STDOUT: parse_filters(self.duplicate_stdout_filters),
                STDERR: parse_filters(self.duplicate_stderr_filters),
            },
        )

    def signals(self) -> tuple[signal.Signals, ...]:
        """``signals_to_handle`` as signals.

        Raises:
            ConfigError: a name that is not a signal, or one that cannot be handled.
        """
        out = []
        for name in filter(None, (n.strip().upper() for n in self.signals_to_handle.split(","))):
            full = name if name.startswith("SIG") else "SIG" + name
            if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
                raise ConfigError(
                    f"--signals-to-handle names {name!r}; expected signals that can be "
                    "handled, such as SIGTERM,SIGINT,SIGUSR1."
                )
            out.append(signal.Signals[full])
        return tuple(out)

    def node_range(self) -> tuple[int, int]:
        """``--nnodes`` as (min, max) nodes."""
        assert self.nnodes is not None
        text = self.nnodes.strip()
        low, _, high = text.partition(":")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError(f"--nnodes is {self.nnodes!r}; expected N or MIN:MAX (e.g. 2:4).")
        lo, hi = int(low), int(high or low)
        if lo < 1 or hi < lo:
            raise ConfigError(f"--nnodes {self.nnodes!r}: MIN must be >= 1 and MAX >= MIN.")
        return lo, hi
