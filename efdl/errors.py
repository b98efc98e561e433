"""One exception hierarchy for efdl.

Every error a user can cause or meet is an :class:`EfdlError`; its message is a
sentence that names the bad value and what was expected. Adapters translate the
errors of the libraries they wrap with ``raise ... from exc``.
"""

from __future__ import annotations


class EfdlError(Exception):
    """Base class of every error efdl raises on purpose."""


class ConfigError(EfdlError, ValueError):
    """A flag, environment variable or config file value is invalid."""


class DataSourceError(EfdlError, ValueError):
    """A shard that cannot be read as the stream needs it (missing, not Parquet, a column
    it lacks, columns unlike the other shards', fewer rows than counted)."""


class StoreError(EfdlError):
    """The key-value store (etcd) failed a request."""


class StoreConnectionError(StoreError):
    """No endpoint of the store answered in time."""


class StoreAuthError(StoreError):
    """The store refused our credentials or our permissions."""


class CompactedError(StoreError):
    """A read asked for a revision the store has compacted away."""


class LeaseLostError(StoreError):
    """Our lease expired or was revoked: every key bound to it is gone."""


class EtcdServerError(EfdlError):
    """The embedded etcd server could not be found, started or stopped."""


class RendezvousError(EfdlError):
    """The rendezvous could not form or follow a round."""


class DuplicateNodeError(RendezvousError):
    """A live node record with this node's id is already in the job."""


class RendezvousTimeoutError(RendezvousError):
    """Not enough workers joined before the join timeout."""


class RendezvousClosedError(RendezvousError):
    """The job was stopped; no further rounds will be formed."""


class StateLostError(EfdlError):
    """No rank holds the job's committed state and no snapshot can bring it back."""
