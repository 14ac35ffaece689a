"""`kvfleet up`: a local fleet with no cluster: engine processes plus the router in this process.

Where it sits: the same router as in a cluster (:func:`kvfleet.router.app.build_app`),
with two local pieces plugged in. :class:`LocalFleet` is the autoscaler's
:class:`~kvfleet.router.autoscaler.Scaler`: asked for N replicas it starts or stops
``kvfleet engine`` processes, and tells the router's
:class:`~kvfleet.router.discovery.StaticDiscovery` which URLs exist. Engines are
separate processes (``python -m kvfleet.cli engine ...``), so the router's process never
imports torch; the router's poller decides when a new engine is ready (its ``/load``
answers) exactly as it does for pods. :meth:`LocalFleet.watch` plays the kubelet: an engine
whose process exits, or whose ``/health`` fails for ``health_grace_s`` after it once
answered, is replaced (with backoff when replacements come fast), and each replacement is
logged at WARNING. SIGHUP to ``kvfleet up`` rolls every engine (:meth:`LocalFleet.roll`) as a
Deployment with ``maxUnavailable: 0`` does: a replacement first, and only once the router
has it in rotation, the old engine drained (SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfleet.oslib import describe_exit, free_port
from kvfleet.resources import AutoscalingSpec
from kvfleet.router.config import RouterConfig, TenantEntry, stream_bounds
from kvfleet.router.discovery import Endpoint, Service, StaticDiscovery
from kvfleet.router.local_args import (
    LOCAL_API_KEY,
    add_arguments,
    fetch_model,
    local_tenants,
    served_name,
    tool_flags,
    validate,
)
from kvfleet.streaming import listen_socket

log = logging.getLogger("kvfleet.up")
__all__ = ["LOCAL_API_KEY", "LocalFleet", "add_arguments", "run"]  # the `kvfleet up` command


@dataclass
class EngineProcess:
    url: str
    process: subprocess.Popen[bytes]
    healthy_once: bool = False  # /health answered 200 at least once (it is past loading)
    failing_since: float | None = None  # monotonic time /health started failing, while it fails
    last_failure: str = ""


@dataclass
class LocalFleet:
    """Starts and stops engine processes for one service; the autoscaler's Scaler in local mode."""

    engine_command: list[str]  # `kvfleet engine` arguments, without --port
    host: str = "127.0.0.1"
    drain_timeout_s: float = 30.0
    engines: list[EngineProcess] = field(default_factory=list)
    on_change: list[Callable[[list[str]], None]] = field(default_factory=list)  # told the engine URLs
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    health_grace_s: float = 5.0  # /health failing this long (after it once answered): replace the engine
    restarts: list[float] = field(default_factory=list)  # monotonic times of replacements (for backoff)
    in_rotation: Callable[[str], bool] | None = None  # the router serves from this engine URL now
    ready_timeout_s: float = 300.0  # a rolling restart waits this long for each replacement
    surge: EngineProcess | None = None  # the replacement a rolling restart started (not a replica yet)

    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _notify(self) -> None:
        for callback in self.on_change:
            callback(self.urls())

    def start_engine(self) -> EngineProcess:
        port = free_port(self.host)
        argv = [sys.executable, "-m", "kvfleet.cli", "engine", *self.engine_command, "--host", self.host]
        process = subprocess.Popen([*argv, "--port", str(port)], start_new_session=True)
        engine = EngineProcess(f"http://{self.host}:{port}", process)
        self.engines.append(engine)
        self._notify()
        return engine

    def stop_engine(self, engine: EngineProcess) -> None:
        """Take the engine out of discovery first, then SIGTERM: it drains its streams and exits."""
        self.engines.remove(engine)
        self._notify()
        if engine.process.poll() is None:
            engine.process.send_signal(signal.SIGTERM)

    async def current_replicas(self, service: object) -> int:
        del service
        for engine in [e for e in self.engines if e.process.poll() is not None]:
            self._reap(engine, self._verdict(engine) or "")  # the autoscaler starts its replacement
        return len(self.engines) - (self.surge in self.engines)

    # Invariant (maxUnavailable 0, maxSurge 1): while rolling, the engines in rotation never drop
    # below the replicas asked for; an old engine is drained only once its replacement serves.
    async def roll(self) -> None:
        """Replace every engine, one at a time: start a new one, wait until it serves, drain the old one."""
        olds, replaced = list(self.engines), 0
        for old in olds:
            if old not in self.engines:
                continue  # the watcher replaced it meanwhile
            self.surge = fresh = self.start_engine()
            try:
                serving = await self._until_serving(fresh)
            finally:
                self.surge = None
            if not serving:
                log.warning(
                    "rolling restart: %s did not serve within %.0f s; stopped",
                    fresh.url,
                    self.ready_timeout_s,
                )
                return
            log.warning("rolling restart: %s serves; draining %s", fresh.url, old.url)
            if old in self.engines:
                self.stop_engine(old)
                await self._wait_exit(old)
            replaced += 1
        log.warning("rolling restart: done, %d engine(s) replaced", replaced)

    async def _until_serving(self, engine: EngineProcess) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(timeout=self.health_timeout_s) as client:
            while time.monotonic() < deadline and engine in self.engines:
                if await _is_ready(client, engine.url) and (
                    self.in_rotation is None or self.in_rotation(engine.url)
                ):
                    return True
                await asyncio.sleep(0.1)
        return False

    def _reap(self, engine: EngineProcess, why: str) -> None:
        log.warning("engine %s: %s; replacing it", engine.url, why)
        self.engines.remove(engine)
        self._notify()

    # Invariant: every engine in self.engines is either starting, healthy, or failing for less
    # than health_grace_s; one that exited or failed longer is replaced by a fresh process.
    async def watch(self) -> None:
        """Probe every engine's ``/health`` each ``health_interval_s``; replace the dead and the stuck."""
        async with httpx.AsyncClient(timeout=self.health_timeout_s) as client:
            while True:
                await asyncio.gather(*(self._probe(client, e) for e in list(self.engines)))
                for engine in list(self.engines):
                    why = self._verdict(engine)
                    if why is not None and engine in self.engines:
                        await self._replace(engine, why)
                await asyncio.sleep(self.health_interval_s)

    async def _probe(self, client: httpx.AsyncClient, engine: EngineProcess) -> None:
        try:
            response = await client.get(f"{engine.url}/health")
            failure = "" if response.status_code == 200 else f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__} {exc}".strip()
        if not failure:
            engine.healthy_once, engine.failing_since = True, None
        elif engine.healthy_once:
            engine.last_failure = failure
            if engine.failing_since is None:
                engine.failing_since = time.monotonic()

    def _verdict(self, engine: EngineProcess) -> str | None:
        """Why the engine must be replaced now, or None."""
        if engine.process.poll() is not None:
            return f"its process ended ({describe_exit(engine.process.returncode)})"
        if (
            engine.failing_since is not None
            and time.monotonic() - engine.failing_since >= self.health_grace_s
        ):
            return (
                f"/health failed for {time.monotonic() - engine.failing_since:.1f} s ({engine.last_failure})"
            )
        return None

    async def _replace(self, engine: EngineProcess, why: str) -> None:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 60.0] + [now]
        self._reap(engine, why)
        if engine.process.poll() is None:
            engine.process.kill()
        await asyncio.to_thread(engine.process.wait)
        if len(self.restarts) > 2:  # replacements coming fast: back off (1, 2, 4 ... 30 s)
            backoff = min(30.0, 0.5 * 2 ** (len(self.restarts) - 2))
            log.warning("%d engine replacements within a minute: waiting %.1f s", len(self.restarts), backoff)
            await asyncio.sleep(backoff)
        fresh = self.start_engine()
        log.warning("engine %s started in place of %s", fresh.url, engine.url)

    async def set_replicas(self, service: object, replicas: int) -> None:
        del service
        while len(self.engines) < replicas:
            self.start_engine()
        stopping = []
        while len(self.engines) - (self.surge in self.engines) > replicas:
            engine = [e for e in self.engines if e is not self.surge][-1]
            self.stop_engine(engine)
            stopping.append(engine)
        await asyncio.gather(*(self._wait_exit(e) for e in stopping))

    async def _wait_exit(self, engine: EngineProcess) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.process.wait), self.drain_timeout_s + 5)
        except asyncio.TimeoutError:
            engine.process.kill()

    async def close(self) -> None:
        engines = list(self.engines)
        for engine in engines:
            self.stop_engine(engine)
        await asyncio.gather(*(self._wait_exit(e) for e in engines))


