"""Benchmarks of the peers, run as ``python -m bench.peers.<module>`` from the repository root."""
