"""The allocator's flags reach its policy, the same for efdl node, allocator and
kube-controller (efdl.cli.fleet)."""

from __future__ import annotations

from typing import Any

import click
from click.testing import CliRunner

from efdl.cli.common import handle_errors
from efdl.cli.fleet import _policy_options
from efdl.fleet.policy import FleetPolicy


def _command(seen: list[FleetPolicy]) -> click.Command:
    @click.command()
    @click.option("--resize-interval", type=float, default=60.0)
    @handle_errors
    @_policy_options
    def cmd(policy: FleetPolicy, **_: Any) -> None:
        seen.append(policy)

    return cmd


def test_the_defaults_are_the_policy_s_own() -> None:
    seen: list[FleetPolicy] = []
    result = CliRunner().invoke(_command(seen), [])
    assert result.exit_code == 0, result.output
    assert seen == [FleetPolicy()]


def test_each_flag_sets_its_field() -> None:
    seen: list[FleetPolicy] = []
    argv = ["--resize-interval", "5", "--resume-after", "0", "--preempt-after", "30",
            "--protect", "0", "--priority-first", "--history-days", "2"]  # fmt: skip
    result = CliRunner().invoke(_command(seen), argv)
    assert result.exit_code == 0, result.output
    assert seen == [
        FleetPolicy(
            resize_interval_s=5.0,
            resume_after_s=0.0,
            preempt_after_s=30.0,
            protect_s=0.0,
            priority_first=True,
            history_s=2 * 86400.0,
        )
    ]


def test_a_bad_value_names_its_flag_and_exits_2() -> None:
    seen: list[FleetPolicy] = []
    result = CliRunner().invoke(_command(seen), ["--preempt-after", "-3"])
    assert result.exit_code == 2 and seen == []
    assert "--preempt-after -3.0 is not a number of seconds >= 0" in result.output
