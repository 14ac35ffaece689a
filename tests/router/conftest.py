"""Fixtures of the router's tests: a fake clock, a real Redis server, a module's simulated engines."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvfleet.testing.processes import SimFlags, redis_process, sim_engines


@dataclass
class FakeClock:
    """A clock the test moves by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclass
class RedisServer:
    url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with redis_process() as (url, proc):
        yield RedisServer(url=url, process=proc)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """The URLs of the module's simulated engines, ``FLEET = (count, SimFlags)`` in the module, shared by
    the tests that leave them as they found them."""
    count, flags = request.module.FLEET
    assert isinstance(flags, SimFlags)
    with sim_engines(count, flags) as engines:
        yield [e.url for e in engines]
