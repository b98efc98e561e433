"""The GPU suite: collected everywhere, run where torch sees a CUDA GPU (scripts/gpu-check.sh).

One GPU is enough: NCCL runs at world size 1 (it refuses two ranks on one GPU), and several
ranks share the GPU over gloo with CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu-check.sh on a GPU machine")
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
