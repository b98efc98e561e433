"""Every benchmark of the project in one command; writes docs/benchmarks.md.

    python -m benchmarks [--quick] [--out docs/benchmarks.md] [--only startup,recovery,...]

Each part is its own module (``python -m benchmarks.<part>`` prints its tables); this runs
them one after another in fresh processes (so one cannot disturb the next's imports or
threads), and writes their output under a header that says the command, the machine and the
date. Nothing in the report is typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from efdl import __version__

ROOT = Path(__file__).resolve().parents[1]

# (module, title, arguments, quick arguments)
PARTS: list[tuple[str, str, list[str], list[str]]] = [
    ("startup", "Startup, --standalone", ["--repeat", "3"], ["--repeat", "1"]),
    (
        "recovery",
        "Recovery, two-node startup and steady state: "
        "efdl in place and in restart mode vs torchrun",
        ["--repeat", "2", "--default-repeat", "1", "--steady-repeat", "2"],
        ["--repeat", "1", "--events", "leave,kill", "--steady-repeat", "1"],
    ),
    (
        "outage",
        "Control-plane outages: efdl now and before, and TorchFT",
        ["--repeat", "2", "--outage", "60"],
        ["--repeat", "1", "--outage", "20", "--faults", "hung"],
    ),
    (
        "convergence",
        "Convergence under churn",
        ["--seeds", "3", "--epochs", "10"],
        ["--seeds", "1", "--epochs", "4"],
    ),
    (
        "rendezvous_scale",
        "Rendezvous scale",
        ["--sizes", "2,16,64,256", "--repeat", "2"],
        ["--sizes", "2,16", "--repeat", "1"],
    ),
    (
        "rendezvous_fleet",
        "Rendezvous at fleet size",
        [
            "--sizes",
            "512,1024",
            "--repeat",
            "1",
            "--procs",
            "8",
            "--ttl",
            "15",
            "--settle",
            "2",
            "--wave",
            "16",
        ],
        ["--sizes", "64", "--repeat", "1", "--ttl", "15", "--settle", "2"],
    ),
    (
        "state_sync",
        "In-place state sync: newcomers receiving the committed state",
        ["--sizes", "25,100,300", "--repeat", "3", "--world", "3", "--holders", "2"],
        ["--sizes", "25", "--repeat", "1"],
    ),
    (
        "state_scale",
        "The state path at the sizes users train: efdl vs torchrun",
        ["--sizes", "4,25,100,300", "--repeat", "3", "--event-repeat", "2"],
        ["--sizes", "4,25", "--repeat", "1", "--event-repeat", "1", "--events", "join,kill"],
    ),
    (
        "fsdp",
        "FSDP2 in place: the GPT example, efdl vs torchrun restarting from DCP",
        ["--sizes", "25,100,300", "--repeat", "2", "--event-sizes", "25,100"],
        ["--sizes", "25", "--repeat", "1", "--event-sizes", "25", "--churn-steps", "60"],
    ),
    (
        "fleet",
        "The fleet: elastic jobs sharing GPUs with inference by priority, against gang scheduling",
        ["--seeds", "2"],
        ["--seeds", "1", "--no-matrix", "--no-real"],
    ),
    (
        "data",
        "Streamed data: efdl.ElasticStream against a plain pyarrow reader, "
        "HF datasets and MosaicML streaming",
        ["--gb", "2", "--s3-gb", "0.5", "--repeat", "3"],
        ["--gb", "0.5", "--s3-gb", "0.12", "--repeat", "1", "--worlds", "1,2"],
    ),
]


def machine() -> str:
    cpus = os.cpu_count() or 0
    mem = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()}: {cpus} cores{mem}, {gpu}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, efdl {__version__}"
    )


def merge(report: str, fresh: list[str]) -> list[str]:
    """The existing report's sections, with those of the same title replaced by ``fresh``."""
    by_title = {f.splitlines()[0]: f for f in fresh}
    old = ["## " + part for part in report.split("\n## ")[1:]]
    merged = [by_title.pop(o.splitlines()[0], o.rstrip("\n") + "\n") for o in old]
    return merged + list(by_title.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run each (a smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--only", default="", help="comma-separated parts")
    args = parser.parse_args()
    only = {p for p in args.only.split(",") if p}
    started = time.monotonic()
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
    )
    on = machine()
    sections = []
    for module, title, full, quick in PARTS:
        if only and module not in only:
            continue
        argv = [sys.executable, "-m", f"benchmarks.{module}", *(quick if args.quick else full)]
        print(f"== {title}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
        took = time.monotonic() - t0
        body = done.stdout.strip()
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            body += f"\n\n**This part failed (exit {done.returncode}):**\n\n```\n{tail}\n```"
        sections.append(
            f"## {title}\n\nCommit {commit}, on {on}:\n\n```\npython {' '.join(argv[1:])}\n```\n\n"
            f"{body}\n\n(took {took / 60:.1f} min)\n"
        )
    total = (time.monotonic() - started) / 60
    command = "python -m benchmarks" + (" --quick" if args.quick else "")
    header = (
        "# Benchmarks\n\n"
        f"Written by `{command}` on {datetime.date.today().isoformat()} in {total:.0f} min, "
        f"on {machine()}.\nEvery number below is printed by a script in `benchmarks/`; medians "
        "of several runs with (min-max); the machines are shared and noisy, so efdl and "
        "torchrun run interleaved in the same run and compare by ratio.\n"
    )
    if only and args.out.exists():  # replace just these parts; keep the page's opening
        report = args.out.read_text()
        sections = merge(report, sections)
        header = report.split("\n## ")[0].rstrip("\n") + "\n"
    args.out.write_text(header + "\n" + "\n".join(sections))
    print(f"wrote {args.out} ({total:.1f} min)", file=sys.stderr)


if __name__ == "__main__":
    main()
