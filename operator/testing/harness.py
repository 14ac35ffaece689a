"""Running the real kopf runtime of the operator against :mod:`.apiserver` in one event loop.

The test side talks to the emulator as a user does, with the official ``kubernetes``
client from a kubeconfig (in a thread, so the loop that serves the emulator and runs
kopf never blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import kopf
import kubernetes

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.runtime import operate, settings_for

from .apiserver import ApiServer, write_kubeconfig

T = TypeVar("T")


def quick_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """The operator's settings with kopf's waits shortened for an in-memory server."""
    settings = settings_for(config)
    settings.queueing.idle_timeout = 1.0
    settings.queueing.exit_timeout = 1.0
    settings.watching.reconnect_backoff = 0.2
    settings.persistence.consistency_timeout = 1.0
    return settings


@contextlib.contextmanager
def kubeconfig_for(server: ApiServer, folder: Path) -> Any:
    """Point ``KUBECONFIG`` at the emulator while inside; yields the test's ApiClient."""
    path = write_kubeconfig(folder / "kubeconfig", server)
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(path)
    client = kubernetes.config.new_client_from_config(config_file=str(path))
    try:
        yield client
    finally:
        client.close()
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous


@contextlib.asynccontextmanager
async def running_operator(
    config: OperatorConfig, settings: kopf.OperatorSettings | None = None
) -> AsyncIterator[None]:
    """kopf's runtime with the operator's handlers in its own thread and event loop (as in a pod:
    only its own tasks are its to stop), ready inside, stopped on exit; its failure is raised."""
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(
                operate(config, stop_flag=stop, ready_flag=ready, settings=settings or quick_settings(config))
            )
        except BaseException as exc:  # handed to the test below
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=main, name=f"kopf-operator-{config.priority}", daemon=True)
    thread.start()
    try:
        await asyncio.to_thread(ready.wait, 30)
        if failure:
            raise failure[0]
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
    if failure:
        raise failure[0]


async def eventually(probe: Callable[[], T | None], timeout: float = 15.0, what: str = "") -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout:g}s: {what}")
        await asyncio.sleep(0.05)


async def settle(server: ApiServer, quiet: float = 1.0, timeout: float = 20.0) -> int:
    """Wait until the server saw no request for ``quiet`` seconds; returns how many it saw."""
    deadline = time.monotonic() + timeout
    seen, since = len(server.requests), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if len(server.requests) != seen:
            seen, since = len(server.requests), time.monotonic()
        elif time.monotonic() - since >= quiet:
            return seen
    raise AssertionError(f"the operator never went quiet within {timeout:g}s")
