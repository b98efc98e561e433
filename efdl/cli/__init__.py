"""Command-line entry points: ``efdl`` (the tools, :data:`main`) and ``efdl-run`` (the node
agent, :func:`run_main`).

One module per command group: :mod:`efdl.cli.job` (check, status, events, stop, timeline),
:mod:`efdl.cli.nodes` (nodes, drain, release),
:mod:`efdl.cli.fleet` (submit, jobs, cancel, allocator, node, kube-controller), :mod:`efdl.cli.run`
(efdl-run), with torchrun's flags translated in :mod:`efdl.cli.torchrun_flags`. Only this
package configures logging handlers and turns :class:`~efdl.errors.EfdlError` into a
one-line message and a non-zero exit (:mod:`efdl.cli.common`).
"""

from __future__ import annotations

import click

from efdl import __version__
from efdl.cli import fleet, job, nodes
from efdl.cli.common import setup_logging
from efdl.cli.launching import launch
from efdl.cli.run import launch_config, run_main

__all__ = ["launch", "launch_config", "main", "run_main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="efdl")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """efdl: elastic, fault-tolerant PyTorch training on etcd v3."""
    setup_logging(verbose)


for _command in (
    job.check,
    job.status,
    job.events,
    job.stop,
    job.timeline,
    nodes.nodes,
    nodes.drain,
    nodes.release,
    fleet.submit,
    fleet.jobs,
    fleet.cancel,
    fleet.allocator,
    fleet.node,
    fleet.kube_controller,
):
    main.add_command(_command)
