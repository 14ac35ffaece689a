"""Benchmarks of the gpu, run as ``python -m bench.gpu.<module>`` from the repository root."""
