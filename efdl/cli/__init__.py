"""Command-line entry points: ``efdl`` (the tools, :data:`main`) and ``efdl-run`` (the node
agent, :func:`efdl.cli.run.run_main`).

One module per command group: :mod:`efdl.cli.job` (check, status, events, stop, timeline),
:mod:`efdl.cli.nodes` (nodes, drain, release),
:mod:`efdl.cli.fleet` (submit, jobs, cancel, allocator, node, kube-controller), :mod:`efdl.cli.run`
(efdl-run), with torchrun's flags translated in :mod:`efdl.cli.torchrun_flags`. Only this
package configures logging handlers and turns :class:`~efdl.errors.EfdlError` into a
one-line message and a non-zero exit (:mod:`efdl.cli.common`).

A command's module is imported when that command runs (or ``efdl --help`` lists them): each
process of efdl (an agent, ``efdl status``) imports only what it uses, which is most of its
start's CPU.
"""

from __future__ import annotations

import importlib

import click

from efdl import __version__
from efdl.cli.common import setup_logging

__all__ = ["main"]

# Each ``efdl`` command: its name and where it is (module, function).
COMMANDS = {
    "check": ("efdl.cli.job", "check"),
    "status": ("efdl.cli.job", "status"),
    "events": ("efdl.cli.job", "events"),
    "stop": ("efdl.cli.job", "stop"),
    "timeline": ("efdl.cli.job", "timeline"),
    "nodes": ("efdl.cli.nodes", "nodes"),
    "drain": ("efdl.cli.nodes", "drain"),
    "release": ("efdl.cli.nodes", "release"),
    "submit": ("efdl.cli.fleet", "submit"),
    "jobs": ("efdl.cli.fleet", "jobs"),
    "cancel": ("efdl.cli.fleet", "cancel"),
    "allocator": ("efdl.cli.fleet", "allocator"),
    "node": ("efdl.cli.fleet", "node"),
    "kube-controller": ("efdl.cli.fleet", "kube_controller"),
}


class _Commands(click.Group):
    """The group whose commands are imported when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = COMMANDS.get(cmd_name)
        if where is None:
            return None
        command = getattr(importlib.import_module(where[0]), where[1])
        assert isinstance(command, click.Command)
        return command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="efdl")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """efdl: elastic, fault-tolerant PyTorch training on etcd v3."""
    setup_logging(verbose)
