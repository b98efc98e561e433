#!/usr/bin/env bash
# Install what the tests need (into the current Python) and run them.
# Usage: bash scripts/test.sh [--quick] [pytest args...]
#   --quick: the unit tests alone (pure logic, every module; about a minute), for every edit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SELECT=()
if [ "${1:-}" = "--quick" ]; then
  shift
  SELECT=(tests/unit)
fi

# A bare `torch` requirement pulls gigabytes of CUDA wheels; the CPU build 2.13.0 is local.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[etcd,examples,dev]"

echo "== ruff"; "$PY" -m ruff check efdl tests benchmarks examples
echo "== mypy"; "$PY" -m mypy
echo "== pytest"
# Two tests at a time (EFDL_TEST_WORKERS): most of a test's time is waiting on processes,
# leases and windows, and every test must hold under load anyway. Tests that read one
# module fixture's run share an xdist_group (--dist loadgroup): one worker makes the run.
exec "$PY" -m pytest -n "${EFDL_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "${SELECT[@]}" "$@"
