"""The router's gRPC port for Envoy: ADS and ext_proc on one grpclib server (DESIGN §6).

``kvfleet router --envoy-xds-port P`` runs :func:`serve` next to the router's HTTP app,
in the same event loop, so ext_proc decisions use the very state the router's own
proxy uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from grpclib.server import Server

from kvfleet.router.gateway.ads import AdsServer
from kvfleet.router.gateway.config import GatewayConfig
from kvfleet.router.gateway.extproc import ExtProcServer
from kvfleet.router.gateway.gate import Gate
from kvfleet.router.gateway.xds import resources


@contextlib.asynccontextmanager
async def serve(gate: Gate, config: GatewayConfig) -> AsyncIterator[AdsServer]:
    """Listen on ``config.xds_bind:xds_port`` until the block exits; yields the ADS service."""
    ads = AdsServer(resources(config))
    server = Server([ads, ExtProcServer(gate)])
    await server.start(config.xds_bind, config.xds_port)
    try:
        yield ads
    finally:
        server.close()
        await server.wait_closed()
