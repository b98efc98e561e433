"""efdl's benchmarks: scripts that print tables (never timed tests)."""
