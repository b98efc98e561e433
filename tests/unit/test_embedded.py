"""Finding the etcd binary; no server is started here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from efdl.errors import EtcdServerError
from efdl.rendezvous.embedded import find_etcd_binary


def test_env_var_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("EFDL_ETCD_BIN", str(fake))
    assert find_etcd_binary() == fake


def test_env_var_that_is_not_executable_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EFDL_ETCD_BIN", str(tmp_path / "missing"))
    with pytest.raises(
        EtcdServerError, match=r"EFDL_ETCD_BIN='.*missing' is not an executable file"
    ):
        find_etcd_binary()


def test_default_finds_a_real_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EFDL_ETCD_BIN", raising=False)
    found = find_etcd_binary()
    assert found.is_file() and os.access(found, os.X_OK)
