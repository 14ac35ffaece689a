"""Benchmarks of the kernels, run as ``python -m bench.kernels.<module>`` from the repository root."""
