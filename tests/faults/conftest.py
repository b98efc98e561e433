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
        Path(path).write_text(render(OUTCOMES))


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
