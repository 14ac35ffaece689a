"""Run the engine app on uvicorn, draining on SIGTERM.

Where it sits: ``kvfleet engine`` calls :func:`serve`. On the first SIGTERM (or SIGINT)
the server keeps listening but drains: ``/ready`` answers 503 so Kubernetes and the
router stop sending, new generation requests get 503 with ``Retry-After``, and running
requests finish. Once none is left, or after ``drain_timeout`` seconds (the unfinished
ones are then aborted), uvicorn shuts down and the process exits 0. A second signal
exits at once.

When the engine core dies on its own (its process ended, its link closed, a step raised),
every request in flight has already been failed with a clean error; the server logs why at
ERROR, answers 503 on ``/ready``, ``/health`` and ``/load`` (``ready: false``) for up to
``DEATH_FLUSH_S`` while those error events reach their clients, then exits with
``EXIT_ENGINE_DEAD`` so that the Deployment or ``kvfleet up`` replaces the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvfleet.engine.server.state import ServerState
from kvfleet.streaming import DEFAULT_SEND_BUFFER_KIB, listen_socket

log = logging.getLogger(__name__)
ABORT_FLUSH_S = 0.2  # after aborting stragglers, time for their streams to send their last bytes
DEATH_FLUSH_S = 2.0  # after the core died, the longest the failed streams get to send their error events
EXIT_ENGINE_DEAD = 3


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task[None] | None = None
        self._death_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal: exit now
            return
        log.info("signal %s: draining (up to %.1f s)", sig, self.drain_timeout)
        self.state.draining = True
        asyncio.get_event_loop().call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        if not await self.state.in_flight.wait_idle(self.drain_timeout):
            log.warning("drain timeout: aborting %d unfinished requests", self.state.in_flight.count)
            for request_id in list(self.state.engine.unfinished_request_ids()):
                self.state.engine.abort(request_id)
            await self.state.in_flight.wait_idle(ABORT_FLUSH_S * 10)
            await asyncio.sleep(ABORT_FLUSH_S)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._death_task is None and (reason := self.state.engine.dead_reason) is not None:
            log.error("the engine core is dead (%s): exiting with code %d", reason, EXIT_ENGINE_DEAD)
            self.exit_code = EXIT_ENGINE_DEAD
            self._death_task = asyncio.ensure_future(self._die())
        return bool(await super().on_tick(counter))

    async def _die(self) -> None:
        await self.state.in_flight.wait_idle(DEATH_FLUSH_S)
        self.should_exit = True


def serve(
    app: FastAPI,
    state: ServerState,
    *,
    host: str,
    port: int,
    drain_timeout: float,
    log_level: str = "info",
    send_buffer_kib: int = DEFAULT_SEND_BUFFER_KIB,
) -> int:
    try:  # each connection's kernel send buffer fixed: a client that reads nothing stalls its stream soon
        sock = listen_socket(host, port, send_buffer_kib)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        return 1
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
        access_log=False,
    )
    server = DrainingServer(config, state, drain_timeout)
    with sock:
        server.run(sockets=[sock])
    return server.exit_code if server.started else 1
