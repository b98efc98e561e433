"""Peer copies: each rank's snapshot files kept in the memory of a rank on another node.

A sharded model's rows (FSDP2) exist on one rank only: when its node dies they are gone, and
the job reads them back from the remote cache and trains again every step since its newest
snapshot. With peer copies (``--peer-copies N``) every rank also writes a snapshot every N
commits (the same writer, files and manifest as the remote cache: efdl.worker.persist) into
host memory: its own (:class:`Store`), and its partner's, a rank on the next node
(:func:`partners`), over HTTP (:class:`Server`). After a crash the ranks read the newest
complete snapshot from the memory of the ranks that live (:class:`PeerFileSystem`, an fsspec
file system over them): a node's files survive on its partner's, and when the copy is of the
newest committed step, no committed step is trained again.

What it costs: per rank, the writer's staging copy of its rows, its own files and its
partner's (for the snapshot being written and the newest complete one): about five times the
rank's share of the state in host memory at the peak, and the rank's share sent over the
network once per copy, from a background thread (no GPU synchronisation on the step).

Who may read or write: each rank's server answers only requests that carry its token, a
random number the ranks of the generation learn from each other over their process group
(:class:`Peer`), never written anywhere else.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import http.client
import http.server
import io
import json
import logging
import os
import secrets
import socket
import sys
import threading
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from fsspec import AbstractFileSystem  # type: ignore[import-untyped]

from efdl.errors import ConfigError
from efdl.protocol.env import NODE_HOST_ENV, NODE_ID_ENV, PEER_COPIES_ENV
from efdl.worker.cache import (
    REPORT,
    CacheSettings,
    FileInfo,
    SnapshotError,
    SnapshotStorage,
    check_file,
)
from efdl.worker.fence import Fence
from efdl.worker.persist import Persister

log = logging.getLogger(__name__)

PROTOCOL = "efdl-peers"
URL = f"{PROTOCOL}://copies"  # the peer tier's cache URL (its root: "copies")
TOKEN_HEADER = "X-Efdl-Token"
TIMEOUT_S = 60.0  # one request to a peer (a part of up to 512 MB on a slow link)
# Step directories one store keeps at most whatever the writer prunes (a rank 0 that died
# between writing a snapshot and pruning the one before leaves it to the next).
MAX_STEPS = 4
LISTERS = 16  # ranks asked at once for a listing
CONNECTIONS = 64  # requests one rank's server serves at once
MAX_FILE = 16 << 30  # the largest file a server takes (parts are at most 512 MB, or a tensor)


@dataclass(frozen=True, slots=True)
class Peer:
    """Where one rank of the generation keeps copies: its node, its server, its token."""

    rank: int
    node: str
    host: str
    port: int
    token: str


def partners(nodes: Sequence[str]) -> list[int]:
    """Per rank (``nodes[r]``: its node), the rank that keeps its copies: a rank of the next
    node (in order of first appearance), round-robin over that node's ranks, so a copy is
    never on its own node when the job has two or more; on one node, the next rank (a worker
    crash, not the node's, is what that covers). Pure."""
    order = list(dict.fromkeys(nodes))
    ranks_of = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out = []
    for r, node in enumerate(nodes):
        nxt = order[(order.index(node) + 1) % len(order)]
        j = ranks_of[node].index(r)
        targets = ranks_of[nxt]
        out.append(targets[(j + int(nxt == node)) % len(targets)])
    return out


def _refs(data: object) -> int:
    return sys.getrefcount(data)


_ALONE = _refs(bytearray(1))  # what _refs says of a buffer held by nothing but the call


class Store:
    """Files in this process's memory, by path (thread-safe).

    The buffers of a removed step directory are kept for the next snapshot's files of the
    same sizes (:meth:`take`; a snapshot's parts have the same sizes each time): writing
    into memory already mapped costs a copy, into new memory a page fault per 4 KB as well,
    which is most of the cost. At most one directory's buffers are kept, and only those no
    reader holds."""

    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self._files: dict[str, bytes | bytearray] = {}
        self._lock = threading.Lock()
        self._max_steps = max_steps
        self._spare: dict[int, list[bytearray]] = {}
        self._sizes: dict[str, int] = {}  # a file name's size when last written

    def take(self, size: int) -> bytearray | None:
        """A kept buffer of exactly ``size`` bytes, no longer anyone's; None: none."""
        with self._lock:
            found = self._spare.get(size)
            return found.pop() if found else None

    def take_for(self, path: str) -> bytearray | None:
        """A kept buffer of the size the file of ``path``'s name had last time."""
        size = self._sizes.get(path.rsplit("/", 1)[-1])
        return self.take(size) if size is not None else None

    def put(self, path: str, data: bytes | bytearray) -> None:
        with self._lock:
            self._files[path] = data
            self._sizes[path.rsplit("/", 1)[-1]] = len(data)
            self._bound(path)

    def get(self, path: str) -> bytes | bytearray | None:
        with self._lock:
            return self._files.get(path)

    def children(self, path: str) -> list[str]:
        """The paths one level under ``path`` (files or directories)."""
        prefix = path.rstrip("/") + "/"
        with self._lock:
            names = {
                prefix + p[len(prefix) :].split("/", 1)[0]
                for p in self._files
                if p.startswith(prefix)
            }
        return sorted(names)

    def remove(self, path: str) -> None:
        """``path`` and everything under it."""
        prefix = path.rstrip("/") + "/"
        with self._lock:
            self._drop([p for p in self._files if p == path or p.startswith(prefix)])

    def _drop(self, paths: list[str]) -> None:
        """Remove ``paths`` (under the lock); their buffers become the kept ones."""
        if not paths:
            return
        self._spare = {}
        for p in paths:
            data = self._files.pop(p)
            if isinstance(data, bytearray) and _refs(data) == _ALONE + 1:  # +1: ``data``
                self._spare.setdefault(len(data), []).append(data)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._files.values())

    def _bound(self, path: str) -> None:
        """Keep at most ``max_steps`` directories beside ``path``'s (step directories sort
        by step): the oldest go."""
        parent, _, _ = path.rpartition("/")
        root, _, _ = parent.rpartition("/")
        if not root:
            return
        prefix = root + "/"
        dirs = sorted(
            {
                p[len(prefix) :].split("/", 1)[0]
                for p in self._files
                if p.startswith(prefix) and "/" in p[len(prefix) :]
            }
        )
        for old in dirs[: max(0, len(dirs) - self._max_steps)]:
            gone = prefix + old + "/"
            self._drop([p for p in self._files if p.startswith(gone)])


