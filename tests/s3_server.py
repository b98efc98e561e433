"""moto's S3 server, whose GETs of one byte range read only that range (tests/s3.py runs it).

moto builds every GET's response from the whole object and then cuts the range out of it:
70-170 ms of CPU, on the machine's own cores, for any range of a 69 MB object, 1 byte or
8 MB. S3 does not read a whole object to serve a range of it. A reader that asks for the row
groups it needs, a request each (as pyarrow and efdl do), paid the whole object per request
here. With this, a GET of one range ``bytes=a-b`` or ``bytes=a-`` reads that range of the
stored object; every other request is moto's own.

Usage: python -m tests.s3_server -H 127.0.0.1 -p PORT (moto.server's arguments).
"""

from __future__ import annotations

import contextvars
import re
from typing import Any

from moto.s3 import models, responses
from moto.server import main

_ONE_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_ranged: contextvars.ContextVar[bool] = contextvars.ContextVar("ranged", default=False)


class _Range:
    """An object's value, read only where it is cut (moto's range handling cuts it once)."""

    def __init__(self, key: Any) -> None:
        self._key = key

    def __len__(self) -> int:
        return int(self._key.size)

    def __getitem__(self, cut: slice) -> bytes:
        start, stop, _ = cut.indices(len(self))
        with self._key.lock:
            self._key._value_buffer.seek(start)
            data: bytes = self._key._value_buffer.read(max(0, stop - start))
        return data


_get_object = responses.S3Response.get_object
_value: Any = models.FakeKey.value  # a property


def _get_object_of_a_range(self: Any) -> Any:
    if not _ONE_RANGE.match(self.headers.get("range") or ""):
        return _get_object(self)
    token = _ranged.set(True)
    try:
        return _get_object(self)
    finally:
        _ranged.reset(token)


def _value_or_range(self: Any) -> Any:
    return _Range(self) if _ranged.get() else _value.fget(self)


responses.S3Response.get_object = _get_object_of_a_range  # type: ignore[method-assign]
models.FakeKey.value = property(_value_or_range, _value.fset)  # type: ignore[assignment, method-assign]

if __name__ == "__main__":
    main()
