"""Where worker output goes, as torchrun's output flags say. Pure.

torchrun's console shows a worker's lines as it printed them; ``--tee`` shows them with a
``[role+local rank]:`` label (efdl: ``[rankN]:``, the worker's rank now), ``--redirects``
sends them to files only, ``--local-ranks-filter`` keeps other local ranks off the console.
efdl writes every stream to ``--log-dir`` when it is set (torchrun only the redirected or
teed ones), and ``--rank-prefix`` labels every console line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from efdl.errors import ConfigError

STDOUT, STDERR = 1, 2
STREAM_NAMES = {STDOUT: "stdout", STDERR: "stderr"}


def parse_streams(text: str, flag: str) -> Mapping[int, int] | int:
    """torchrun's ``--redirects`` / ``--tee`` value: ``0``-``3`` for every local rank
    (1 stdout, 2 stderr, 3 both), or ``LOCAL_RANK:N,...`` per local rank.

    Raises:
        ConfigError: ``text`` is neither.
    """
    text = str(text).strip()
    wrong = ConfigError(
        f"{flag} is {text!r}; expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or "
        "LOCAL_RANK:N pairs such as 0:1,1:2."
    )
    pairs = [item.partition(":")[::2] for item in text.split(",")] if ":" in text else []
    values = [v.strip() for _, v in pairs] if pairs else [text]
    if any(v not in ("0", "1", "2", "3") for v in values):
        raise wrong
    if not pairs:
        return int(text)
    if not all(r.strip().isdigit() for r, _ in pairs):
        raise wrong
    return {int(r): int(v) for r, v in pairs}


def parse_ranks(text: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter`` (``0,1,2``) as a set; None: every local rank.

    Raises:
        ConfigError: not a comma-separated list of local ranks.
    """
    if text is None or not text.strip():
        return None
    items = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in items):
        raise ConfigError(
            f"--local-ranks-filter is {text!r}; expected local ranks separated by commas, "
            "such as 0,1,2."
        )
    return frozenset(int(p) for p in items)


def parse_filters(text: str | None) -> tuple[str, ...]:
    """``--duplicate-stdout-filters 'apple,orange'``: the strings a line may contain (a
    doubled comma is a comma, as torchrun reads it)."""
    if not text:
        return ()
    parts = text.replace(",,", "\0").split(",")
    return tuple(p.replace("\0", ",") for p in parts if p)


@dataclass(frozen=True, slots=True)
class LogSpec:
    """Where worker output goes.

    Attributes:
        log_dir: per-rank files ``<log_dir>/gen<g>/rank<r>.{stdout,stderr}`` when set.
        redirects: streams (bits) that go to the files only; one value or per local rank.
        tee: streams (bits) shown on the console with their rank's label even if redirected.
        local_ranks: only these local ranks' lines reach the console (None: all).
        rank_prefix: every console line gets its worker's ``[rankN]: `` label.
        duplicate: lines of stdout / stderr that contain one of these strings are also
            written to ``<log_dir>/filtered_{stdout,stderr}.log``.
    """

    log_dir: Path | None = None
    redirects: Mapping[int, int] | int = 0
    tee: Mapping[int, int] | int = 0
    local_ranks: frozenset[int] | None = None
    rank_prefix: bool = False
    duplicate: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    def to_console(self, local_rank: int, stream: int) -> bool:
        if self.local_ranks is not None and local_rank not in self.local_ranks:
            return False
        return not _bit(self.redirects, local_rank, stream) or self.teed(local_rank, stream)

    def teed(self, local_rank: int, stream: int) -> bool:
        return _bit(self.tee, local_rank, stream)

    def labelled(self, local_rank: int, stream: int) -> bool:
        """Console lines of this stream carry the ``[rankN]: `` label."""
        return self.rank_prefix or self.teed(local_rank, stream)

    def filtered_file(self, stream: int) -> Path | None:
        """Where lines matching ``duplicate[stream]`` are copied; None: nowhere."""
        if self.log_dir is None or not self.duplicate.get(stream):
            return None
        return self.log_dir / f"filtered_{STREAM_NAMES[stream]}.log"


def _bit(spec: Mapping[int, int] | int, local_rank: int, stream: int) -> bool:
    value = spec if isinstance(spec, int) else spec.get(local_rank, 0)
    return bool(value & stream)
