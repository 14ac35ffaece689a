"""Benchmarks of the serving, run as ``python -m bench.serving.<module>`` from the repository root."""
