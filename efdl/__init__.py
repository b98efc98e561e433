"""efdl: an elastic, fault-tolerant launcher for PyTorch distributed training.

The worker-side API (``efdl.init_process_group``, ``efdl.elastic_state``, ``efdl.elastic``,
``efdl.ElasticSampler``, ``efdl.ElasticBatchSampler``) imports torch on first use, so the
agent and tools stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SAMPLERS = {"ElasticSampler", "ElasticBatchSampler"}
_STATE_API = {*_SAMPLERS, "ElasticState", "elastic", "elastic_state", "init_process_group"}

__all__ = ["__version__", *sorted(_STATE_API)]


def __getattr__(name: str) -> Any:
    if name in _STATE_API:
        module = "efdl.state.sampler" if name in _SAMPLERS else "efdl.state.elastic"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'efdl' has no attribute {name!r}")
