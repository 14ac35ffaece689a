"""The xDS resources and the bootstrap, field by field, and the real Envoy's verdict on them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

from kvfleet.router.gateway import xds
from kvfleet.router.gateway.config import GatewayConfig
from kvfleet.router.gateway.process import envoy_binary

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


def test_the_engines_cluster_is_original_dst_on_the_engine_header() -> None:
    assert xds.engines_cluster(CONFIG).to_dict() == {
        "name": "kvfleet_engines",
        "type": "ORIGINAL_DST",
        "connectTimeout": "2s",
        "lbPolicy": "CLUSTER_PROVIDED",
        "originalDstLbConfig": {"useHttpHeader": True, "httpHeaderName": "x-kvfleet-engine"},
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
                    {"match": {"prefix": "/"}, "route": {"cluster": "kvfleet_engines", "timeout": "0s"}}
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


def test_resources_are_keyed_by_their_xds_type_url() -> None:
    served = xds.resources(CONFIG)
    assert sorted(served) == [xds.CLUSTER_TYPE, xds.LISTENER_TYPE]
    assert [c.name for c in served[xds.CLUSTER_TYPE]] == ["kvfleet_ext_proc", "kvfleet_engines"]
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
    static.static_resources.clusters += [xds.ext_proc_cluster(CONFIG), xds.engines_cluster(CONFIG)]
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
