"""The router's ADS: what it answers to Envoy's requests, ACKs and NACKs, over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from envoy_data_plane.envoy.config.cluster.v3 import Cluster
from envoy_data_plane.envoy.config.core.v3 import Node
from envoy_data_plane.envoy.service.discovery.v3 import (
    AggregatedDiscoveryServiceAsyncStub,
    DiscoveryRequest,
)
from envoy_data_plane.google.rpc import Status
from grpclib.client import Channel

from kvfleet.router.gateway import xds
from kvfleet.router.gateway.ads import AdsServer
from kvfleet.router.gateway.config import GatewayConfig
from kvfleet.router.gateway.gate import Reply
from kvfleet.router.gateway.server import serve

CONFIG = GatewayConfig(xds_port=18000)


def _server() -> AdsServer:
    return AdsServer(xds.resources(CONFIG))


def test_the_first_request_of_a_type_gets_every_resource_of_it_with_the_version_and_a_nonce() -> None:
    ads, sent = _server(), {}
    reply = ads.answer(DiscoveryRequest(type_url=xds.CLUSTER_TYPE), sent)
    assert reply is not None
    assert reply.type_url == xds.CLUSTER_TYPE
    assert reply.version_info == ads.version
    assert [r.unpack().name for r in reply.resources] == ["kvfleet_ext_proc", "kvfleet_engines"]
    assert reply.resources[1].unpack() == xds.engines_cluster(CONFIG)
    assert sent == {xds.CLUSTER_TYPE: reply.nonce}


def test_an_ack_of_the_latest_nonce_is_recorded_and_answered_with_nothing() -> None:
    ads, sent = _server(), {}
    reply = ads.answer(DiscoveryRequest(type_url=xds.LISTENER_TYPE), sent)
    assert reply is not None
    ack = DiscoveryRequest(type_url=xds.LISTENER_TYPE, version_info=ads.version, response_nonce=reply.nonce)
    assert ads.answer(ack, sent) is None
    assert ads.acked == {xds.LISTENER_TYPE: ads.version}
    assert ads.rejected == {}


def test_a_nack_is_recorded_with_envoys_reason_and_not_resent() -> None:
    ads, sent = _server(), {}
    reply = ads.answer(DiscoveryRequest(type_url=xds.CLUSTER_TYPE), sent)
    assert reply is not None
    nack = DiscoveryRequest(
        type_url=xds.CLUSTER_TYPE,
        version_info="",
        response_nonce=reply.nonce,
        error_detail=Status(code=3, message="bad cluster"),
    )
    assert ads.answer(nack, sent) is None
    assert ads.rejected == {xds.CLUSTER_TYPE: "bad cluster"}
    assert ads.acked == {}


def test_a_type_the_gateway_does_not_serve_gets_an_empty_answer() -> None:
    ads, sent = _server(), {}
    route_type = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
    reply = ads.answer(DiscoveryRequest(type_url=route_type), sent)
    assert reply is not None
    assert (reply.type_url, reply.version_info, reply.resources) == (route_type, ads.version, [])


def test_the_version_is_a_digest_of_the_resources() -> None:
    other = AdsServer(xds.resources(GatewayConfig(xds_port=18001)))
    assert _server().version == _server().version
    assert other.version != _server().version


class _NoGate:
    async def admit(self, headers: object, body: bytes) -> Reply:
        return Reply.error(503, "unused", "no request reaches this gate")


async def test_a_client_over_grpc_gets_clusters_then_listeners_on_one_stream(
    free_port: Callable[[], int],
) -> None:
    config = GatewayConfig(xds_port=free_port())
    requests: asyncio.Queue[DiscoveryRequest | None] = asyncio.Queue()

    async def outgoing() -> AsyncIterator[DiscoveryRequest]:
        while (request := await requests.get()) is not None:
            yield request

    async with serve(_NoGate(), config) as ads:
        channel = Channel("127.0.0.1", config.xds_port)
        try:
            stub = AggregatedDiscoveryServiceAsyncStub(channel, timeout=10)
            replies = stub.stream_aggregated_resources(outgoing())
            node = Node(id="test-node")
            await requests.put(DiscoveryRequest(node=node, type_url=xds.CLUSTER_TYPE))
            clusters = await anext(replies)
            await requests.put(
                DiscoveryRequest(
                    type_url=xds.CLUSTER_TYPE, version_info=ads.version, response_nonce=clusters.nonce
                )
            )
            await requests.put(DiscoveryRequest(type_url=xds.LISTENER_TYPE))
            listeners = await anext(replies)
            await requests.put(None)
            assert [r async for r in replies] == []
        finally:
            channel.close()
    assert [Cluster.parse(r.value).name for r in clusters.resources] == [
        "kvfleet_ext_proc",
        "kvfleet_engines",
    ]
    assert [r.unpack() for r in listeners.resources] == [xds.listener(config)]
    assert ads.acked == {xds.CLUSTER_TYPE: ads.version}
