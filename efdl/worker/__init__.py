"""The worker side: in-process elasticity for efdl-aware training scripts.

Its API is reached through ``efdl`` (``efdl.init_process_group``...), imported on first use:
it needs torch, and the agent reads ``efdl.worker.cache`` and ``efdl.worker.channel`` without.
"""
