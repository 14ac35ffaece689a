"""The xDS resources the router serves to its Envoy gateway, and Envoy's bootstrap (docs/architecture.md §6).

Envoy starts from a minimal bootstrap (:func:`bootstrap`): a node id, an admin port and
one static cluster, the router's gRPC port, used for ADS. Over ADS the router then
serves (:func:`resources`):

- LDS: one listener, an HTTP connection manager whose filters are ext_proc (the
  router decides: reject, or name the engines) then the router filter; one route sends
  each request to the cluster ext_proc names in ``x-kvfleet-cluster``, without a
  timeout so streams can last, retrying a connection that failed before the request
  was sent on the next engine ext_proc listed (:func:`retry_policy`).
- CDS: the ext_proc cluster (the same gRPC port, HTTP/2) and one cluster per model of
  its ready engines, whose override-host policy sends a request to the engines of
  ``x-gateway-destination-endpoint`` in order. The router pushes a new snapshot when
  its fleet changes (:meth:`kvfleet.router.gateway.ads.AdsServer.update`).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import betterproto2
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapDynamicResources
from envoy_data_plane.envoy.config.bootstrap.v3 import BootstrapStaticResources as StaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    Cluster,
    ClusterDiscoveryType,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    AggregatedConfigSource,
    ApiConfigSource,
    ApiConfigSourceApiType,
    ApiVersion,
    ConfigSource,
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HeaderValue,
    HeaderValueOption,
    Http2ProtocolOptions,
    Node,
    SocketAddress,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.route.v3 import (
    RetryPolicy,
    RetryPolicyRetryBackOff,
    RetryPolicyRetryHostPredicate,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerCodecType,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
    OverrideHost,
    OverrideHostOverrideHostSource,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import RoundRobin
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.google.protobuf import Any as AnyProto

from kvfleet.router.gateway_config import (
    ADS_CLUSTER,
    CLUSTER_HEADER,
    ENDPOINTS_HEADER,
    ENGINES_CLUSTER,
    EXT_PROC_CLUSTER,
    LISTENER,
    NODE_CLUSTER,
    UPSTREAM_HEADER,
    GatewayConfig,
)

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
HTTP_OPTIONS_EXTENSION = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _address(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address (Envoy connects to those without resolving)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _router_cluster(name: str, host: str, port: int) -> Cluster:
    """The router's gRPC port as a cluster spoken to in HTTP/2 (gRPC needs it).

    STATIC for an IP address; STRICT_DNS for a name (the router's Service in a cluster),
    which Envoy resolves and re-resolves itself.
    """
    h2 = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()
        )
    )
    endpoint = LbEndpoint(endpoint=Endpoint(address=_address(host, port)))
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STATIC if is_ip(host) else ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=_seconds(1.0),
        typed_extension_protocol_options={HTTP_OPTIONS_EXTENSION: AnyProto.pack(h2)},
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[endpoint])]
        ),
    )


def ext_proc_cluster(config: GatewayConfig) -> Cluster:
    return _router_cluster(EXT_PROC_CLUSTER, config.xds_host, config.xds_port)


def model_cluster(model: str) -> str:
    """The name of the cluster of one model's engines (ext_proc names it in ``x-kvfleet-cluster``)."""
    return f"{ENGINES_CLUSTER}/{model}"


def _lb_policy(name: str, message: betterproto2.Message) -> LoadBalancingPolicy:
    extension = TypedExtensionConfig(name=name, typed_config=AnyProto.pack(message))
    return LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(typed_extension_config=extension)])


def engines_cluster(config: GatewayConfig, model: str, endpoints: Sequence[str]) -> Cluster:
    """One model's engines (``host:port``); each request goes to the ones ext_proc lists, in order.

    The override-host policy takes the first address of ``x-gateway-destination-endpoint``
    and, on each retry, the next; past the list (or for an address the cluster does not
    hold yet) it falls back to round robin over this model's engines only.
    """
    override = OverrideHost(
        override_host_sources=[OverrideHostOverrideHostSource(header=ENDPOINTS_HEADER)],
        fallback_policy=_lb_policy("envoy.load_balancing_policies.round_robin", RoundRobin()),
    )
    name = model_cluster(model)
    hosts = [LbEndpoint(endpoint=Endpoint(address=_address(*_split(at)))) for at in endpoints]
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STATIC,
        connect_timeout=_seconds(config.connect_timeout_s),
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=hosts)]
        ),
        load_balancing_policy=_lb_policy("envoy.load_balancing_policies.override_host", override),
    )


