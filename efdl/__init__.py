"""efdl: an elastic, fault-tolerant launcher for PyTorch distributed training.

The worker-side API (``efdl.init_process_group``, ``efdl.elastic_state``, ``efdl.elastic``,
``efdl.ElasticSampler``, ``efdl.ElasticBatchSampler``, ``efdl.ElasticStream``, ``efdl.device``,
``efdl.fully_shard``) imports torch on
first use, so the agent and tools stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_STATE_API = {
    "ElasticSampler": "efdl.worker.sampler",
    "ElasticBatchSampler": "efdl.worker.sampler",
    "ElasticState": "efdl.worker.state",
    "ElasticStream": "efdl.data.stream",
    "elastic": "efdl.worker.elastic",
    "elastic_state": "efdl.worker.state",
    "init_process_group": "efdl.worker.runtime",
    "device": "efdl.worker.device",
    "fully_shard": "efdl.worker.sharded",
}

__all__ = ["__version__", *sorted(_STATE_API)]


def __getattr__(name: str) -> Any:
    if name in _STATE_API:
        return getattr(importlib.import_module(_STATE_API[name]), name)
    raise AttributeError(f"module 'efdl' has no attribute {name!r}")
