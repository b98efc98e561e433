#!/usr/bin/env bash
# MosaicML streaming for benchmarks/data.py, apart from the project's environment:
#   bash benchmarks/mosaic/install.sh [DIR]   (default /tmp/efdl-mosaic)
#   python -m benchmarks.data --readers plain,efdl,mosaic --mosaic DIR ...
# mosaicml-streaming 0.13 pins numpy < 2.2 and transformers < 5 and needs torchvision; with
# its dependencies it would replace this environment's numpy and transformers, and there
# is no CPU build of torchvision here. So it goes into DIR without its dependencies, with
# what it imports (transformers 4 and what that imports), and a stand-in for torchvision
# (stand_in/torchvision: its vision data sets import it; the benchmark reads tokens). Only
# the benchmark's Mosaic ranks put DIR on their path.
set -euo pipefail
dir="${1:-/tmp/efdl-mosaic}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pip install -q --no-deps --target "$dir" "mosaicml-streaming==0.13.0" "transformers>=4.21.3,<5" \
    "huggingface-hub>=0.34,<1.0" "tokenizers>=0.22,<=0.23" safetensors zstd python-snappy \
    cramjam Brotli catalogue "xxhash<4"
cp -r "$here/stand_in/torchvision" "$dir/"
python - "$dir" <<'PY'
import subprocess, sys
subprocess.run(
    [sys.executable, "-c", "from streaming import StreamingDataset, MDSWriter"],
    env={"PYTHONPATH": sys.argv[1], "PATH": ""}, check=True,
)
print(f"MosaicML streaming imports from {sys.argv[1]}")
PY
