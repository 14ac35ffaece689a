"""Benchmarks of the router, run as ``python -m bench.router.<module>`` from the repository root."""
