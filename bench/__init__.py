"""Benchmarks that print figures against baselines measured in the same run (see bench/common.py)."""
