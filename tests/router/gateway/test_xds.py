"""The xDS resources and the bootstrap, field by field, and the real Envoy's verdict on them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

from kvfleet.router.gateway import xds
from kvfleet.router.gateway.process import envoy_binary
from kvfleet.router.gateway_config import GatewayConfig

CONFIG = GatewayConfig(xds_port=18000, listen_port=10001, admin_port=9902, message_timeout_s=12.5)
HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicitHttpConfig": {"http2ProtocolOptions": {}},
    }
}


def _one_endpoint(name: str, port: int) -> dict[str, object]:
    address = {"socketAddress": {"address": "127.0.0.1", "portValue": port}}
    return {"clusterName": name, "endpoints": [{"lbEndpoints": [{"endpoint": {"address": address}}]}]}


FLEET = {"tiny": ["127.0.0.1:8001", "127.0.0.1:8002"], "qwen": ["10.0.0.7:8000"]}


def _policy(name: str, typed: dict[str, object]) -> dict[str, object]:
    return {"policies": [{"typedExtensionConfig": {"name": name, "typedConfig": typed}}]}


def test_each_models_cluster_holds_its_engines_and_takes_them_in_the_order_ext_proc_lists() -> None:
    endpoints = [
        {"endpoint": {"address": {"socketAddress": {"address": "127.0.0.1", "portValue": p}}}}
        for p in (8001, 8002)
    ]
    round_robin = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
    }
    assert xds.engines_cluster(CONFIG, "tiny", FLEET["tiny"]).to_dict() == {
        "name": "kvfleet_engines/tiny",
        "type": "STATIC",
        "connectTimeout": "2s",
        "loadAssignment": {"clusterName": "kvfleet_engines/tiny", "endpoints": [{"lbEndpoints": endpoints}]},
        "loadBalancingPolicy": _policy(
            "envoy.load_balancing_policies.override_host",
            {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "overrideHostSources": [{"header": "x-gateway-destination-endpoint"}],
                "fallbackPolicy": _policy("envoy.load_balancing_policies.round_robin", round_robin),
            },
        ),
    }


def test_the_route_retries_only_failures_before_the_request_was_sent_each_on_a_new_engine() -> None:
    assert xds.retry_policy(CONFIG.model_copy(update={"num_retries": 3})).to_dict() == {
        "retryOn": "connect-failure,refused-stream,reset-before-request",
        "numRetries": 3,
        "retryHostPredicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typedConfig": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "hostSelectionRetryMaxAttempts": "5",
        "retryBackOff": {"baseInterval": "0.010s", "maxInterval": "0.100s"},
    }


def test_the_ext_proc_cluster_speaks_http2_to_the_routers_grpc_port() -> None:
    assert xds.ext_proc_cluster(CONFIG).to_dict() == {
        "name": "kvfleet_ext_proc",
        "type": "STATIC",
        "connectTimeout": "1s",
        "loadAssignment": _one_endpoint("kvfleet_ext_proc", 18000),
        "typedExtensionProtocolOptions": HTTP2,
    }


def test_the_listener_runs_ext_proc_then_the_router_filter_on_one_untimed_route() -> None:
    doc = xds.listener(CONFIG).to_dict()
    assert doc["name"] == "kvfleet_gateway"
    assert doc["address"] == {"socketAddress": {"address": "127.0.0.1", "portValue": 10001}}
    (chain,) = doc["filterChains"]
    (hcm,) = chain["filters"]
    assert hcm["name"] == "envoy.filters.network.http_connection_manager"
    manager = hcm["typedConfig"]
    assert manager["routeConfig"] == {
        "name": "kvfleet_routes",
        "virtualHosts": [
            {
                "name": "engines",
                "domains": ["*"],
                "routes": [
                    {
                        "match": {"prefix": "/"},
                        "route": {
                            "clusterHeader": "x-kvfleet-cluster",
                            "timeout": "0s",
                            "retryPolicy": xds.retry_policy(CONFIG).to_dict(),
                        },
                        "responseHeadersToAdd": [
                            {"header": {"key": "x-kvfleet-upstream", "value": "%UPSTREAM_HOST%"}}
                        ],
                    }
                ],
            }
        ],
    }
    assert [f["name"] for f in manager["httpFilters"]] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    assert manager["httpFilters"][0]["typedConfig"] == {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpcService": {"envoyGrpc": {"clusterName": "kvfleet_ext_proc"}},
        "processingMode": {
            "requestHeaderMode": "SEND",
            "responseHeaderMode": "SEND",
            "requestBodyMode": "BUFFERED",
            "responseBodyMode": "STREAMED",
            "requestTrailerMode": "SKIP",
            "responseTrailerMode": "SKIP",
        },
        "messageTimeout": "12.500s",
    }


def test_resources_are_keyed_by_their_xds_type_url_with_a_cluster_per_model_of_the_fleet() -> None:
    served = xds.resources(CONFIG, FLEET)
    assert sorted(served) == [xds.CLUSTER_TYPE, xds.LISTENER_TYPE]
    assert [c.name for c in served[xds.CLUSTER_TYPE]] == [
        "kvfleet_ext_proc",
        "kvfleet_engines/qwen",
        "kvfleet_engines/tiny",
    ]
    assert [c.name for c in xds.resources(CONFIG)[xds.CLUSTER_TYPE]] == ["kvfleet_ext_proc"]
    assert [listener.name for listener in served[xds.LISTENER_TYPE]] == ["kvfleet_gateway"]


def test_the_bootstrap_holds_only_the_ads_cluster_and_takes_listeners_and_clusters_from_ads() -> None:
    assert xds.bootstrap_json(CONFIG) == {
        "node": {"id": "kvfleet-gateway-0", "cluster": "kvfleet-gateway"},
        "staticResources": {
            "clusters": [
                {
                    "name": "kvfleet_xds",
                    "type": "STATIC",
                    "connectTimeout": "1s",
                    "loadAssignment": _one_endpoint("kvfleet_xds", 18000),
                    "typedExtensionProtocolOptions": HTTP2,
                }
            ]
        },
        "dynamicResources": {
            "ldsConfig": {"ads": {}, "resourceApiVersion": "V3"},
            "cdsConfig": {"ads": {}, "resourceApiVersion": "V3"},
            "adsConfig": {
                "apiType": "GRPC",
                "transportApiVersion": "V3",
                "grpcServices": [{"envoyGrpc": {"clusterName": "kvfleet_xds"}}],
                "setNodeOnFirstMessageOnly": True,
            },
        },
        "admin": {"address": {"socketAddress": {"address": "127.0.0.1", "portValue": 9902}}},
    }


def test_the_written_bootstrap_reads_back_as_the_same_message(tmp_path: Path) -> None:
    path = xds.write_bootstrap(CONFIG, tmp_path / "envoy.json")
    assert Bootstrap.from_dict(json.loads(path.read_text())) == xds.bootstrap(CONFIG)


def test_envoy_itself_accepts_the_bootstrap_and_every_served_resource(tmp_path: Path) -> None:
    # Envoy's validate mode builds the whole config without serving: the served listener
    # and clusters are put inline so that Envoy checks them, not only the bootstrap.
    static = xds.bootstrap(CONFIG)
    static.dynamic_resources = None
    assert static.static_resources is not None
    static.static_resources.listeners = [xds.listener(CONFIG)]
    static.static_resources.clusters += xds.resources(CONFIG, FLEET)[xds.CLUSTER_TYPE]
    inline = tmp_path / "inline.json"
    inline.write_text(static.to_json())
    dynamic = xds.write_bootstrap(CONFIG, tmp_path / "bootstrap.json")
    for path in (inline, dynamic):
        done = subprocess.run(
            [envoy_binary(), "--mode", "validate", "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"configuration '{path}' OK" in done.stdout + done.stderr
