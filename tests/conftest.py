"""Process-wide test set-up that must happen before any test module is imported.

Triton decides, when a function is decorated with ``@triton.jit`` (its own standard library
at ``import triton``, our kernels at ``import kvfleet.engine.kernels``), whether it is
compiled for a GPU or run by the interpreter. Several imports pull triton in early
(``transformers``' Llama model does), so on a machine without CUDA the interpreter is
switched on here, once, before anything imports triton. It stays on for the whole run:
only code that launches triton kernels reads it, and on the CPU those need it. On a machine
with CUDA nothing changes and the kernels are compiled.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The process-node tests start a control plane of their own: they run after everything else (after
# e2e/cluster's package cluster is torn down, whose pods' loopback addresses theirs would share), and
# on a fresh machine their first test may wait for the binaries' cold build (`make cluster-prebuild`).
PROCESS_NODE_TESTS = Path(__file__).parent / "cluster" / "test_process_node.py"
BUILD_WAIT_S = 2700


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [item for item in items if item.path == PROCESS_NODE_TESTS]
    if not last:
        return
    items[:] = [item for item in items if item.path != PROCESS_NODE_TESTS] + last
    from kvfleet.cluster import binaries

    if binaries.built() is None:
        last[0].add_marker(pytest.mark.timeout(BUILD_WAIT_S))
