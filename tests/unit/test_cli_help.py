"""The command line's own help and errors, with no etcd: ``-h`` everywhere, defaults in
``--help``, and a command that names no job."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from efdl.cli import COMMANDS, main
from efdl.cli.common import job_config
from efdl.cli.run import run_main
from efdl.errors import ConfigError


def test_h_is_help_for_efdl_and_efdl_run() -> None:
    for command in (main, run_main):
        result = CliRunner().invoke(command, ["-h"])
        assert result.exit_code == 0 and "Usage:" in result.output, result.output


def test_every_efdl_command_is_found_under_its_own_name() -> None:
    """efdl.cli.COMMANDS names each command where it is imported from when it runs: a name
    that differs from the command's own would list one command and run another."""
    ctx = click.Context(main)
    for name in COMMANDS:
        command = main.get_command(ctx, name)
        assert command is not None and command.name == name, (name, command)
    assert main.get_command(ctx, "nosuch") is None


def test_efdl_run_help_shows_the_defaults() -> None:
    text = " ".join(CliRunner().invoke(run_main, ["--help"]).output.split())
    for option, default in [
        ("--max-restarts", "[default: 3]"),
        ("--lease-ttl", "[default: 5]"),
        ("--grace-period", "[default: 30.0]"),
        ("--cache-keep", "(default 2)"),
    ]:
        start = text.index(option)
        assert default in text[start : start + 400], (option, text[start : start + 400])


@pytest.mark.parametrize("command", ["status", "stop", "events"])
def test_a_command_that_names_no_job_says_how_to_name_one(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EFDL_JOB_ID", raising=False)
    result = CliRunner().invoke(main, [command, "--etcd", "127.0.0.1:9"])
    assert result.exit_code == 2
    assert "No job was named: give --job-id (or set EFDL_JOB_ID" in result.output


def test_the_job_comes_from_the_flag_then_efdl_job_id_then_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("job-id: from-yaml\netcd: 127.0.0.1:2379\n")
    monkeypatch.delenv("EFDL_JOB_ID", raising=False)
    assert job_config(None, config, {})[0] == "from-yaml"
    monkeypatch.setenv("EFDL_JOB_ID", "from-env")
    assert job_config(None, config, {})[0] == "from-env"
    assert job_config("from-flag", config, {})[0] == "from-flag"
    with pytest.raises(ConfigError, match="The job id 'a/b' is not allowed"):
        job_config("a/b", None, {})
