"""kvfleet: serve large language models on Kubernetes.

This package is the shared, torch-free layer (docs/architecture.md §2): the command line, the
protocol types and constants the parts agree on, and the capacity maths. The parts
live beside it and are imported as ``kvfleet.engine``, ``kvfleet.router`` and
``kvfleet.operator``.
"""

__version__ = "0.1.0"
