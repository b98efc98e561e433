"""Strict reading of the JSON records efdl gets from outside: etcd's records
(efdl.rendezvous.records) and the cache's manifests and reports (efdl.worker.cache).

Everything read from there is untrusted: each field is checked for its type and range as it is
read, and an error names the record, the field, the value and what was expected, as the
caller's own error class (a RecordError is logged and the record skipped; a SnapshotError
makes the snapshot invalid).
"""

from __future__ import annotations

import json
from typing import Any

from efdl.errors import EfdlError


class Fields:
    """The fields of one JSON object read from ``where``.

    Args:
        data: the decoded JSON (an error if it is not an object).
        where: what it was read from (an etcd key, a file's URL), for the messages.
        error: the error class to raise.
    """

    def __init__(self, data: Any, where: str, error: type[EfdlError]) -> None:
        if not isinstance(data, dict):
            raise error(f"{where} must be a JSON object, not {type(data).__name__}.")
        self.data: dict[str, Any] = data
        self.where = where
        self._error = error

    @classmethod
    def parse(cls, raw: bytes, where: str, error: type[EfdlError]) -> Fields:
        """Decode ``raw`` as one JSON object."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise error(f"{where} is not valid JSON: {exc}.") from None
        return cls(data, where, error)

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def fail(self, text: str) -> EfdlError:
        """An error about this record: ``where`` then ``text``."""
        return self._error(f"{self.where} {text}")

    def value(self, name: str, kind: type | tuple[type, ...]) -> Any:
        """Field ``name``, which must be there and of ``kind`` (a bool is not a number)."""
        if name not in self.data:
            raise self.fail(f"has no field {name!r}.")
        value = self.data[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise self.fail(f"field {name!r} is {value!r}; expected {names}.")
        return value

    def count(self, name: str, low: int = 0, high: int = 1 << 20) -> int:
        """An integer field in ``low..high``."""
        value = int(self.value(name, int))
        if not low <= value <= high:
            raise self.fail(f"field {name!r} is {value}; expected {low}..{high}.")
        return value

    def optional_count(self, name: str, low: int = 0, high: int = 1 << 20) -> int | None:
        """An integer field in ``low..high``, or None where it is null or absent."""
        return None if self.data.get(name) is None else self.count(name, low, high)

    def number(self, name: str, low: float | None = None, high: float | None = None) -> float:
        """A number field (an integer or a float), within [``low``, ``high``] where given."""
        value = float(self.value(name, (int, float)))
        if (low is not None and not value >= low) or (high is not None and not value <= high):
            raise self.fail(f"field {name!r} is {value}, outside {low}..{high}.")
        return value

    def text(self, name: str, limit: int = 256) -> str:
        """A string field of at most ``limit`` characters."""
        value = str(self.value(name, str))
        if len(value) > limit:
            raise self.fail(f"field {name!r} is longer than {limit} characters.")
        return value
