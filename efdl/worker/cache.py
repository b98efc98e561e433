"""The remote cache: committed state on storage, for a job that lost every node.

Any fsspec URL (``s3://bucket/jobs/resnet``, ``memory://x``, ``gs://...``) or a local path.
One snapshot per persisted step, written by every rank at once::

    <url>/step-000000001234/state.pt          rank 0: the state's structure and every value
                                              that is not a tensor (sampler, step, user
                                              values, optimizer settings), and which part
                                              holds each tensor
    <url>/step-000000001234/part-00007.pt     tensors (a few hundred MB at most): the
                                              replicated state is cut into parts, and the
                                              ranks write the parts in parallel
    <url>/step-000000001234/rank-00003.pt     rank 3: what is its own (its RNG states)
    <url>/step-000000001234/report-00003.json rank 3: the size and digest of what it wrote,
                                              and the attempt it wrote it in
    <url>/step-000000001234/manifest.json     written last, by rank 0, once every rank
                                              reported in its attempt

An attempt is one writing of a snapshot: its number, random, is chosen by rank 0 and reaches
every rank in the commit agreement that starts it. Rank 0 takes only reports of its own
attempt, so a crashed run's leftovers under the same step (a resumed run that reaches the
step again) are never read; they are overwritten, or deleted once a snapshot completes.

A snapshot exists only if its manifest is complete and valid: step, epoch, world size, the
size and xxh3-128 digest of every file, efdl and torch versions. A file that does not match
its manifest (truncated, flipped byte, missing) makes the whole snapshot invalid; the restore
then takes the one before, with a warning naming the file. Files are read with
``torch.load(weights_only=True)``: a hostile file cannot run code (the digest guards against
corruption, not against someone who can write the cache: that one can write the manifest too).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import fsspec  # type: ignore[import-untyped]
import xxhash

from efdl import __version__
from efdl.errors import ConfigError, EfdlError
from efdl.fields import Fields
from efdl.protocol.env import CACHE_EVERY_ENV, CACHE_EVERY_STEPS_ENV, CACHE_KEEP_ENV, CACHE_URL_ENV

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "state.pt"
FORMAT = 2
DIGEST = "xxh3_128"
# A storage that does not answer a tiny write, read and delete in this long is not usable.
PROBE_TIMEOUT_S = 30.0
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_HEX = re.compile(r"^[0-9a-f]{32}$")
_FILE_NAME = re.compile(r"^(state|rank-\d{5}|part-\d{5})\.pt$")
REPORT = re.compile(r"^report-(\d{5})\.json$")  # a rank's report of its files

Position = tuple[int, int]  # (generation, step): see Manifest.position


def _torch() -> Any:
    """torch, imported when first needed: the agent reads this module without it."""
    import torch

    return torch


class SnapshotError(EfdlError):
    """A snapshot is missing, incomplete or does not match its manifest."""


class IncompleteSnapshot(SnapshotError):
    """A snapshot has no manifest: it is being written, or its writing ended early."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def part_file(part: int) -> str:
    return f"part-{part:05d}.pt"


def report_file(rank: int) -> str:
    return f"report-{rank:05d}.json"


@dataclasses.dataclass(frozen=True, slots=True)
class FileInfo:
    size: int
    digest: str  # xxh3-128, hex


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """What a complete snapshot holds; the last thing written."""

    step: int
    epoch: int | None
    world_size: int
    files: dict[str, FileInfo]
    efdl_version: str = __version__
    torch_version: str = dataclasses.field(default_factory=lambda: _torch().__version__)
    created: float = dataclasses.field(default_factory=time.time)
    format: int = FORMAT
    # The generation that wrote it (0: written before generations were recorded). A snapshot
    # of a newer generation wins over one of an older, whatever their steps: an older
    # generation that trained on while cut off from etcd holds a line the job has left.
    generation: int = 0

    @property
    def position(self) -> tuple[int, int]:
        return (self.generation, self.step)

    def to_json(self) -> bytes:
        data = dataclasses.asdict(self)
        data["files"] = _files_to_json(self.files)
        return json.dumps(data, indent=1, sort_keys=True).encode()

    @staticmethod
    def parse(raw: bytes, where: str) -> Manifest:
        """Validate a manifest strictly; SnapshotError names what is wrong."""
        f = Fields.parse(raw, where, SnapshotError)
        if f.value("format", int) != FORMAT:
            raise f.fail(
                f"has format {f.data['format']}, not {FORMAT} (written by another version of efdl)."
            )
        files = _files_from_json(f.value("files", dict), where)
        if STATE not in files:
            raise f.fail(f"lists no {STATE}.")
        return Manifest(
            f.count("step", 0, 1 << 62),
            f.optional_count("epoch", 0, 1 << 40),
            f.count("world_size", 1, 1 << 20),
            files,
            f.text("efdl_version", 64),
            f.text("torch_version", 64),
            f.number("created"),
            generation=f.optional_count("generation", 0, 1 << 40) or 0,
        )


