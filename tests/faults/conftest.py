"""The fault matrix's switches and its report.

    python -m pytest tests/faults                                  # once each (CI)
    EFDL_SOAK=10 EFDL_RELIABILITY_REPORT=docs/reliability.md python -m pytest tests/faults

EFDL_SOAK=N runs every fault N times; EFDL_RELIABILITY_REPORT=PATH writes the table of fault x
runs x outcome x recovery time (docs/reliability.md is written this way, by the suite itself).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults import netns
from tests.faults.netns import Net

SOAK = int(os.environ.get("EFDL_SOAK", "1") or "1")


@dataclass
class Outcomes:
    """Per fault: its description, how each run ended, recovery times, what was checked."""

    doc: dict[str, str] = field(default_factory=dict)
    passed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    recovery: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


OUTCOMES = Outcomes()


class Recorder:
    """Given to each fault test: it records the recovery time it measured."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def recovered(self, seconds: float) -> None:
        OUTCOMES.recovery[self.fault].append(seconds)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attempt" in metafunc.fixturenames:
        metafunc.parametrize("attempt", range(SOAK), ids=[f"run{i + 1}" for i in range(SOAK)])


@pytest.fixture()
def record(request: pytest.FixtureRequest) -> Iterator[Recorder]:
    fn = request.function
    OUTCOMES.doc[fn.__name__] = " ".join((fn.__doc__ or fn.__name__).split())
    yield Recorder(fn.__name__)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    fn = getattr(item, "function", None)
    if fn is not None and "record" in getattr(item, "fixturenames", ()):
        name = fn.__name__
        if report.when == "call" and report.passed:
            OUTCOMES.passed[name] += 1
        elif report.failed:
            first = str(report.longrepr).strip().splitlines()[-1][:200] if report.longrepr else ""
            OUTCOMES.failed[name].append(f"{report.when}: {first}")
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("EFDL_RELIABILITY_REPORT")
    if path and OUTCOMES.doc:
        fresh = render(OUTCOMES)
        old = Path(path).read_text() if Path(path).exists() else ""
        Path(path).write_text(merge(old, fresh, set(OUTCOMES.doc)) if old else fresh)


def _row_name(line: str) -> str | None:
    return line[4:].split("**", 1)[0] if line.startswith("| **") else None


def merge(old: str, fresh: str, ran: set[str]) -> str:
    """The existing report with the rows (and failures) of the faults that ran replaced by
    this run's, and a line saying which rows were re-run when: a run of some faults (e.g. a
    soak of one file) does not drop the others' rows."""
    new_rows = {_row_name(ln): ln for ln in fresh.splitlines() if _row_name(ln)}
    out, seen = [], set()
    for line in old.splitlines():
        name = _row_name(line)
        if name is not None:
            seen.add(name)
            out.append(new_rows.get(name, line))
            continue
        if line.startswith("- ") and line[2:].split(":", 1)[0] in ran:
            continue  # an old failure of a fault that ran again
        out.append(line)
    last_row = max(i for i, ln in enumerate(out) if _row_name(ln) is not None)
    out[last_row + 1 : last_row + 1] = [ln for n, ln in new_rows.items() if n not in seen]
    failures = [ln for ln in fresh.splitlines() if ln.startswith("- ")]
    if "Failures:" in out and not failures and not any(ln.startswith("- ") for ln in out):
        del out[out.index("Failures:") - 1 :]  # every failure listed ran again and passed
    if failures:
        if "Failures:" not in out:
            out += ["", "Failures:", ""]
        out += failures
    note = (
        f"Rows re-run on {datetime.date.today().isoformat()} with EFDL_SOAK={SOAK}: "
        + ", ".join(sorted(ran))
        + "."
    )
    header = "| fault and expected outcome | runs | passed | recovery (s), median (min-max) |"
    if note not in out:  # the same rows re-run again the same day: one note
        out.insert(out.index(header), note + "\n")
    return "\n".join(out) + "\n"


def render(o: Outcomes) -> str:
    cpus = os.cpu_count() or 0
    lines = [
        "# Reliability: the fault matrix",
        "",
        f"Written by `EFDL_SOAK={SOAK} EFDL_RELIABILITY_REPORT=<this file> python -m pytest "
        f"tests/faults` on {datetime.date.today().isoformat()}, on {platform.node()} "
        f"({cpus} cores, Python {platform.python_version()}). Every fault is injected into a "
        "real running job: real `efdl-run` agents on 127.0.0.1 (or in network namespaces the "
        "test makes), a real etcd, real torch.distributed (gloo on CPU), the efdl-aware test "
        "script (tests/e2e/scripts/elastic_steps.py, commit every step). After each: all ranks "
        "hold identical parameters at every step, no committed step is lost, no process of "
        "the test is left, and the event shows in `efdl status` or the agents' log. Recovery: "
        "from the fault to the first training step of the job at its new membership.",
        "",
        "| fault and expected outcome | runs | passed | recovery (s), median (min-max) |",
        "|---|---:|---:|---:|",
    ]
    for name, doc in o.doc.items():
        runs = o.passed.get(name, 0) + len(o.failed.get(name, []))
        times = o.recovery.get(name, [])
        rec = (
            f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})" if times else "-"
        )
        lines.append(f"| **{name}**: {doc} | {runs} | {o.passed.get(name, 0)} | {rec} |")
    failures = [(n, f) for n, fs in o.failed.items() for f in fs]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {n}: `{f}`" for n, f in failures]
    return "\n".join(lines) + "\n"


@pytest.fixture()
def net() -> Iterator[Net]:
    """Two network namespaces of the test's own (see tests/faults/netns.py)."""
    why = netns.available()
    if why is not None:
        pytest.fail(f"network namespaces are needed for the partition tests: {why}")
    n = Net().up()
    yield n
    n.down()
