"""The key-value store interface the rendezvous is built on, its value types and settings.

The interface is etcd v3's model, cut down to what the rendezvous needs: keys with
create/mod revisions, leases that delete their keys when they expire, compare-and-swap
transactions, and watches that replay from a revision. :class:`EtcdStore` implements it
against a real etcd; :class:`MemoryStore` is an in-process fake that passes the same
contract tests.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType

from efdl.errors import ConfigError, StoreError

NO_LEASE = 0


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as the store holds it.

    Attributes:
        key: the full key.
        value: the raw value (empty for a deletion event).
        create_revision: revision that created the key; orders keys by age (elections).
        mod_revision: revision of the last change; the token for compare-and-swap.
        version: number of changes since creation.
        lease: id of the lease the key is bound to, or ``NO_LEASE``.
    """

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int = 1
    lease: int = NO_LEASE


@dataclass(frozen=True, slots=True)
class PrefixSnapshot:
    """All keys under a prefix, read at one revision; watch from ``revision + 1``."""

    kvs: tuple[KeyValue, ...]
    revision: int


class CompareTarget(StrEnum):
    """Which revision of a key a comparison reads (the values are KeyValue's field names)."""

    CREATE = "create_revision"
    MOD = "mod_revision"


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction, as etcd evaluates it: a revision of ``key`` equals
    ``revision`` (an absent key has revisions 0). efdl needs no other comparison."""

    key: str
    target: CompareTarget
    revision: int

    @staticmethod
    def absent(key: str) -> Compare:
        """True when ``key`` does not exist."""
        return Compare(key, CompareTarget.CREATE, 0)

    @staticmethod
    def mod_revision_is(key: str, revision: int) -> Compare:
        """True when ``key`` was last changed at ``revision`` (0: the key is absent)."""
        return Compare(key, CompareTarget.MOD, revision)

    @staticmethod
    def create_revision_is(key: str, revision: int) -> Compare:
        """True when ``key`` was created at ``revision`` (it was not deleted and re-made since)."""
        return Compare(key, CompareTarget.CREATE, revision)


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = NO_LEASE


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    key: str
    prefix: bool = False


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Outcome of a transaction.

    Attributes:
        succeeded: whether every comparison held (the success branch ran).
        revision: the store revision after the transaction.
        gets: the results of the ``Get`` operations of the branch that ran, in order.
    """

    succeeded: bool
    revision: int
    gets: tuple[tuple[KeyValue, ...], ...] = ()


