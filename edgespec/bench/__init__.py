"""Benchmarking: the task suite (and later the bench and profile runners)."""
