"""Fixtures of the gateway's tests: free ports, and the generated Envoy types imported quietly.

The generated ``envoy_data_plane`` modules trip a pydantic deprecation warning at import
time (a classmethod ``model_validator``); it is theirs, not ours, so they are imported
once here with that warning silenced.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import kvfleet.router.gateway.server  # noqa: F401  (imports every generated module the gateway uses)

from kvfleet.testing import processes


@pytest.fixture
def free_port() -> Callable[[], int]:
    """A function returning a port of 127.0.0.1 that nothing listens on."""
    return processes.free_port


@pytest.fixture(scope="module")
def free_port_module() -> Callable[[], int]:
    return processes.free_port
