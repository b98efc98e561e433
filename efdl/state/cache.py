"""The remote cache: committed state on storage, for a job that lost every node.

Any fsspec URL (``s3://bucket/jobs/resnet``, ``memory://x``, ``gs://...``) or a local path.
One snapshot per persisted step::

    <url>/step-000000001234/state.pt        rank 0: model, optimizer, scheduler, sampler,
                                            step and user values (DDP replicas are identical)
    <url>/step-000000001234/rank-00003.pt   rank 3: what is its own (its RNG states)
    <url>/step-000000001234/manifest.json   written last, by rank 0

A snapshot exists only if its manifest is complete and valid: step, epoch, world size, the
size and sha256 of every file, efdl and torch versions. A file that does not match its
manifest (truncated, flipped byte, missing) makes the whole snapshot invalid; the restore
then takes the one before, with a warning naming the file. Files are read with
``torch.load(weights_only=True)``: a hostile file cannot run code.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import fsspec  # type: ignore[import-untyped]

from efdl import __version__
from efdl.errors import ConfigError, EfdlError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE = "state.pt"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^(state|rank-\d{5})\.pt$")


def _torch() -> Any:
    """torch, imported when first needed: the agent reads this module without it."""
    import torch

    return torch


class SnapshotError(EfdlError):
    """A snapshot is missing, incomplete or does not match its manifest."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


@dataclasses.dataclass(frozen=True, slots=True)
class FileInfo:
    size: int
    sha256: str


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

    def to_json(self) -> bytes:
        data = dataclasses.asdict(self)
        return json.dumps(data, indent=1, sort_keys=True).encode()

    @staticmethod
    def parse(raw: bytes, where: str) -> Manifest:
        """Validate a manifest strictly; SnapshotError names what is wrong."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SnapshotError(f"{where} is not valid JSON ({exc}).") from None
        if not isinstance(data, dict):
            raise SnapshotError(f"{where} is not a JSON object.")

        def field(name: str, kind: type | tuple[type, ...]) -> Any:
            value = data.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SnapshotError(f"{where}: {name!r} is {value!r}; expected {kind}.")
            return value

        if field("format", int) != FORMAT:
            raise SnapshotError(f"{where}: format {data['format']} is not {FORMAT}.")
        epoch = data.get("epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
            raise SnapshotError(f"{where}: 'epoch' is {epoch!r}; expected an integer or null.")
        files: dict[str, FileInfo] = {}
        for name, info in field("files", dict).items():
            if not _FILE_NAME.match(name) or not isinstance(info, dict):
                raise SnapshotError(f"{where}: unexpected file entry {name!r}.")
            size, sha = info.get("size"), info.get("sha256")
            if not isinstance(size, int) or size < 0 or not isinstance(sha, str):
                raise SnapshotError(f"{where}: bad size or sha256 for {name!r}.")
            if not _SHA256.match(sha):
                raise SnapshotError(f"{where}: {name!r} has a malformed sha256 {sha!r}.")
            files[name] = FileInfo(size, sha)
        if STATE not in files:
            raise SnapshotError(f"{where} lists no {STATE}.")
        step, world = field("step", int), field("world_size", int)
        if step < 0 or world < 1:
            raise SnapshotError(f"{where}: step {step} / world size {world} out of range.")
        return Manifest(
            step,
            epoch,
            world,
            files,
            str(field("efdl_version", str)),
            str(field("torch_version", str)),
            float(field("created", (int, float))),
        )


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it. A large write is
    hashed on a helper thread while it goes to the file (hashlib and file writes release the
    GIL), so hashing and writing overlap instead of adding up."""

    _PARALLEL = 1 << 20

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="efdl-sha256")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if len(view) < self._PARALLEL:
            self.sha.update(view)
            self._f.write(view)
        else:  # the caller may reuse its buffer once we return: both finish before that
            hashed = self._pool.submit(self.sha.update, view)
            self._f.write(view)
            hashed.result()
        self.size += len(view)
        return len(view)

    def close(self) -> None:
        self._pool.shutdown()
        super().close()