def _files_to_json(files: Mapping[str, FileInfo]) -> dict[str, dict[str, object]]:
    return {name: {"size": f.size, DIGEST: f.digest} for name, f in files.items()}


def _files_from_json(raw: dict[str, Any], where: str) -> dict[str, FileInfo]:
    """File entries of a manifest or report, each name and digest checked."""
    files: dict[str, FileInfo] = {}
    for name, info in raw.items():
        if not _FILE_NAME.match(name):
            raise SnapshotError(f"{where}: unexpected file entry {name!r}.")
        entry = Fields(info, f"{where} (file {name!r})", SnapshotError)
        digest = entry.text(DIGEST, 64)
        if not _HEX.match(digest):
            raise entry.fail(f"has a malformed {DIGEST} {digest!r}.")
        files[name] = FileInfo(entry.count("size", 0, 1 << 62), digest)
    return files


class _HashingWriter(io.RawIOBase):
    """A write-only file that digests and counts what passes through it (xxh3-128: over
    10 GB/s on one core, so the digest never limits the write)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.hash = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.hash.update(view)
        self._f.write(view)
        self.size += len(view)
        return len(view)


def digest(data: bytes) -> str:
    return str(xxhash.xxh3_128(data).hexdigest())


def check_file(where: str, data: bytes, info: FileInfo) -> None:
    """``data`` (file ``where``) is of the size and digest ``info`` says; else SnapshotError."""
    if len(data) != info.size:
        raise SnapshotError(f"{where} has {len(data)} bytes; its manifest says {info.size}.")
    if digest(data) != info.digest:
        raise SnapshotError(f"{where} does not match the {DIGEST} digest in its manifest.")


class SnapshotStorage:
    """Snapshots under one cache URL (fsspec), newest first.

    Args:
        url: an fsspec URL or a local directory (created if missing).
        fs: the file system to use for ``url`` (the peer copies' own, efdl.worker.peers);
            then a snapshot counts only if every file its manifest names is listed (a
            rank's files go with it and its partner: both may be gone).
    """

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url = url
        self.whole_only = fs is not None
        try:
            self.fs, self.root = (
                (fs, fs._strip_protocol(url)) if fs is not None else fsspec.core.url_to_fs(url)
            )
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"--cache-url {url!r} cannot be used: {exc} (install the fsspec "
                "implementation for its protocol, e.g. s3fs for s3://)."
            ) from None
        self.local = "file" in self.fs.protocol
        if self.local:
            try:
                self.fs.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"--cache-url {url!r} cannot be used: its directory cannot be made "
                    f"({exc.strerror or exc})."
                ) from None

    def check(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """Write, read back and delete a small file, within ``timeout_s``: a cache that cannot
        work (no credentials, no permission, a path that cannot be made, no answer) fails
        here, in one sentence, rather than in the workers at their first snapshot.

        Raises:
            ConfigError: what failed, with the URL and what to check.
        """
        target = f"{self.root.rstrip('/')}/.efdl-probe-{uuid.uuid4().hex[:12]}"
        failure: list[BaseException] = []

        def probe() -> None:
            try:
                data = b"efdl cache probe"
                self._put(target, data)
                if self.fs.cat_file(target) != data:
                    raise OSError("the probe file read back differs from what was written")
                self.fs.rm_file(target)
            except BaseException as exc:  # reported to the caller below
                failure.append(exc)

        thread = threading.Thread(target=probe, name="efdl-cache-probe", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise ConfigError(
                f"--cache-url {self.url!r} cannot be used: writing, reading and deleting a "
                f"probe file did not finish within {timeout_s:g} s (is the storage reachable?)."
            )
        if failure:
            exc = failure[0]
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(
                f"--cache-url {self.url!r} cannot be used: writing, reading and deleting a "
                f"probe file failed ({type(exc).__name__}{': ' + first if first else ''}); "
                "check its credentials and permissions, or run without --cache-url."
            )

    def path(self, step: int, name: str = "") -> str:
        d = f"{self.root.rstrip('/')}/step-{step:012d}"
        return f"{d}/{name}" if name else d

    def write(self, step: int, name: str, obj: Any, sync: bool = True) -> FileInfo:
        """``torch.save`` ``obj`` as file ``name`` of snapshot ``step``; its size and digest.

        Args:
            sync: on a local directory, wait until the file is on disk. A writer of several
                files writes them all first and then :meth:`sync` s them: the disk then
                writes one file while the next is still being made.
        """
        if self.local:
            self.fs.makedirs(self.path(step), exist_ok=True)
        with self.fs.open(self.path(step, name), "wb") as f, _HashingWriter(f) as writer:
            _torch().save(obj, writer)  # storages arrive as single large writes
            if self.local and sync:
                f.flush()
                os.fsync(f.fileno())
        return FileInfo(writer.size, writer.hash.hexdigest())

    def sync(self, step: int, names: Iterable[str]) -> None:
        """Wait until files of snapshot ``step`` written with ``sync=False`` are on disk (an
        object store's files are, once written)."""
        if not self.local:
            return
        for name in names:
            fd = os.open(self.path(step, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _put(self, target: str, data: bytes) -> None:
        """Write a small file atomically: a reader sees all of it or none."""
        if self.local:
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            tmp = target + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:  # an object store's PUT is atomic
            self.fs.pipe_file(target, data)

    def report(self, step: int, rank: int, files: Mapping[str, FileInfo], attempt: int) -> None:
        """Say what ``rank`` wrote for snapshot ``step`` in ``attempt`` (rank 0 gathers the
        reports of its own attempt only)."""
        data = json.dumps({"rank": rank, "attempt": attempt, "files": _files_to_json(files)})
        self._put(self.path(step, report_file(rank)), data.encode())

    def reported(self, step: int, rank: int, attempt: int) -> dict[str, FileInfo] | None:
        """What ``rank`` reported for ``step`` in ``attempt``; None if it has not (yet): no
        report, or one of another attempt (a crashed run's leftovers, read as not there)."""
        where = self.path(step, report_file(rank))
        try:
            raw = self.fs.cat_file(where)
        except FileNotFoundError:
            return None
        f = Fields.parse(raw, where, SnapshotError)
        if f.count("rank") != rank:
            raise f.fail(f"is not rank {rank}'s report.")
        if f.optional_count("attempt", 0, (1 << 63) - 1) != attempt:
            return None
        return _files_from_json(f.value("files", dict), where)

    def reporters(self, step: int) -> set[int]:
        """The ranks with a report file in snapshot ``step`` (of any attempt): one listing."""
        self.fs.invalidate_cache(self.path(step))
        try:
            entries = self.fs.ls(self.path(step), detail=False)
        except FileNotFoundError:
            return set()
        found = set()
        for entry in entries:
            m = REPORT.match(str(entry).rsplit("/", 1)[-1])
            if m:
                found.add(int(m.group(1)))
        return found

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest: from now on the snapshot exists."""
        self._put(self.path(manifest.step, MANIFEST), manifest.to_json())

    def steps(self) -> list[int]:
        """Steps that have a snapshot directory (complete or not), newest first."""
        self.fs.invalidate_cache()  # s3fs and others cache listings
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            m = _STEP_DIR.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(set(steps), reverse=True)

    def manifest(self, step: int) -> Manifest:
        where = self.path(step, MANIFEST)
        try:
            raw = self.fs.cat_file(where)
        except FileNotFoundError:
            raise IncompleteSnapshot(f"{where} is missing (the snapshot is incomplete).") from None
        m = Manifest.parse(raw, where)
        if m.step != step:
            raise SnapshotError(f"{where} says step {m.step}, not {step}.")
        return m

    def read(self, m: Manifest, name: str) -> Any:
        """File ``name`` of snapshot ``m``, checked against the manifest, loaded safely (in
        memory: about twice the file's size while it loads)."""
        where = self.path(m.step, name)
        info = m.files.get(name)
        if info is None:
            raise SnapshotError(f"{where} is not in its manifest.")
        data = self._fetch(where, info)
        try:
            return _torch().load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as exc:  # a valid digest of a file that was bad when written
            raise SnapshotError(f"{where} cannot be loaded: {exc}") from None

    def _fetch(self, where: str, info: FileInfo) -> bytes:
        """The bytes of file ``where``, of the size and digest ``info`` says.

        Raises:
            SnapshotError: missing, or not what the manifest says.
        """
        try:
            data = bytes(self.fs.cat_file(where))
        except FileNotFoundError:
            raise SnapshotError(f"{where} is missing.") from None
        check_file(where, data, info)
        return data

    def structure(self, m: Manifest) -> Structure:
        """Snapshot ``m``'s structure: ``state.pt``, checked."""
        state = self.read(m, STATE)
        where = self.path(m.step, STATE)
        if not isinstance(state, dict) or not isinstance(state.get("tree"), dict):
            raise SnapshotError(f"{where} holds no state tree.")
        parts = state.get("parts")
        if not isinstance(parts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in parts.items()
        ):
            raise SnapshotError(f"{where} has no valid map of tensors to parts.")
        rows = state.get("rows", {})
        if not isinstance(rows, dict) or not all(
            isinstance(k, str)
            and isinstance(v, list)
            and len(v) == m.world_size
            and all(isinstance(name, str) for name in v)
            for k, v in rows.items()
        ):
            raise SnapshotError(
                f"{where} has no valid map of sharded tensors to the parts of each of its "
                f"{m.world_size} ranks' rows."
            )
        named = set(parts.values()) | {name for names in rows.values() for name in names}
        missing = sorted(named - set(m.files))
        if missing:
            raise SnapshotError(f"{where} names parts its manifest lacks: {missing[:3]}.")
        if "model" not in state["tree"]:
            raise SnapshotError(f"{where}: the state has no model.")
        devices = state.get("devices", {})
        if not isinstance(devices, dict):
            raise SnapshotError(f"{where} has no valid map of tensors to devices.")
        structure = Structure(m, state["tree"], parts, devices, rows)
        unplaced = [k for k in structure.tensor_keys() if k not in parts and k not in rows]
        if unplaced:
            raise SnapshotError(f"{where}: tensor {unplaced[0]} is in no part.")
        return structure

    def manifests(self) -> list[Manifest]:
        """The complete snapshots' manifests, newest first: newer generation first, then newer
        step (see :attr:`Manifest.generation`). Incomplete ones are left out; broken ones too,
        with a warning naming the file."""
        found = []
        for step in self.steps():
            try:
                found.append(self.manifest(step))
            except IncompleteSnapshot:
                continue
            except SnapshotError as exc:
                log.warning("Skipping cached snapshot of step %d: %s", step, exc)
        return sorted(found, key=lambda m: m.position, reverse=True)

    def newest_structure(
        self, below: Position | None = None, above: Position | None = None
    ) -> Structure | None:
        """The newest snapshot (older than ``below``, newer than ``above``: positions, see
        :attr:`Manifest.position`) whose manifest and structure read; broken ones are
        skipped with a warning naming the file."""
        for m in self.manifests():
            if below is not None and m.position >= below:
                continue
            if above is not None and m.position <= above:
                return None
            try:
                if self.whole_only:
                    self._all_there(m)
                return self.structure(m)
            except SnapshotError as exc:
                log.warning("Skipping cached snapshot of step %d: %s", m.step, exc)
        return None

    def holders(self, step: int) -> dict[str, list[int]]:
        """Where each file of snapshot ``step`` was found, by rank (the peer copies'; a
        storage of its own: nothing to say)."""
        return {}

    def know(self, holders: Mapping[str, Sequence[int]]) -> None:
        """Where files were found (another rank's :meth:`holders`)."""

    def _all_there(self, m: Manifest) -> None:
        """Every file ``m`` names is listed (one listing of its directory).

        Raises:
            SnapshotError: one is not.
        """
        listed = {str(e).rsplit("/", 1)[-1] for e in self.fs.ls(self.path(m.step), detail=False)}
        missing = sorted(set(m.files) - listed)
        if missing:
            raise SnapshotError(f"{self.path(m.step)} lacks {', '.join(missing[:3])}.")

    def newest(self) -> tuple[Manifest, dict[str, Any]] | None:
        """The newest complete, intact snapshot read whole in this process: its manifest and
        its state tree with every tensor in place (tools and tests; a job resumes with every
        rank reading some of the parts, see efdl.worker.resume)."""
        below: Position | None = None
        while (layout := self.newest_structure(below)) is not None:
            try:
                m = layout.manifest
                read = {name: self.read(m, name) for name in layout.part_names()}
                tensors = {key: _entry(read, name, key, m) for key, name in layout.parts.items()}
                for key, names in layout.rows.items():  # each rank's rows, joined
                    tensors[key] = _torch().cat([_entry(read, n, key, m) for n in names])
                for name in layout.manifest.files:
                    if name.startswith("rank-"):
                        self.read(layout.manifest, name)  # every rank's file is intact
                return layout.manifest, layout.fill(tensors)
            except SnapshotError as exc:
                log.warning("Skipping cached snapshot of step %d: %s", layout.manifest.step, exc)
                below = layout.manifest.position
        return None

    def prune(self, keep: int, written: int | None = None) -> None:
        """Keep the newest ``keep`` complete snapshots (by position); delete older ones and
        any incomplete one older than those kept. ``written``: the step whose manifest this
        job has just written, when no other snapshot of it is being written (one at a time):
        then every incomplete one, newer too, is a crashed attempt's leftover, and goes."""
        complete = self.manifests()
        kept = {m.step for m in complete[:keep]}
        done = {m.step for m in complete}
        oldest_kept = min(kept) if len(kept) >= keep else -1
        for step in self.steps():
            if step in kept:
                continue
            if step in done or step < oldest_kept or (written is not None and step != written):
                self.fs.rm(self.path(step), recursive=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Structure:
    """A snapshot's structure: the state tree with every tensor a meta tensor of the right
    shape and dtype, and which part file holds each tensor (by its pytree key path)."""

    manifest: Manifest
    tree: dict[str, Any]
    parts: dict[str, str]  # replicated tensor's key path -> part file
    devices: dict[str, str]  # tensor key path -> the device type it was persisted from
    # Sharded tensor's key path -> per rank of the snapshot's world, the part of its rows
    # (rows as efdl.worker.layout cuts them: chunk r of world_size along dim 0).
    rows: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def part_names(self) -> list[str]:
        named = set(self.parts.values()) | {n for names in self.rows.values() for n in names}
        return sorted(named)

    def tensor_keys(self) -> list[str]:
        import torch.utils._pytree as pytree

        leaves, _ = pytree.tree_flatten_with_path(self.tree)
        return [pytree.keystr(p) for p, leaf in leaves if isinstance(leaf, _torch().Tensor)]

    def fill(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The tree with each meta tensor replaced by ``tensors[its key path]``."""
        import torch.utils._pytree as pytree

        leaves, spec = pytree.tree_flatten_with_path(self.tree)
        out = []
        for path, leaf in leaves:
            if isinstance(leaf, _torch().Tensor):
                key = pytree.keystr(path)
                if key not in tensors:
                    raise SnapshotError(
                        f"{self.manifest.step}: tensor {key} is in no part of the snapshot."
                    )
                leaf = tensors[key]
            out.append(leaf)
        filled: dict[str, Any] = pytree.tree_unflatten(out, spec)
        return filled


def _entry(read: Mapping[str, Any], name: str, key: str, m: Manifest) -> Any:
    """Tensor ``key`` of part ``name`` as read; SnapshotError if the part lacks it."""
    part = read[name]
    if not isinstance(part, dict) or key not in part:
        raise SnapshotError(f"step {m.step}: {name} holds no {key}.")
    return part[key]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheSettings:
    """How a worker persists: where, how often, how many to keep.

    Attributes:
        url: the cache URL.
        every_steps: persist every this many commits (0: not by count).
        every_s: persist when this many seconds passed since the last one (0: not by time).
        keep: complete snapshots kept.
    """

    url: str
    every_steps: int = 0
    every_s: float = 60.0
    keep: int = 2

    ENV: ClassVar[dict[str, str]] = {
        "url": CACHE_URL_ENV,
        "every_steps": CACHE_EVERY_STEPS_ENV,
        "every_s": CACHE_EVERY_ENV,
        "keep": CACHE_KEEP_ENV,
    }

    def to_env(self) -> dict[str, str]:
        return {env: str(getattr(self, name)) for name, env in self.ENV.items()}

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> CacheSettings | None:
        e = os.environ if env is None else env
        url = e.get(CacheSettings.ENV["url"])
        if not url:
            return None
        try:
            return CacheSettings(
                url,
                int(e.get(CacheSettings.ENV["every_steps"], "0")),
                float(e.get(CacheSettings.ENV["every_s"], "60")),
                int(e.get(CacheSettings.ENV["keep"], "2")),
            )
        except ValueError as exc:
            raise ConfigError(f"Bad EFDL_CACHE_* setting: {exc}.") from None