async def _is_ready(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/ready")).status_code == 200
    except httpx.HTTPError:
        return False


def run(args: argparse.Namespace) -> int:
    from kvfleet.tracing import TracingConfigError, settings_from_env

    tenants: list[TenantEntry] = []
    error = validate(args)
    try:
        settings_from_env("kvfleet-router")
    except TracingConfigError as exc:
        error = str(exc)
    if error is None:
        tenants, error = local_tenants(args)
    if error is None and not args.simulate:
        if args.model == "smollm2":
            print("kvfleet up: fetching smollm2 (first run only) ...", file=sys.stderr, flush=True)
        error = fetch_model(args.model)
    if error:
        print(f"kvfleet up: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(args, tenants))
    except OSError as exc:  # the router's port taken
        print(f"kvfleet up: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(args: argparse.Namespace, tenants: list[TenantEntry]) -> None:
    import uvicorn

    from kvfleet.router.app import build_app

    config, fleet, discovery = _build(args, tenants)
    app = build_app(config, scaler=fleet, discovery=discovery)
    sock = listen_socket(args.host, args.port, config.stream_send_buffer_kib)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
    await fleet.set_replicas(None, args.replicas)
    key_note = "" if args.tenants else f" (API key: {LOCAL_API_KEY})"
    print(
        f"kvfleet up: {args.replicas} engine(s) of {served_name(args)!r}; router on "
        f"http://{args.host}:{args.port}/v1{key_note}",
        flush=True,
    )
    # uvicorn stops gracefully on SIGINT/SIGTERM, then restores the handlers it found and
    # raises the signal again; with ours in place that second delivery only asks to stop,
    # so the engines below are drained instead of orphaned.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    rolls: list[asyncio.Task[None]] = []
    loop.add_signal_handler(signal.SIGHUP, lambda: _start_roll(rolls, fleet.roll))
    fleet.in_rotation = lambda url: any(
        e.url == url for e in app.state.router.fleet.ready_engines(served_name(args))
    )
    watcher = asyncio.create_task(fleet.watch())
    try:
        with sock:
            await server.serve(sockets=[sock])
    finally:
        for task in [watcher, *rolls]:
            task.cancel()
        await fleet.close()


def _start_roll(rolls: list[asyncio.Task[None]], roll: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """SIGHUP: a rolling restart of every engine, unless one is under way."""
    if rolls and not rolls[-1].done():
        log.warning("SIGHUP: a rolling restart is already under way")
        return
    log.warning("SIGHUP: rolling restart of every engine")
    rolls.append(asyncio.create_task(roll()))


def _build(
    args: argparse.Namespace, tenants: list[TenantEntry]
) -> tuple[RouterConfig, LocalFleet, StaticDiscovery]:
    name = served_name(args)
    low = args.replicas if args.min_replicas is None else args.min_replicas
    high = max(args.replicas, low) if args.max_replicas is None else args.max_replicas
    autoscaling = AutoscalingSpec(
        min_replicas=max(low, 1),
        max_replicas=high,
        scale_to_zero=low == 0,
        target_queue_depth=args.target_queue_depth,
    )
    service = Service(name=name, model=name, namespace="local", policy=args.policy, autoscaling=autoscaling)
    config = RouterConfig(
        tenants=tenants,
        host=args.host,
        port=args.port,
        policy=args.policy,
        **stream_bounds(args),
    )
    discovery = StaticDiscovery([], services=(service,))
    engine_command = ["--model", args.model, "--served-model-name", name, "--log-level", args.log_level]
    engine_command += tool_flags(args) + args.engine_arg
    if args.simulate:
        engine_command.append("--simulate")
    fleet = LocalFleet(engine_command)
    fleet.on_change.append(
        lambda urls: discovery.set_engines([Endpoint(u, service.key) for u in urls], (service,))
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return config, fleet, discovery
