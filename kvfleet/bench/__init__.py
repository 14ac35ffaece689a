"""``kvfleet bench``: load-test any OpenAI-compatible endpoint (torch-free).

``run_load(LoadSpec(...))`` is the load-generation core other benches call (the router's
too); ``summarize`` turns its records into the figures ``kvfleet bench`` prints.
"""

from kvfleet.bench.dists import Distribution, parse_distribution
from kvfleet.bench.load import LoadSpec, run_load
from kvfleet.bench.stats import BenchSummary, RequestRecord, summarize

__all__ = [
    "BenchSummary",
    "Distribution",
    "LoadSpec",
    "RequestRecord",
    "parse_distribution",
    "run_load",
    "summarize",
]
