"""The router's gRPC port for Envoy: ADS and ext_proc on one grpclib server (docs/architecture.md §6).

``kvfleet router --envoy-xds-port P`` runs :func:`serve` next to the router's HTTP app,
in the same event loop, so ext_proc decisions use the very state the router's own
proxy uses. While it runs, the gate's engines are read every ``SYNC_INTERVAL_S`` and a
changed set becomes a new ADS snapshot that Envoy gets at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from grpclib.server import Server

from kvfleet.router.gateway.ads import AdsServer
from kvfleet.router.gateway.extproc import ExtProcServer
from kvfleet.router.gateway.gate import Admitted, Gate
from kvfleet.router.gateway.router_gate import RouterGate
from kvfleet.router.gateway.xds import CLUSTER_TYPE, model_cluster, resources
from kvfleet.router.gateway_config import GatewayConfig

SYNC_INTERVAL_S = 0.1
CLUSTER_WAIT_S = 2.0  # how long a request for a model Envoy has no cluster for yet waits for one


async def _sync_forever(gate: Gate, config: GatewayConfig, ads: AdsServer) -> None:
    while True:
        await asyncio.sleep(SYNC_INTERVAL_S)
        ads.update(resources(config, gate.endpoints()))


@contextlib.asynccontextmanager
async def serve(gate: Gate, config: GatewayConfig) -> AsyncIterator[AdsServer]:
    """Listen on ``config.xds_bind:xds_port`` until the block exits; yields the ADS service."""
    ads = AdsServer(resources(config, gate.endpoints()))

    async def cluster_ready(admitted: Admitted) -> None:
        # An engine of a model new to the fleet may be chosen before the next sync: push
        # now, and hold the request until Envoy has the model's cluster (else Envoy has
        # nowhere to send it). Without it by the deadline, Envoy answers 503 itself.
        name = model_cluster(admitted.model)
        if name not in ads.acked_names.get(CLUSTER_TYPE, frozenset()):
            ads.update(resources(config, gate.endpoints()))
            await ads.until_acked(CLUSTER_TYPE, name, CLUSTER_WAIT_S)

    server = Server([ads, ExtProcServer(gate, cluster_ready)])
    await server.start(config.xds_bind, config.xds_port)
    sync = asyncio.create_task(_sync_forever(gate, config, ads))
    try:
        yield ads
    finally:
        sync.cancel()
        server.close()
        await server.wait_closed()


def attach(app: FastAPI, config: GatewayConfig) -> FastAPI:
    """Run the gateway's gRPC server for as long as the router ``app`` runs, on its state.

    The router's own lifespan (:func:`kvfleet.router.app.build_app`) starts first, so the
    gate decides with the same tenants, quotas, queues and fleet as the router's proxy.
    """
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with inner(app), serve(RouterGate(app.state.router, config.num_retries), config) as ads:
            app.state.ads = ads
            yield

    app.router.lifespan_context = lifespan
    return app