class EventType(StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change to one key; for ``DELETE`` the value is empty and mod_revision is the deletion's."""

    type: EventType
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """The events of one or more whole revisions, in revision order.

    Attributes:
        events: the changes.
        revision: the store revision this batch brings the watcher up to.
        reset: the watch could not replay from the revision asked (it was compacted) and
            re-listed instead: ``events`` are PUTs of every key that exists now, and the
            watcher must drop what it knew before.
    """

    events: tuple[WatchEvent, ...]
    revision: int
    reset: bool = False


WatchSink = Callable[[WatchBatch | StoreError], None]


class Watch:
    """A stream of :class:`WatchBatch` from a store; filled by the store, drained by the caller.

    Waiting is a blocking queue read with a deadline, never a poll of the store. With a
    ``sink``, batches go to that callable instead (called from the store's thread; it must
    only hand the batch on), so one thread can wait on several watches through one queue.
    """

    def __init__(
        self,
        description: str,
        on_cancel: Callable[[], None] | None = None,
        sink: WatchSink | None = None,
    ) -> None:
        self.description = description
        self._queue: queue.Queue[WatchBatch | StoreError] = queue.Queue()
        self._cancelled = threading.Event()
        self._on_cancel_hook = on_cancel
        self._sink = sink

    # The producer side (the store).
    def _deliver(self, item: WatchBatch | StoreError) -> None:
        if self._cancelled.is_set():
            return
        if self._sink is not None:
            self._sink(item)
        else:
            self._queue.put(item)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # The consumer side.
    def get(self, timeout_s: float | None = None) -> WatchBatch | None:
        """Next batch, or None if none came within ``timeout_s`` (or the watch is cancelled).

        Raises:
            StoreError: the watch failed for good (e.g. permission denied).
        """
        if self._cancelled.is_set():
            return None
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, StoreError):
            raise item
        return item

    def cancel(self) -> None:
        """Stop the watch; pending batches are dropped. Idempotent."""
        self._cancelled.set()
        self._on_cancel()

    def _on_cancel(self) -> None:
        """Hook for the store to release its stream."""
        if self._on_cancel_hook is not None:
            self._on_cancel_hook()

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class KVStore(abc.ABC):
    """A strongly consistent key-value store with leases, CAS and watches (etcd v3's model).

    All methods are thread-safe. Every failure is a :class:`~efdl.errors.StoreError`
    whose message names the endpoint.

    A store may forget: an etcd whose data directory was lost comes back empty, one restored
    from a backup comes back older. A store that sees it (a new cluster id, a revision below
    one it saw) says so to the listeners of :meth:`on_forgot` and re-lists every watch (a
    batch with ``reset=True``): nothing kept from before (revisions, records) holds.
    """

    _forgot_listeners: list[Callable[[str], None]]

    def on_forgot(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with the reason (from a store thread; keep it short) each time
        this store finds that the server forgot what it held."""
        if not hasattr(self, "_forgot_listeners"):
            self._forgot_listeners = []
        self._forgot_listeners.append(listener)

    def _forgot(self, reason: str) -> None:
        """Tell the listeners that the server forgot what it held (see :meth:`on_forgot`)."""
        for listener in list(getattr(self, "_forgot_listeners", ())):
            try:
                listener(reason)
            except Exception:
                logging.getLogger(__name__).exception("A store-forgot listener failed.")

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """Where the store is, for log lines and error messages."""

    @abc.abstractmethod
    def get(self, key: str, revision: int = 0) -> KeyValue | None:
        """``key`` as it is (``revision`` 0) or was at ``revision``.

        Raises:
            CompactedError: ``revision`` was compacted.
        """

    @abc.abstractmethod
    def get_prefix(self, prefix: str, revision: int = 0) -> PrefixSnapshot:
        """Every key starting with ``prefix`` (sorted by key), as it is or was at ``revision``
        (as :meth:`get`), and the revision it was read at."""

    @abc.abstractmethod
    def get_range(self, start: str, end: str) -> PrefixSnapshot:
        """Every key from ``start`` up to, not including, ``end`` (sorted by key), and the
        revision it was read at."""

    @abc.abstractmethod
    def last_created(self, prefix: str, before: int) -> PrefixSnapshot:
        """The key under ``prefix`` created last before revision ``before`` (none: an empty
        snapshot), and the revision it was read at: etcd's election pattern, one key in the
        answer however many there are."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        """Write ``key``; returns the new store revision."""

    @abc.abstractmethod
    def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it with ``prefix``); returns how many went."""

    @abc.abstractmethod
    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """Run ``success`` if every comparison holds, else ``failure``; atomically."""

    @abc.abstractmethod
    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""

    @abc.abstractmethod
    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Renew a lease; returns its TTL in seconds, or 0 when it has expired or was revoked.

        ``timeout_s`` bounds this call (default: the store's request timeout).
        """

    @abc.abstractmethod
    def revoke_lease(self, lease_id: int) -> None:
        """End a lease now, deleting its keys. Revoking an unknown lease is not an error."""

    @abc.abstractmethod
    def watch(
        self,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        sink: WatchSink | None = None,
    ) -> Watch:
        """Watch ``key`` (or a prefix) from ``start_revision`` (default: the next revision).

        With ``sink``, batches are handed to it instead of queued for :meth:`Watch.get`.

        No event is missed: events from ``start_revision`` on are replayed in order; if that
        revision was compacted the watch re-lists (a batch with ``reset=True``); if the server
        goes away the watch reconnects and resumes after the last revision it delivered.
        """

    @abc.abstractmethod
    def compact(self, revision: int) -> None:
        """Discard history before ``revision`` (an admin operation; used by tests)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One etcd client endpoint."""

    host: str
    port: int
    tls: bool = False

    @property
    def target(self) -> str:
        """``host:port`` as gRPC wants it (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.target}"

    @staticmethod
    def parse(text: str) -> Endpoint:
        """Parse ``host:port``, ``http://host:port`` or ``https://host:port`` (IPv6 in brackets).

        Raises:
            ConfigError: the text is not an endpoint.
        """
        raw = text.strip()
        tls = False
        for scheme, is_tls in (("https://", True), ("http://", False)):
            if raw.startswith(scheme):
                raw, tls = raw[len(scheme) :], is_tls
        raw = raw.rstrip("/")
        if raw.startswith("["):
            host, sep, rest = raw[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
            ok = bool(sep)
        else:
            host, _, port_text = raw.rpartition(":")
            ok = ":" not in host
        if not ok or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(
                f"The etcd endpoint {text!r} is not of the form host:port "
                "(e.g. 'etcd-1:2379' or 'https://10.0.0.5:2379')."
            )
        return Endpoint(host, int(port_text), tls)


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """How to reach etcd: endpoints (tried in order, failing over), TLS files and credentials.

    The password is never read from a command line: :mod:`efdl.config` takes it from an
    environment variable or a file. It is left out of ``repr``.
    """

    endpoints: tuple[Endpoint, ...]
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    request_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("No etcd endpoint was given; expected at least one host:port.")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(
                "A client certificate needs its key and a key needs its certificate: got "
                f"cert={self.cert_file} and key={self.key_file}."
            )
        for label, path in (("CA", self.ca_file), ("cert", self.cert_file), ("key", self.key_file)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"The etcd TLS {label} file {str(path)!r} does not exist.")
        if (self.user is None) != (self.password is None):
            raise ConfigError(
                f"etcd authentication needs both a user and a password; got user={self.user!r} "
                f"and {'a' if self.password is not None else 'no'} password."
            )
        for name in ("request_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} ({getattr(self, name)}) must be greater than zero.")

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or any(e.tls for e in self.endpoints)

    @property
    def endpoint_list(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    @staticmethod
    def from_list(endpoints: str | Sequence[str], **kwargs: object) -> EtcdSettings:
        """Settings from ``"a:2379,b:2379"`` or a list of endpoint strings."""
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        parsed = tuple(Endpoint.parse(e) for e in items if e.strip())
        return EtcdSettings(parsed, **kwargs)  # type: ignore[arg-type]
