"""efdl: an elastic, fault-tolerant launcher for PyTorch distributed training."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