def _split(at: str) -> tuple[str, int]:
    host, _, port = at.rpartition(":")
    return host.strip("[]"), int(port)


def retry_policy(config: GatewayConfig) -> RetryPolicy:
    """Retry only what never reached an engine, each time on an engine not tried yet."""
    return RetryPolicy(
        retry_on="connect-failure,refused-stream,reset-before-request",
        num_retries=config.num_retries,
        retry_host_predicate=[
            RetryPolicyRetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=AnyProto.pack(PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=5,
        retry_back_off=RetryPolicyRetryBackOff(base_interval=_seconds(0.01), max_interval=_seconds(0.1)),
    )


def ext_proc_filter(config: GatewayConfig) -> ExternalProcessor:
    """Headers and the whole request body to the router; the response streamed past it."""
    return ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXT_PROC_CLUSTER)),
        failure_mode_allow=False,
        message_timeout=_seconds(config.message_timeout_s),
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SEND,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            request_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
            response_header_mode=ProcessingModeHeaderSendMode.SEND,
            response_body_mode=ProcessingModeBodySendMode.STREAMED,
            response_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
    )


def listener(config: GatewayConfig) -> Listener:
    upstream = HeaderValueOption(header=HeaderValue(key=UPSTREAM_HEADER, value="%UPSTREAM_HOST%"))
    route = Route(
        match=RouteMatch(prefix="/"),
        route=RouteAction(
            cluster_header=CLUSTER_HEADER, timeout=_seconds(0), retry_policy=retry_policy(config)
        ),
        response_headers_to_add=[upstream],
    )
    hcm = HttpConnectionManager(
        codec_type=HttpConnectionManagerCodecType.AUTO,
        stat_prefix="kvfleet",
        route_config=RouteConfiguration(
            name="kvfleet_routes", virtual_hosts=[VirtualHost(name="engines", domains=["*"], routes=[route])]
        ),
        http_filters=[
            HttpFilter(
                name="envoy.filters.http.ext_proc", typed_config=AnyProto.pack(ext_proc_filter(config))
            ),
            HttpFilter(name="envoy.filters.http.router", typed_config=AnyProto.pack(Router())),
        ],
    )
    hcm_filter = Filter(name="envoy.filters.network.http_connection_manager", typed_config=AnyProto.pack(hcm))
    return Listener(
        name=LISTENER,
        address=_address(config.listen_host, config.listen_port),
        filter_chains=[FilterChain(filters=[hcm_filter])],
    )


def resources(
    config: GatewayConfig, fleet: Mapping[str, Sequence[str]] | None = None
) -> dict[str, list[betterproto2.Message]]:
    """Every resource of the gateway, by xDS type URL, for a fleet of engines (host:port by model)."""
    engines = [engines_cluster(config, model, sorted(at)) for model, at in sorted((fleet or {}).items())]
    return {
        LISTENER_TYPE: [listener(config)],
        CLUSTER_TYPE: [ext_proc_cluster(config), *engines],
    }


def bootstrap(config: GatewayConfig) -> Bootstrap:
    """Envoy's start-up config: who it is, its admin port, and ADS at the router."""
    ads = ApiConfigSource(
        api_type=ApiConfigSourceApiType.GRPC,
        transport_api_version=ApiVersion.V3,
        grpc_services=[GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=ADS_CLUSTER))],
        set_node_on_first_message_only=True,
    )
    from_ads = ConfigSource(ads=AggregatedConfigSource(), resource_api_version=ApiVersion.V3)
    return Bootstrap(
        node=Node(id=config.node_id, cluster=NODE_CLUSTER),
        admin=Admin(address=_address("127.0.0.1", config.admin_port)),
        static_resources=StaticResources(
            clusters=[_router_cluster(ADS_CLUSTER, config.xds_host, config.xds_port)]
        ),
        dynamic_resources=BootstrapDynamicResources(ads_config=ads, lds_config=from_ads, cds_config=from_ads),
    )


def bootstrap_json(config: GatewayConfig) -> dict[str, Any]:
    """The bootstrap as the JSON Envoy reads with ``-c FILE``."""
    doc: dict[str, Any] = json.loads(bootstrap(config).to_json())
    return doc


def write_bootstrap(config: GatewayConfig, path: Path) -> Path:
    path.write_text(json.dumps(bootstrap_json(config), indent=2) + "\n")
    return path
