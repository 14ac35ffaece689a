"""The Envoy gateway's settings (docs/architecture.md §3 ``--envoy-xds-port``, §6 "Envoy gateway mode").

Where it sits: beside the router's own config, which holds them, and outside ``gateway/``, which
reads them, so neither package imports the other back.

One :class:`GatewayConfig` says where the router's gRPC server (ADS and ext_proc on one
port) listens, where Envoy listens for clients, and Envoy's admin port. The xDS
resources (:mod:`kvfleet.router.gateway.xds`) and the bootstrap file are rendered
from it and from nothing else.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

ENGINES_CLUSTER = "kvfleet_engines"  # one cluster per model: ``kvfleet_engines/<model>``
EXT_PROC_CLUSTER = "kvfleet_ext_proc"
ADS_CLUSTER = "kvfleet_xds"
LISTENER = "kvfleet_gateway"
NODE_CLUSTER = "kvfleet-gateway"
# Request headers ext_proc sets: the model's cluster, and the engines to try in order (the
# header of the Gateway API Inference Extension's endpoint-picker protocol).
CLUSTER_HEADER = "x-kvfleet-cluster"
ENDPOINTS_HEADER = "x-gateway-destination-endpoint"
# Response header Envoy adds: the engine that answered (after any retries); ext_proc removes it.
UPSTREAM_HEADER = "x-kvfleet-upstream"


class GatewayConfig(BaseModel):
    """Where each side of the gateway listens, and how long Envoy waits for the router."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    xds_host: str = Field(default="127.0.0.1", description="the router's gRPC address as Envoy dials it")
    xds_bind: str = Field(default="127.0.0.1", description="the address the router's gRPC server binds")
    xds_port: int = Field(ge=1, le=65535, description="ADS and ext_proc, one gRPC port")
    listen_host: str = Field(default="127.0.0.1", description="Envoy's listener for clients")
    listen_port: int = Field(default=10000, ge=1, le=65535)
    admin_port: int = Field(default=9901, ge=1, le=65535, description="Envoy's admin interface")
    node_id: str = Field(default="kvfleet-gateway-0", min_length=1)
    message_timeout_s: float = Field(
        default=15.0, gt=0, description="how long Envoy waits for one ext_proc answer (admission may queue)"
    )
    connect_timeout_s: float = Field(default=2.0, gt=0, description="Envoy's connect timeout to an engine")
    num_retries: int = Field(
        default=2,
        ge=0,
        le=8,
        description="engines Envoy tries after the router's choice when a connection fails before the request is sent",
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> GatewayConfig:
        ports = {"xds_port": self.xds_port, "listen_port": self.listen_port, "admin_port": self.admin_port}
        for name, port in ports.items():
            clash = [other for other, p in ports.items() if p == port and other != name]
            if clash:
                raise ValueError(f"{name}={port} is also {clash[0]}: the gateway needs three distinct ports")
        return self
