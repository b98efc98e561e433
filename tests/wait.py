"""Waiting on a condition with a deadline (never a fixed sleep standing for "until X")."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    what: str,
    pred: Callable[[], object],
    timeout_s: float,
    poll_s: float = 0.05,
    context: Callable[[], str] | None = None,
) -> None:
    """Return once ``pred()`` is true; fail naming ``what`` after ``timeout_s``, followed by
    ``context()`` (a process's output, say) where given."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= deadline:
            more = f"\n{context()}" if context is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{more}")
        time.sleep(poll_s)