class SnapshotStore:
    """Snapshots under one cache URL (fsspec), newest first.

    Args:
        url: an fsspec URL or a local directory (created if missing).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"--cache-url {url!r} cannot be used: {exc} (install the fsspec "
                "implementation for its protocol, e.g. s3fs for s3://)."
            ) from None
        self.local = "file" in self.fs.protocol
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)

    def path(self, step: int, name: str = "") -> str:
        d = f"{self.root.rstrip('/')}/step-{step:012d}"
        return f"{d}/{name}" if name else d

    def write(self, step: int, name: str, obj: Any) -> FileInfo:
        """``torch.save`` ``obj`` as file ``name`` of snapshot ``step``; its size and sha256."""
        if self.local:
            self.fs.makedirs(self.path(step), exist_ok=True)
        with self.fs.open(self.path(step, name), "wb") as f, _HashingWriter(f) as writer:
            _torch().save(obj, writer)  # storages arrive as single large writes
            if self.local:
                f.flush()
                os.fsync(f.fileno())
        return FileInfo(writer.size, writer.sha.hexdigest())

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest: from now on the snapshot exists."""
        target = self.path(manifest.step, MANIFEST)
        if self.local:  # atomic: a reader sees the whole manifest or none
            tmp = target + ".tmp"
            with open(tmp, "wb") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, manifest.to_json())

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
            raise SnapshotError(f"{where} is missing (the snapshot is incomplete).") from None
        m = Manifest.parse(raw, where)
        if m.step != step:
            raise SnapshotError(f"{where} says step {m.step}, not {step}.")
        return m

    def read(self, m: Manifest, name: str) -> Any:
        """File ``name`` of snapshot ``m``, checked against the manifest, loaded safely."""
        where = self.path(m.step, name)
        data = self._bytes(m, name)
        try:
            return _torch().load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as exc:  # a valid checksum of a file that was bad when written
            raise SnapshotError(f"{where} cannot be loaded: {exc}") from None

    def _bytes(self, m: Manifest, name: str) -> bytes:
        """File ``name`` of snapshot ``m``, checked against the manifest (in memory: the
        restore needs about twice the file's size)."""
        where = self.path(m.step, name)
        info = m.files.get(name)
        if info is None:
            raise SnapshotError(f"{where} is not in its manifest.")
        try:
            data = bytes(self.fs.cat_file(where))
        except FileNotFoundError:
            raise SnapshotError(f"{where} is missing.") from None
        if len(data) != info.size:
            raise SnapshotError(f"{where} has {len(data)} bytes; its manifest says {info.size}.")
        if hashlib.sha256(data).hexdigest() != info.sha256:
            raise SnapshotError(f"{where} does not match the sha256 in its manifest.")
        return data

    def newest(self) -> tuple[Manifest, dict[str, Any]] | None:
        """The newest snapshot that is complete and intact, with its state; older ones are
        tried when a newer one is broken (each skip is logged with the file that broke it)."""
        for step in self.steps():
            try:
                m = self.manifest(step)
                state = self.read(m, STATE)
                for name in m.files:
                    if name != STATE:
                        self._bytes(m, name)  # every rank's file is there and intact
            except SnapshotError as exc:
                log.warning("Skipping cached snapshot of step %d: %s", step, exc)
                continue
            if not isinstance(state, dict) or "model" not in state:
                log.warning("Skipping cached snapshot of step %d: state has no model.", step)
                continue
            return m, state
        return None

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` complete snapshots; delete older ones (and any older
        incomplete ones)."""
        complete = 0
        for step in self.steps():
            if complete >= keep:
                self.fs.rm(self.path(step), recursive=True)
                continue
            try:
                self.manifest(step)
                complete += 1
            except SnapshotError:
                pass  # maybe still being written


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
        "url": "EFDL_CACHE_URL",
        "every_steps": "EFDL_CACHE_EVERY_STEPS",
        "every_s": "EFDL_CACHE_EVERY",
        "keep": "EFDL_CACHE_KEEP",
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
