"""Log lines for people (text) or for log shippers (``--log-format json``).

Text keeps efdl's and torchrun's shapes: ``[efdl 12:00:01.234 INFO] job J node N gen G: ...``
for the agent (its lines name job, node and generation), ``[rank3]: ...`` before each worker
line, as torchrun prints it. JSON is one object per line, agent and worker alike, each with
``time`` (ISO 8601, UTC, milliseconds), ``level``, ``job``, ``node``, ``generation``, and
``rank`` and ``stream`` for worker lines, ``logger`` for the agent's.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
import threading
from typing import Any

FORMATS = ("text", "json")


class Context:
    """What every line of this process names: the job, the node, the generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.job = ""
        self.node = ""
        self.generation = 0

    def set(
        self, job: str | None = None, node: str | None = None, generation: int | None = None
    ) -> None:
        with self._lock:
            if job is not None:
                self.job = job
            if node is not None:
                self.node = node
            if generation is not None:
                self.generation = generation

    def fields(self) -> dict[str, Any]:
        with self._lock:
            return {"job": self.job, "node": self.node, "generation": self.generation}


context = Context()
_json = False  # --log-format json: worker lines too


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            **context.fields(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(verbose: bool, fmt: str = "text") -> None:
    """Configure the root logger (stderr) for ``fmt``; callable again to switch."""
    global _json
    _json = fmt == "json"
    handler = logging.StreamHandler(sys.stderr)
    if _json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(
                "[efdl %(asctime)s.%(msecs)03d %(levelname)s] %(message)s", datefmt="%H:%M:%S"
            )
        )
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True
    )


# torch's excepthook (set by dist.init_process_group) prefixes every line of a traceback so.
_TORCH_PREFIX = re.compile(rb"^(?:\[rank\d+\]: )+")


def without_torch_prefix(line: bytes) -> bytes:
    return _TORCH_PREFIX.sub(b"", line)


def worker_line(rank: int, stream: str, line: bytes, label: bool = True) -> bytes:
    """A line a worker printed, as the console shows it: as printed, or with ``label``
    prefixed with the worker's current rank (torch's own prefix, of the rank the process had
    when it joined, is dropped); with ``--log-format json`` one object with its rank."""
    if not _json and not label:
        return line
    line = without_torch_prefix(line)
    if not _json:
        return f"[rank{rank}]: ".encode() + line
    text = line.decode(errors="replace").rstrip("\n")
    fields = {"time": _now(), "level": "info", **context.fields(), "rank": rank, "stream": stream}
    return (json.dumps({**fields, "message": text}) + "\n").encode()
