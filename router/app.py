"""Assembling a router: :func:`build_app` is the one way to run it, from the CLI or in-process.

Run one inside another program (the local fleet supervisor does)::

    from kvfleet.router.app import build_app
    from kvfleet.router.config import RouterConfig
    from kvfleet.router.discovery import Endpoint, StaticDiscovery

    discovery = StaticDiscovery()            # discovery.set_engines([Endpoint(url)]) as engines come and go
    app = build_app(RouterConfig(tenants=...), discovery=discovery, scaler=my_scaler)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8080)).serve()

Without ``discovery``, the config's ``engines`` (or, with ``kubernetes``, the cluster's
InferenceServices and pods) are used; without ``scaler``, ``kubernetes`` mode writes the
``/scale`` subresource and other modes do not autoscale. The lifespan starts the
load poller, the autoscaler, the tenant watcher, and closes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

import aiohttp
import httpx
from fastapi import FastAPI

from kvfleet.anthropic_api import AnthropicErrors
from kvfleet.http_guard import RequestGuard, install_error_handlers
from kvfleet.router.autoscaler import Autoscaler, ScaleInputs, Scaler
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Discovery, Service, StaticDiscovery
from kvfleet.router.errors import RouterError, router_error_handler
from kvfleet.router.fleet import Fleet, poll_forever
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.openapi import install_openapi
from kvfleet.router.quota import Clock, MemoryQuotaStore, QuotaStore
from kvfleet.router.routes import completions, health, messages, metrics, models, responses
from kvfleet.router.state import RouterState
from kvfleet.router.tenants import TenantRegistry
from kvfleet.router.usage import UsageLog
from kvfleet.tracing import tracing_from_env

if TYPE_CHECKING:
    from kvfleet.router.redis_store import RedisQuotaStore


def _quota_store(config: RouterConfig, clock: Clock) -> QuotaStore:
    if config.redis_url is None:
        return MemoryQuotaStore(clock=clock)
    from kvfleet.router.redis_store import RedisQuotaStore

    return RedisQuotaStore(url=config.redis_url, clock=clock, lease_s=config.redis_lease_s)


def _upstream_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The proxy's client: no pool limit (admission bounds the load), the config's timeouts."""
    timeout = aiohttp.ClientTimeout(
        total=None, connect=config.engine_connect_timeout_s, sock_read=config.engine_read_timeout_s
    )
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False, skip_auto_headers=("User-Agent",)
    )


def _usage_log(config: RouterConfig, metrics: RouterMetrics) -> UsageLog:
    assert config.usage_log is not None
    usage = UsageLog(config.usage_log, config.usage_log_max_bytes, config.usage_log_backups)
    usage.on_drop.append(metrics.usage_dropped.inc)
    return usage


def _scale_inputs(state: RouterState) -> Callable[[Service, int], ScaleInputs]:
    def inputs(service: Service, current: int) -> ScaleInputs:
        ready = [e for e in state.fleet.ready_engines(service.model) if e.load is not None]
        waiting = state.waiting(service.model) + sum(e.load.num_waiting for e in ready if e.load)
        kv = sum(e.load.kv_cache_usage for e in ready if e.load) / len(ready) if ready else 0.0
        busy = sum(e.load.num_running for e in ready if e.load) + sum(e.in_flight for e in ready)
        return ScaleInputs(current=current, waiting=waiting, kv_usage=kv, busy=busy)

    return inputs


def build_app(
    config: RouterConfig,
    *,
    scaler: Scaler | None = None,
    discovery: Discovery | None = None,
    clock: Clock = time.time,
) -> FastAPI:
    """A router app for ``config``; ``scaler`` and ``discovery`` replace the built-in ones."""
    tenants = TenantRegistry((t.api_key, t) for t in config.tenants)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            disc, scl = discovery, scaler
            if config.kubernetes:
                from kvfleet.router import kube

                cluster = await stack.enter_async_context(kube.cluster(config, tenants))
                disc = disc or cluster.discovery
                scl = scl or cluster.scaler
            disc = disc or StaticDiscovery(config.engines, default_kind=config.engine_kind)
            timeout = httpx.Timeout(config.engine_read_timeout_s, connect=config.engine_connect_timeout_s)
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=timeout))
            upstream = await stack.enter_async_context(_upstream_session(config))
            quota = _quota_store(config, clock)
            stack.push_async_callback(quota.close)
            state = RouterState(
                config, clock, tenants, quota, Fleet(config, clock), disc, RouterMetrics(), client, upstream
            )
            state.tracing = tracing_from_env("kvfleet-router")
            if state.tracing is not None:
                stack.callback(state.tracing.shutdown)
            if config.usage_log is not None:
                state.usage_log = _usage_log(config, state.metrics)
                stack.push_async_callback(asyncio.to_thread, state.usage_log.close)
            if config.redis_url is not None:
                state.queue_slots = cast("RedisQuotaStore", quota)
            app.state.router = state
            state.fleet.first_poll = asyncio.Event()
            tasks = [asyncio.create_task(poll_forever(state.fleet, disc, client))]
            if config.kv_events or config.kv_events_port is not None:
                from kvfleet.router.kv_events_sub import follow_kv_events

                tasks.append(asyncio.create_task(follow_kv_events(state)))
            if scl is not None:
                auto = Autoscaler(
                    scl,
                    _scale_inputs(state),
                    lambda: list(state.fleet.services.values()),
                    clock,
                    config.autoscale_interval_s,
                )
                state.autoscaler = auto
                tasks.append(asyncio.create_task(auto.run_forever()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="kvfleet router", lifespan=lifespan)
    install_error_handlers(app)
    app.add_exception_handler(RouterError, router_error_handler)
    for module in (completions, responses, models, health, metrics, messages):
        app.include_router(module.router)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_request_bytes, on_error=_count_unexpected(app))
    app.add_middleware(AnthropicErrors)  # /v1/messages errors in Anthropic's shape
    install_openapi(app)
    return app


def _count_unexpected(app: FastAPI) -> Callable[[Any, int], None]:
    """A 500 from a bug outside an admitted request (whose own settlement counts it) is counted as one."""

    def count(_: Any, status: int) -> None:
        state: RouterState | None = getattr(app.state, "router", None)
        if state is not None:
            state.metrics.reject("unknown", "unknown", "internal_error", status)

    return count
