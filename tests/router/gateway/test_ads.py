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
from kvfleet.router.gateway.gate import Reply
from kvfleet.router.gateway.server import serve
from kvfleet.router.gateway_config import GatewayConfig

CONFIG = GatewayConfig(xds_port=18000)
FLEET = {"tiny": ["127.0.0.1:8001"]}


def _server() -> AdsServer:
    return AdsServer(xds.resources(CONFIG, FLEET))


def test_the_first_request_of_a_type_gets_every_resource_of_it_with_the_version_and_a_nonce() -> None:
    ads, sent = _server(), {}
    reply = ads.answer(DiscoveryRequest(type_url=xds.CLUSTER_TYPE), sent)
    assert reply is not None
    assert reply.type_url == xds.CLUSTER_TYPE
    assert reply.version_info == ads.version
    assert [r.unpack().name for r in reply.resources] == ["kvfleet_ext_proc", "kvfleet_engines/tiny"]
    assert reply.resources[1].unpack() == xds.engines_cluster(CONFIG, "tiny", FLEET["tiny"])
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


def test_an_answer_to_an_older_nonce_is_ignored_as_a_newer_response_is_on_its_way() -> None:
    ads, sent = _server(), {}
    first = ads.answer(DiscoveryRequest(type_url=xds.CLUSTER_TYPE), sent)
    assert first is not None
    ads.update(xds.resources(CONFIG, {"tiny": ["127.0.0.1:8001", "127.0.0.1:8002"]}))
    (pushed,) = ads.pushes(sent, {xds.CLUSTER_TYPE: first.version_info})
    late_ack = DiscoveryRequest(
        type_url=xds.CLUSTER_TYPE, version_info=first.version_info, response_nonce=first.nonce
    )
    assert ads.answer(late_ack, sent) is None
    assert ads.acked == {}
    ack = DiscoveryRequest(type_url=xds.CLUSTER_TYPE, version_info=ads.version, response_nonce=pushed.nonce)
    assert ads.answer(ack, sent) is None
    assert ads.acked == {xds.CLUSTER_TYPE: ads.version}


def test_an_update_is_owed_to_each_type_a_stream_asked_for_only_when_the_snapshot_changed() -> None:
    ads, sent, versions = _server(), {}, {}
    reply = ads.answer(DiscoveryRequest(type_url=xds.CLUSTER_TYPE), sent)
    assert reply is not None
    versions[xds.CLUSTER_TYPE] = reply.version_info
    assert ads.update(xds.resources(CONFIG, FLEET)) is False
    assert ads.pushes(sent, versions) == []
    assert ads.update(xds.resources(CONFIG, {})) is True
    (pushed,) = ads.pushes(sent, versions)
    assert (pushed.type_url, [r.unpack().name for r in pushed.resources]) == (
        xds.CLUSTER_TYPE,
        ["kvfleet_ext_proc"],
    )
    assert (pushed.version_info, versions, sent) == (
        ads.version,
        {xds.CLUSTER_TYPE: ads.version},
        {xds.CLUSTER_TYPE: pushed.nonce},
    )
    assert ads.pushes(sent, versions) == []


def test_a_type_the_gateway_does_not_serve_gets_an_empty_answer() -> None:
    ads, sent = _server(), {}
    route_type = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
    reply = ads.answer(DiscoveryRequest(type_url=route_type), sent)
    assert reply is not None
    assert (reply.type_url, reply.version_info, reply.resources) == (route_type, ads.version, [])


def test_the_version_is_a_digest_of_the_resources() -> None:
    other = AdsServer(xds.resources(GatewayConfig(xds_port=18001), FLEET))
    assert _server().version == _server().version
    assert other.version != _server().version


class _NoGate:
    def __init__(self) -> None:
        self.fleet: dict[str, list[str]] = {}

    async def admit(self, headers: object, body: bytes) -> Reply:
        return Reply.error(503, "unused", "no request reaches this gate")

    def endpoints(self) -> dict[str, list[str]]:
        return self.fleet


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
    assert [Cluster.parse(r.value).name for r in clusters.resources] == ["kvfleet_ext_proc"]
    assert [r.unpack() for r in listeners.resources] == [xds.listener(config)]
    assert ads.acked == {xds.CLUSTER_TYPE: ads.version}


async def test_a_changed_fleet_is_pushed_to_a_subscribed_envoy_unasked(free_port: Callable[[], int]) -> None:
    config = GatewayConfig(xds_port=free_port())
    gate = _NoGate()
    requests: asyncio.Queue[DiscoveryRequest | None] = asyncio.Queue()

    async def outgoing() -> AsyncIterator[DiscoveryRequest]:
        while (request := await requests.get()) is not None:
            yield request

    async with serve(gate, config) as ads:
        channel = Channel("127.0.0.1", config.xds_port)
        try:
            replies = AggregatedDiscoveryServiceAsyncStub(channel, timeout=10).stream_aggregated_resources(
                outgoing()
            )
            await requests.put(DiscoveryRequest(node=Node(id="test-node"), type_url=xds.CLUSTER_TYPE))
            first = await anext(replies)
            await requests.put(
                DiscoveryRequest(
                    type_url=xds.CLUSTER_TYPE, version_info=ads.version, response_nonce=first.nonce
                )
            )
            gate.fleet = {"tiny": ["127.0.0.1:8001"]}  # the router's fleet grows: the next sync pushes it
            pushed = await asyncio.wait_for(anext(replies), 10)
            await requests.put(None)
        finally:
            channel.close()
    assert [Cluster.parse(r.value).name for r in first.resources] == ["kvfleet_ext_proc"]
    assert [Cluster.parse(r.value) for r in pushed.resources][1:] == [
        xds.engines_cluster(config, "tiny", ["127.0.0.1:8001"])
    ]
    assert pushed.version_info == ads.version != first.version_info


async def test_until_acked_waits_for_an_ack_of_a_version_holding_the_resource() -> None:
    ads, sent = AdsServer(xds.resources(CONFIG)), {}
    assert await ads.until_acked(xds.CLUSTER_TYPE, "kvfleet_engines/tiny", 0.05) is False
    ads.update(xds.resources(CONFIG, FLEET))
    reply = ads.answer(DiscoveryRequest(type_url=xds.CLUSTER_TYPE), sent)
    assert reply is not None
    waiting = asyncio.create_task(ads.until_acked(xds.CLUSTER_TYPE, "kvfleet_engines/tiny", 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    ads.answer(
        DiscoveryRequest(type_url=xds.CLUSTER_TYPE, version_info=ads.version, response_nonce=reply.nonce),
        sent,
    )
    assert await waiting is True
    assert ads.acked_names == {xds.CLUSTER_TYPE: frozenset({"kvfleet_ext_proc", "kvfleet_engines/tiny"})}
