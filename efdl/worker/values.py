"""What a state may hold as user values: plain data that every load path can read back, under
names that are not efdl's own (:class:`UserValues`).

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


class UserValues:
    """A state's user values (``state.epoch``, ``state.best_loss``): the names declared at
    ``elastic_state(...)``, each plain data, none of them efdl's own. ``data`` is the one
    mapping they live in; it goes with the state to other ranks and into snapshots.

    Args:
        declared: the values as given to ``elastic_state(...)``.
        reserved: efdl's own names on a state (efdl.worker.state.RESERVED): no value takes one.
    """

    def __init__(self, declared: Mapping[str, Any], reserved: frozenset[str]) -> None:
        taken = sorted(set(declared) & reserved)
        if taken:
            raise StateValueError(
                f"The state value name {taken[0]!r} is efdl's own (state.{taken[0]} is "
                f"read-only){_own_hint(reserved)}"
            )
        check_all(declared)
        self.data: dict[str, Any] = dict(declared)
        self._reserved = reserved

    def read(self, name: str) -> Any:
        """The value ``name``; AttributeError if none was declared so."""
        if name in self.data:
            return self.data[name]
        raise AttributeError(
            f"The state has no value {name!r}; its values are {sorted(self.data)} (declare one "
            f"as efdl.elastic_state(..., {name}=<initial value>))."
        )

    def write(self, name: str, value: Any) -> None:
        """Set the declared value ``name``; :class:`StateValueError` if ``value`` is not plain
        data, if ``name`` is efdl's own, or if it was never declared (it would stay on this
        rank and vanish at the next rescale)."""
        if name in self.data:
            check(name, value)
            self.data[name] = value
        elif name in self._reserved:
            raise StateValueError(
                f"state.{name} is efdl's own and read-only{_own_hint(self._reserved)}"
            )
        else:
            raise StateValueError(
                f"state.{name} is not a value of this state, so it would not go with the state "
                f"to other ranks or snapshots: declare it as efdl.elastic_state(..., "
                f"{name}=<initial value>)."
            )

    def check(self) -> None:
        """Check every value again (one changed in place, a list appended to)."""
        check_all(self.data)


def _own_hint(reserved: frozenset[str]) -> str:
    return (
        f"; give your value another name (e.g. my_step=0 for a step counter of your own). "
        f"efdl's own names: {', '.join(sorted(reserved))}."
    )