class Server:
    """This rank's copies, served over HTTP to the ranks that know its token."""

    def __init__(self, store: Store, host: str) -> None:
        self.store = store
        self.token = secrets.token_hex(16)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = TIMEOUT_S  # a peer gone silent mid-request frees its thread and buffer

            def log_message(self, *args: Any) -> None:  # no line per request
                pass

            def _path(self) -> tuple[str, str] | None:
                given = self.headers.get(TOKEN_HEADER, "")
                if not hmac.compare_digest(given.encode(), server.token.encode()):
                    self.send_error(403, "not a rank of this generation")
                    return None
                kind, _, path = self.path.lstrip("/").partition("/")
                return kind, urllib.parse.unquote(path)

            def _reply(self, code: int, body: bytes | bytearray = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

            def do_GET(self) -> None:
                found = self._path()
                if found is None:
                    return
                kind, path = found
                if kind == "list":
                    self._reply(200, json.dumps(server.store.children(path)).encode())
                    return
                data = server.store.get(path)
                self._reply(404) if data is None else self._reply(200, data)

            def do_PUT(self) -> None:
                found = self._path()
                if found is None:
                    return
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_FILE:
                    self.send_error(400, f"a file of 0 to {MAX_FILE} bytes, with its length")
                    return
                data = server.store.take(length) or bytearray(length)
                view, got = memoryview(data), 0
                while got < length:
                    n = self.rfile.readinto(view[got:])
                    if not n:
                        self.send_error(400, f"the body ended at {got} of {length} bytes")
                        return
                    got += n
                view.release()
                server.store.put(found[1], data)
                self._reply(204)

            def do_DELETE(self) -> None:
                found = self._path()
                if found is None:
                    return
                server.store.remove(found[1])
                self._reply(204)

        self._http = _Listener((host, 0), Handler)
        self.host = host
        self.port = int(self._http.server_address[1])
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="efdl-peer-copies", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


class _Listener(http.server.ThreadingHTTPServer):
    """At most ``CONNECTIONS`` requests served at once (more are closed at once), on IPv4 or
    IPv6 as the host is written."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class PeerFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """An fsspec file system over the generation's ranks' copies: a file is written to this
    rank's store and to its partner's; read from this rank's store or any peer's; listed and
    deleted over all of them. :meth:`place` says who the peers are, at each new generation."""

    protocol = PROTOCOL
    cachable = False  # one per worker, never shared through fsspec's instance cache
    root_marker = ""

    def __init__(self, home: Store, timeout_s: float = TIMEOUT_S) -> None:
        super().__init__()
        self.home = home
        self.timeout_s = timeout_s
        self._others: list[Peer] = []
        self._partner: Peer | None = None
        self._leader: Peer | None = None  # rank 0, where reports go too (not this rank's partner)
        self._holders: dict[str, set[int]] = {}  # file -> the ranks a listing found it at

    def holders(self, path: str) -> dict[str, list[int]]:
        """The ranks a listing found holding each file under ``path`` (rank 0 shares them at
        a resume: :meth:`know`)."""
        prefix = self._strip_protocol(path) + "/"
        return {n: sorted(r) for n, r in self._holders.items() if n.startswith(prefix)}

    def know(self, holders: Mapping[str, Sequence[int]]) -> None:
        """Who holds which file (another rank's :meth:`holders`)."""
        for name, ranks in holders.items():
            self._holders.setdefault(name, set()).update(ranks)

    def place(self, peers: Sequence[Peer], rank: int) -> None:
        """This generation's ranks (``peers[r]``: rank r's), this rank being ``rank``."""
        partner = peers[partners([p.node for p in peers])[rank]]
        self._partner = None if partner.rank == rank else partner
        self._others = [p for p in peers if p.rank != rank]
        self._leader = peers[0] if rank != 0 and peers[0] is not partner else None
        self._holders = {}  # ranks are numbered anew

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        if text.startswith(PROTOCOL + "://"):
            text = text[len(PROTOCOL) + 3 :]
        return text.rstrip("/")

    # ------------------------------------------------------------------ writing

    def _open(self, path: str, mode: str = "rb", **_: Any) -> Any:
        if "w" in mode:
            return _Upload(self, self._strip_protocol(path))
        return io.BytesIO(self.cat_file(path))

    def pipe_file(
        self, path: str, value: bytes | bytearray, mode: str = "overwrite", **_: Any
    ) -> None:
        path = self._strip_protocol(path)
        data = value if isinstance(value, bytes | bytearray) else bytes(value)
        if self._partner is not None:  # first: a failure leaves this rank's store as it was
            self._call(self._partner, "PUT", "files", path, data)
        if self._leader is not None and REPORT.match(path.rsplit("/", 1)[-1]):
            # Rank 0 waits for every rank's report: it finds them all in its own store,
            # without asking every rank at each look (at 1,024 ranks, 1,023 requests a look).
            self._call(self._leader, "PUT", "files", path, data)
        self.home.put(path, data)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass  # directories are prefixes

    def invalidate_cache(self, path: str | None = None) -> None:
        pass  # nothing is cached

    # ------------------------------------------------------------------ reading

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **_: Any
    ) -> bytes:
        data = next(self.copies(path), None)
        if data is None:
            raise FileNotFoundError(path)
        return data if start is None and end is None else data[start:end]

    def copies(self, path: str) -> Iterator[bytes]:
        """Each copy of file ``path`` there is, asked for one at a time: this rank's own,
        then those a listing found holding it (rank 0's, shared at a resume: at 1,024 ranks
        a search in rank order would ask hundreds of ranks for each file), then the rest."""
        path = self._strip_protocol(path)
        own = self.home.get(path)
        if own is not None:
            yield bytes(own)
        known = self._holders.get(path, ())
        for peer in [p for p in self._others if p.rank in known] + [
            p for p in self._others if p.rank not in known
        ]:
            try:
                data = self._call(peer, "GET", "files", path)
            except OSError as exc:
                log.info("Peer copies: rank %d did not answer for %s: %s", peer.rank, path, exc)
                continue
            if data is not None:
                yield data

    def ls(self, path: str, detail: bool = False, **_: Any) -> list[Any]:
        path = self._strip_protocol(path)
        names = set(self.home.children(path))

        def listing(peer: Peer) -> list[str]:
            try:
                return list(json.loads(self._call(peer, "GET", "list", path) or b"[]"))
            except (OSError, ValueError) as exc:
                log.info("Peer copies: rank %d did not list %s: %s", peer.rank, path, exc)
                return []

        with concurrent.futures.ThreadPoolExecutor(LISTERS, "efdl-peer-ls") as pool:
            for peer, listed in zip(self._others, pool.map(listing, self._others), strict=True):
                names.update(listed)
                for name in listed:
                    self._holders.setdefault(name, set()).add(peer.rank)
        found = sorted(names)
        return [{"name": n, "type": "file", "size": None} for n in found] if detail else found

    # ------------------------------------------------------------------ deleting

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for p in [path] if isinstance(path, str) else list(path):
            target = self._strip_protocol(p)
            self.home.remove(target)
            gone = target + "/"
            for name in [n for n in self._holders if n == target or n.startswith(gone)]:
                del self._holders[name]
            for peer in self._others:
                try:
                    self._call(peer, "DELETE", "files", target)
                except OSError as exc:
                    log.info("Peer copies: rank %d did not delete %s: %s", peer.rank, target, exc)

    def rm_file(self, path: str) -> None:
        self.rm(path)

    # ------------------------------------------------------------------ the wire

    def _call(
        self,
        peer: Peer,
        method: str,
        kind: str,
        path: str,
        body: bytes | bytearray | None = None,
    ) -> bytes | None:
        """One request to ``peer``; the body of a 200, None for a 404.

        Raises:
            OSError: the peer did not answer, or refused (any other status).
        """
        conn = http.client.HTTPConnection(peer.host, peer.port, timeout=self.timeout_s)
        try:
            conn.request(
                method,
                f"/{kind}/{urllib.parse.quote(path)}",
                body=body,
                headers={TOKEN_HEADER: peer.token},
            )
            reply = conn.getresponse()
            data = reply.read()
        except (http.client.HTTPException, TimeoutError) as exc:
            raise OSError(f"{peer.host}:{peer.port}: {exc}") from None
        finally:
            conn.close()
        if reply.status == 404:
            return None
        if reply.status not in (200, 204):
            raise OSError(f"{peer.host}:{peer.port} answered {reply.status} {reply.reason}")
        return data


class _Upload(io.RawIOBase):
    """A file being written, into one growing buffer that is sent and kept as it is on
    close (no copy of it is made here)."""

    def __init__(self, fs: PeerFileSystem, path: str) -> None:
        super().__init__()
        self._fs, self._path = fs, path
        # The buffer of this file's previous snapshot (the same size, as a rule), if kept.
        self._data = fs.home.take_for(path) or bytearray()
        self._at = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        end = self._at + len(view)
        if end <= len(self._data):
            self._data[self._at : end] = view  # a copy into memory already there
        else:
            self._data[self._at :] = view
        self._at = end
        return len(view)

    def close(self) -> None:
        if not self.closed:
            super().close()
            del self._data[self._at :]
            self._fs.pipe_file(self._path, self._data)


class PeerStorage(SnapshotStorage):
    """The snapshots of the peer copies: rank 0 looks for the ranks' reports in its own
    store, where every rank sends its report (:meth:`PeerFileSystem.pipe_file`)."""

    def __init__(self, fs: PeerFileSystem) -> None:
        super().__init__(URL, fs=fs)
        self.peers = fs

    def holders(self, step: int) -> dict[str, list[int]]:
        return self.peers.holders(self.path(step))

    def know(self, holders: Mapping[str, Sequence[int]]) -> None:
        self.peers.know(holders)

    def _fetch(self, where: str, info: FileInfo) -> bytes:
        """The first copy of the file that is what the manifest says: a copy left by an
        earlier attempt at the same step, or a damaged one, gives way to the next holder's."""
        bad: SnapshotError | None = None
        for data in self.peers.copies(where):
            try:
                check_file(where, data, info)
            except SnapshotError as exc:
                bad = bad or exc
                continue
            return data
        raise bad or SnapshotError(f"{where} is missing.")

    def reporters(self, step: int) -> set[int]:
        names = self.peers.home.children(self.path(step))
        return {int(m.group(1)) for n in names if (m := REPORT.match(n.rsplit("/", 1)[-1]))}


def copies_every(env: Mapping[str, str]) -> int:
    """The commits between peer copies the agent asked for (``EFDL_PEER_COPIES``; 0: none).

    Raises:
        ConfigError: not a whole number of commits.
    """
    raw = env.get(PEER_COPIES_ENV, "0") or "0"
    try:
        every = int(raw)
    except ValueError:
        every = -1
    if every < 0:
        raise ConfigError(
            f"{PEER_COPIES_ENV}={raw!r}: expected a number of commits between peer copies "
            "(0: none)."
        )
    return every


class PeerCopies:
    """This rank's peer copies: its store and server, the file system over the generation's
    ranks, and the writer that fills them every ``every`` commits.

    Args:
        every: write a snapshot every this many commits (when the writer is free).
        host: the address peers reach this rank's server at (its node's).
        node: this rank's node, for its partner's placement.
        fence: this worker's fence: no snapshot completes once it has closed.
    """

    def __init__(self, every: int, host: str, node: str, fence: Fence | None) -> None:
        self.store = Store()
        self.server = Server(self.store, host)
        self.fs = PeerFileSystem(self.store)
        self.node = node
        # One complete snapshot kept: the next one is written beside it, and it goes once
        # that one is complete.
        settings = CacheSettings(URL, every_steps=every, every_s=0.0, keep=1)
        storage = PeerStorage(self.fs)
        self.persister = Persister(settings, fence=fence, storage=storage)

    @staticmethod
    def from_env(fence: Fence | None, env: Mapping[str, str] | None = None) -> PeerCopies | None:
        """From the agent's ``EFDL_PEER_COPIES`` (None: off).

        Raises:
            ConfigError: it is not a whole number of commits.
        """
        e = os.environ if env is None else env
        every = copies_every(e)
        if every == 0:
            return None
        return PeerCopies(every, e.get(NODE_HOST_ENV, "127.0.0.1"), e.get(NODE_ID_ENV, ""), fence)

    def place(self, group: Any) -> None:
        """Every rank of the new generation at once (on its CPU side ``group``): learn each
        other's servers and tokens; a rank's partner follows from their nodes."""
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = Peer(rank, self.node, self.server.host, self.server.port, self.server.token)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        self.fs.place(gathered, rank)
