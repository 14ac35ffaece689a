"""Helpers that start real kvfleet processes for tests and benchmarks (torch-free)."""
