"""Fixtures of the operator's emulator tests: kopf's real runtime against the emulated API server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvfleet.operator.testing.apiserver import ApiServer, serve
from kvfleet.operator.testing.cluster import User
from kvfleet.operator.testing.harness import kubeconfig_for


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[ApiServer, User]]:
    """The emulated API server and a user of it through the official ``kubernetes`` client."""
    async with serve() as server:
        with kubeconfig_for(server, tmp_path) as client:
            yield server, User(client)
