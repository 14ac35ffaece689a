"""Waiting in async tests for something another task or thread brings about, a bounded number of times."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(done: Callable[[], object], tries: int, pause: float = 0.01) -> None:
    """Poll ``done`` up to ``tries`` times, ``pause`` seconds apart, returning once it holds; the caller asserts after."""
    for _ in range(tries):
        if done():
            return
        await asyncio.sleep(pause)
