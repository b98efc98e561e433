"""What a state may hold as user values: plain data that every load path can read back.

Snapshots and the state broadcast to newcomers are read with ``torch.load(weights_only=True)``
(a hostile file cannot run code), which knows only plain types. A value it cannot read (a
numpy scalar, a ``datetime``, a ``defaultdict``) would crash every receiving rank at the first
rescale and make every cached snapshot unreadable; so such a value is refused where it enters,
with an error that names it and says what to store instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from efdl.errors import EfdlError

# What torch.load(weights_only=True) reads back (checked in tests/unit/test_values.py).
_LEAVES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, torch.dtype)
_LEAVES += (torch.device, torch.Size)


class StateValueError(EfdlError, TypeError):
    """A user value of the state is not plain data."""


def _hint(value: Any) -> str:
    kind = type(value)
    if kind.__module__ == "numpy":
        return " (a numpy value: store float(x), int(x) or x.tolist())"
    if kind.__module__ == "datetime":
        return " (store x.isoformat() or x.timestamp())"
    if isinstance(value, dict):
        return " (store dict(x))"
    return ""


def check(name: str, value: Any) -> None:
    """Raise :class:`StateValueError` naming the first part of ``value`` that is not plain
    data (None, bool, int, float, complex, str, bytes, tensors, torch dtypes/devices/sizes,
    and lists, tuples, sets and dicts of them)."""
    stack: list[tuple[str, Any]] = [(name, value)]
    while stack:
        where, v = stack.pop()
        kind = type(v)
        if kind in _LEAVES or isinstance(v, torch.Tensor):
            continue
        if kind in (list, tuple, set):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
        elif kind in (dict, OrderedDict):
            stack.extend((f"{where}[{k!r}]", x) for k, x in v.items())
            stack.extend((f"{where} (a key)", k) for k in v)
        else:
            raise StateValueError(
                f"The state value {where} is a {kind.__module__}.{kind.__qualname__} "
                f"({str(v)[:60]!r}); state values must be plain data (numbers, strings, "
                f"bytes, tensors, and lists, tuples, sets and dicts of them), which every "
                f"rank and every snapshot can read back{_hint(v)}."
            )


def check_all(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        check(name, value)
