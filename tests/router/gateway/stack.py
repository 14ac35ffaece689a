"""The gateway stack the real-Envoy tests drive: engines, the router with its gateway, an Envoy.

Shared by the gateway's tests and the chart's (which runs the bootstrap Helm renders).
The generated ``envoy_data_plane`` modules trip a pydantic deprecation warning at import
time (theirs, not ours); they are imported here with it silenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import openai

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvfleet.router.gateway.server import attach

from kvfleet.router.app import build_app
from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.router.gateway.process import EnvoyError, EnvoyProcess
from kvfleet.router.gateway_config import GatewayConfig
from kvfleet.router.state import RouterState

from ..fakes import FakeEngine, served

ALPHA, BETA = "sk-alpha-0123456789", "sk-beta-0123456789"


def tenant(name: str, key: str, **limits: Any) -> TenantEntry:
    return TenantEntry.model_validate({"tenant": name, "apiKey": key, "limits": limits})


@dataclass
class Stack:
    envoy: EnvoyProcess
    state: RouterState
    engines: dict[str, FakeEngine]  # host:port -> engine

    def client(self, key: str = ALPHA) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.envoy.url}/v1", api_key=key, max_retries=0)

    def received(self) -> dict[str, int]:
        return {at: len(e.received) for at, e in self.engines.items()}

    def counted(self, tenant: str, code: str) -> float:
        value: float = self.state.metrics.requests.labels(model="tiny", tenant=tenant, code=code)._value.get()
        return value


async def _fleet_known(state: RouterState, urls: list[str], dead: tuple[str, ...]) -> None:
    for _ in range(200):
        known = state.fleet.engines
        if all(u in known for u in (*urls, *dead)) and all(known[u].load is not None for u in urls):
            return
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _attempt(
    free_port: Callable[[], int],
    engines: list[FakeEngine],
    tenants: list[TenantEntry],
    dead: tuple[str, ...],
    gw: GatewayConfig,
    bootstrap: Mapping[str, Any] | None,
    cfg: Mapping[str, Any],
) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(served(e.app(), free_port())) for e in engines]
        config = RouterConfig(
            engines=urls + list(dead),
            tenants=tenants,
            **{"load_interval_s": 0.05, "load_stale_s": 5.0, **cfg},
        )
        app = attach(build_app(config), gw)
        await stack.enter_async_context(served(app, free_port()))
        state: RouterState = app.state.router
        await _fleet_known(state, urls, dead)
        envoy = EnvoyProcess(gw, bootstrap=bootstrap)
        stack.push_async_callback(asyncio.to_thread, envoy.stop)
        try:
            await asyncio.to_thread(envoy.start)
        except EnvoyError as e:
            ads = app.state.ads
            raise EnvoyError(
                f"{e}\n(the router's ADS saw {ads.streams} streams, {ads.requests} requests)"
            ) from e
        yield Stack(envoy, state, {u.removeprefix("http://"): e for u, e in zip(urls, engines, strict=True)})


@contextlib.asynccontextmanager
async def gateway(
    free_port: Callable[[], int],
    engines: list[FakeEngine],
    tenants: list[TenantEntry],
    dead: tuple[str, ...] = (),
    *,
    gw: GatewayConfig | None = None,
    bootstrap: Mapping[str, Any] | None = None,
    **cfg: Any,
) -> AsyncIterator[Stack]:
    """Engines (and ``dead`` URLs), a router with its gateway attached, an Envoy bootstrapped from it.

    ``gw`` and ``bootstrap`` (default: fresh ports, the bootstrap rendered from ``gw``) let a
    test run the gateway and the bootstrap another source rendered. An Envoy whose first
    ADS fetch never completes (seen once in CI: 60 s with no answer from a router that
    answers at once on every other run) gets one whole fresh stack: new router, new ports.
    """
    async with contextlib.AsyncExitStack() as outer:
        for attempt in (1, 2):
            ports = gw or GatewayConfig(xds_port=free_port(), listen_port=free_port(), admin_port=free_port())
            try:
                s = await outer.enter_async_context(
                    _attempt(free_port, engines, tenants, dead, ports, bootstrap, cfg)
                )
                break
            except EnvoyError:
                if attempt == 2:
                    raise
        yield s
