"""Fixtures of the router's tests: a fake clock, a real Redis server, free ports."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from kvfleet.testing.processes import free_port


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
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing: `make system-deps` installs it"
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = RedisServer(url=f"redis://127.0.0.1:{port}/0", process=proc)
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        else:
            raise RuntimeError("redis-server did not start")
        yield server
    finally:
        client.close()
        server.stop()
